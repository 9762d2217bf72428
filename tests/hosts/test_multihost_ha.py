"""Three coordinators and a three-member etcd on three test hosts (network namespaces), brokers
and backups on others, clients on the root namespace's host: under continuous produce/consume
with R=3, kill -9 of the leader coordinator, a partition of the (new) leader's host, and kill -9
of the leader together with a broker each end with a new leader serving, the cluster healthy,
and every acknowledged record read exactly once (issue 13: several coordinators across hosts).
"""

from __future__ import annotations

import time

import faultkit as fk
from faultkit import call, wait_for

import host_layout as layout

STREAM = "ha-hosts"
HEARTBEAT_MS = 100
MISSED_MAX = 30            # daemons are declared dead after 3 s of silence
LEASE_S = 2                # a dead or cut-off leader is replaced within about this long
COORDINATOR_HOSTS = (1, 2, 3)
ETCD_HOSTS = (1, 2, 3)


def ha_layout(name: str) -> int:
    """Coordinators on hosts 1-3 (`coordinator`, `coordinator-1`, `coordinator-2`), the rest
    as host_layout places them."""
    if name.startswith("coordinator"):
        _, _, index = name.partition("-")
        return COORDINATOR_HOSTS[int(index or 0)]
    return layout.layout(name)


def new_leader(cluster, not_this: int) -> tuple[int, float]:
    started = time.monotonic()
    found = []
    wait_for(lambda: (found.append(cluster.leader_index()) or found[-1]) not in (None, not_this),
             "another coordinator to lead")
    return found[-1], time.monotonic() - started


def healthy(cluster) -> None:
    cluster.wait_registered(timeout_s=fk.WAIT_S)
    wait_for(lambda: call(cluster.bootstrap, "recovery_status")["recovering"] == [],
             "every streamlet recovered")


def test_leader_kills_and_a_partitioned_leader_host_keep_every_record(test_hosts, fresh_cluster,
                                                                       tmp_path):
    from tests.etcd_cluster import EtcdCluster, etcd_binary
    binary, why = etcd_binary()
    assert binary is not None, why
    hosts = test_hosts(layout.HOSTS)
    etcd = EtcdCluster(tmp_path / "etcd", members=len(ETCD_HOSTS), binary=binary,
                       hosts=[(hosts.address(i), list(hosts.prefix(i))) for i in ETCD_HOSTS])
    try:
        etcd.start()
        cluster = fresh_cluster(
            coordinators=len(COORDINATOR_HOSTS), where=layout.placement(hosts, ha_layout),
            brokers=len(layout.BROKER_HOSTS), backups=len(layout.BACKUP_HOSTS),
            heartbeat_interval_ms=HEARTBEAT_MS, log_level="INFO", extra_coordinator_args=[
                "--heartbeat-missed-max", str(MISSED_MAX), "--metadata", etcd.url,
                "--leader-lease-s", str(LEASE_S)])
        rounds(hosts, cluster)
    finally:
        etcd.stop()


def rounds(hosts, cluster) -> None:
    with cluster.admin(timeout_s=fk.WAIT_S) as admin:
        admin.create_stream(STREAM, streamlets=4, active_groups=2, replication=3)
    work = fk.Workload(cluster.bootstrap, STREAM, producers=2).start()
    wait_for(lambda: sum(work.acked) > 1000, "records acknowledged")
    leader = cluster.leader_index()

    cluster.kill_coordinator(leader)
    leader2, took_s = new_leader(cluster, leader)
    healthy(cluster)
    print(f"leader kill -9 -> coordinator {leader2} leads after {took_s:.1f} s")
    cluster.restart_coordinator(wait=False, i=leader)

    host = ha_layout(cluster.coordinators[leader2].name)
    hosts.partition(host)
    try:
        leader3, took_s = new_leader(cluster, leader2)
        print(f"leader's host {hosts.name(host)} cut off -> coordinator {leader3} leads after "
              f"{took_s:.1f} s")
    finally:
        hosts.heal(host)
    healthy(cluster)

    victim = call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]["placement"][0]
    cluster.kill_coordinator(leader3)
    cluster.kill_broker(victim)
    new_leader(cluster, leader3)
    cluster.restart_broker(victim)
    cluster.restart_coordinator(wait=False, i=leader3)
    healthy(cluster)

    work.stop_producing()
    assert not work.errors, work.errors
    work.drain()
    assert not work.errors, work.errors
    fk.check_exactly_once(work.read, work.acked, work.uncertain, "consumer through leader changes")
    everything = fk.read_everything(cluster.bootstrap, STREAM, sum(work.acked))
    fk.check_exactly_once(everything, work.acked, work.uncertain, "fresh consumer")
