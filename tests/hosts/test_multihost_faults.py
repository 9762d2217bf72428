"""A cluster across six test hosts (network namespaces; layout in host_layout.py), clients on the
root namespace's host: every virtual segment's replicas land on different hosts, and fault
rounds under continuous produce/consume with R=3 (kill -9 a broker, pause a backup, partition a
broker's, a backup's or the coordinator's host and heal it) lose and duplicate no acknowledged
record. Ten rounds take about 1.5 minutes: not marked slow."""

from __future__ import annotations

import time

import faultkit as fk
from faultkit import call, wait_for

import host_layout as layout

STREAM = "hosts"
HEARTBEAT_MS = 100
MISSED_MAX = 30          # a daemon is declared dead after 3 s of silence
VSEG_BYTES = 128 * 1024  # small virtual segments: many placement decisions
DEAD_WINDOW_S = HEARTBEAT_MS * MISSED_MAX / 1000
PLACED_MIN = 16         # virtual segments placed before placement is checked
PAUSE_S = 5.0            # a paused backup outlives the dead window: it is declared dead
PARTITION_S = 6.0        # a partitioned broker host too: its streamlets fail over


def start(multihost, **kw):
    hosts, cluster = multihost(
        **kw, heartbeat_interval_ms=HEARTBEAT_MS, virtual_logs=2, log_level="INFO",
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
    hosts, cluster = start(multihost, backups=2 * len(layout.BACKUP_HOSTS),
                           layout_of=layout.paired_backups)
    members = call(cluster.bootstrap, "cluster")
    # Each daemon advertises its own host's address and names its host as its node.
    assert {(m["address"].split(":")[0], m["node"]) for m in members["brokers"] + members["backups"]} \
        == {(hosts.address(i), hosts.name(i)) for i in layout.BROKER_HOSTS + layout.BACKUP_HOSTS}
    work = fk.Workload(cluster.bootstrap, STREAM, producers=2).start()
    wait_for(lambda: len(replica_hosts(cluster)) >= PLACED_MIN, "virtual segments to be replicated")
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


# ---------------------------------------------------------------------- fault rounds
ROUNDS = ("kill", "pause", "partition", "partition_backup", "partition_coordinator") * 2


def status(cluster) -> dict:
    return call(cluster.bootstrap, "recovery_status")


def healthy(cluster) -> None:
    """Every daemon registered and alive, no streamlet left recovering."""
    cluster.wait_registered(timeout_s=fk.WAIT_S)
    wait_for(lambda: status(cluster)["recovering"] == [], "every streamlet recovered")


def owning_broker(cluster, rng) -> int:
    """A broker owning streamlets (failovers concentrate them: a restarted one owns none)."""
    placement = call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]["placement"]
    return rng.choice(sorted(set(placement)))


def failed_over(cluster, i: int, epochs: dict) -> None:
    wait_for(lambda: [i, epochs[i]] in status(cluster)["failed"],
             f"broker {i} to be declared dead and failed over")


def kill_broker(hosts, cluster, rng) -> str:
    i = owning_broker(cluster, rng)
    epochs = dict(map(tuple, status(cluster)["epochs"]))
    cluster.kill_broker(i)
    if rng.random() < 0.5:
        failed_over(cluster, i, epochs)
    cluster.restart_broker(i)
    return f"kill -9 broker {i} on {hosts.name(layout.host_of(cluster.brokers[i]))}, restarted"


def pause_backup(hosts, cluster, rng) -> str:
    i = rng.randrange(len(cluster.backups))
    with layout.paused(cluster.backups[i]):
        wait_for(lambda: not call(cluster.bootstrap, "cluster")["backups"][i]["alive"],
                 f"paused backup {i} to be declared dead")
        time.sleep(rng.uniform(0.0, PAUSE_S))   # brokers re-replicate what it held meanwhile
    return f"backup {i} paused until declared dead, then resumed"


def partition_broker(hosts, cluster, rng) -> str:
    i = owning_broker(cluster, rng)
    host = layout.host_of(cluster.brokers[i])
    epochs = dict(map(tuple, status(cluster)["epochs"]))
    hosts.partition(host)
    try:
        failed_over(cluster, i, epochs)
        time.sleep(rng.uniform(0.0, PARTITION_S))   # it keeps running, cut off, meanwhile
    finally:
        hosts.heal(host)
    return f"broker {i}'s host {hosts.name(host)} partitioned until failed over, then healed"


def partition_backup(hosts, cluster, rng) -> str:
    i = rng.randrange(len(cluster.backups))
    host = layout.host_of(cluster.backups[i])
    hosts.partition(host)
    try:
        wait_for(lambda: not call(cluster.bootstrap, "cluster")["backups"][i]["alive"],
                 f"cut-off backup {i} to be declared dead")
        time.sleep(rng.uniform(0.0, PARTITION_S))
    finally:
        hosts.heal(host)
    return f"backup {i}'s host {hosts.name(host)} partitioned until declared dead, then healed"


def partition_coordinator(hosts, cluster, rng) -> str:
    host = layout.COORDINATOR_HOST
    hosts.partition(host)
    try:
        # It hears from nobody for longer than the dead window.
        time.sleep(DEAD_WINDOW_S + rng.uniform(0.0, PARTITION_S))
    finally:
        hosts.heal(host)
    return f"the coordinator's host {hosts.name(host)} partitioned, then healed"


FAULTS = {"kill": kill_broker, "pause": pause_backup, "partition": partition_broker,
          "partition_backup": partition_backup, "partition_coordinator": partition_coordinator}


def test_fault_rounds_across_hosts_keep_every_acknowledged_record_exactly_once(multihost):
    rng = fk.seeded("multihost fault rounds")
    hosts, cluster = start(multihost)
    work = fk.Workload(cluster.bootstrap, STREAM, producers=2).start()
    kinds = list(ROUNDS)
    rng.shuffle(kinds)
    for n, kind in enumerate(kinds):
        time.sleep(rng.uniform(0.3, 1.5))   # a random moment of the workload
        started = time.monotonic()
        how = FAULTS[kind](hosts, cluster, rng)
        healthy(cluster)
        print(f"round {n}: {how}; healthy after {time.monotonic() - started:.1f} s; "
              f"sent {work.sent}, acknowledged {work.acked}")
    time.sleep(0.5)
    work.stop_producing()
    assert not work.errors, work.errors
    assert min(work.acked) > 0
    work.drain()
    assert not work.errors, work.errors
    fk.check_exactly_once(work.read, work.acked, work.uncertain, "consumer through the faults")
    everything = fk.read_everything(cluster.bootstrap, STREAM, sum(work.acked))
    fk.check_exactly_once(everything, work.acked, work.uncertain, "fresh consumer")
    assert status(cluster)["recovering"] == []
