"""Backups that refuse new replicas (their replica count or --disk-limit reached): the broker
places each virtual segment elsewhere and every acknowledged record is read back exactly once."""

from __future__ import annotations

import faultkit as fk
from faultkit import call

from kera import Producer

RECORDS = 20_000          # 64-byte values: ~1.3 MB, about 20 virtual segments of 64 KiB
VSEG_BYTES = 64 * 1024


def stats(address: str) -> dict:
    return call(address, "stats")["stats"]


def run(cluster, limit_args: list[str], refused_counter: str) -> None:
    cluster.backups[0].args += limit_args
    cluster.restart_backup(0)
    with cluster.admin() as admin:
        admin.create_stream("s", streamlets=2, replication=2, durability="disk")
    with Producer(cluster.bootstrap, request_timeout_s=5.0) as p:
        p.send_batch("s", fk.values(0, 0, RECORDS))
        p.flush(120)
    refusing, other = stats(cluster.backups[0].address), stats(cluster.backups[1].address)
    broker = stats(cluster.brokers[0].address)
    assert refusing[refused_counter] > 0, refusing
    assert other["replicas"] > refusing["replicas"]
    assert broker.get("replica_failures", 0) > 0
    everything = fk.read_everything(cluster.bootstrap, "s", RECORDS)
    fk.check_exactly_once(everything, [RECORDS], [set()], "reader")


def test_replica_count_limit_places_elsewhere_and_loses_nothing(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=2, heartbeat_interval_ms=100,
                            extra_broker_args=["--virtual-segment-bytes", str(VSEG_BYTES),
                                               "--virtual-logs", "1"])
    run(cluster, ["--max-replicas-per-broker", "2"], "replicas_refused")
    assert stats(cluster.backups[0].address)["replicas"] <= 2


def test_disk_limit_places_elsewhere_and_loses_nothing(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=2, heartbeat_interval_ms=100,
                            extra_broker_args=["--virtual-segment-bytes", str(VSEG_BYTES),
                                               "--virtual-logs", "1"])
    run(cluster, ["--disk-limit", "200KiB"], "disk_full")
    assert stats(cluster.backups[0].address)["disk_bytes"] <= 200 * 1024
