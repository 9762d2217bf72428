"""A replica damaged on a backup's disk: recovery notices (the backup verifies what it reads
back) and reads the same bytes from another copy; nothing is lost or duplicated."""

from __future__ import annotations

import faultkit as fk
from faultkit import call, wait_for

from kera import Producer

STREAM = "damaged"
RECORDS = 12_000


def test_recovery_reads_another_copy_of_a_damaged_flushed_replica(fresh_cluster):
    cluster = fresh_cluster(
        brokers=2, backups=3, heartbeat_interval_ms=100, log_level="INFO",
        extra_broker_args=["--virtual-segment-bytes", str(32 * 1024)],
        extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        d = admin.create_stream(STREAM, streamlets=1, replication=3, durability="disk",
                                segment_size_bytes=64 * 1024)
    owner = d["placement"][0]
    survivor = 1 - owner
    with Producer(cluster.bootstrap, request_timeout_s=3.0) as p:
        for start in range(0, RECORDS, 1000):
            p.send_batch(STREAM, fk.values(0, start, 1000))
        p.flush(60)   # durability "disk": acknowledged once fsynced on both backups

    # Damage every replica of the owner on backup 0, then restart it so that it serves
    # them from disk (verifying each chunk as it reads it back).
    cluster.kill_backup(0)
    damaged = sorted((cluster.data_dir / "backup-0" / str(owner)).glob("*.seg"))
    assert len(damaged) >= 4, damaged
    for path in damaged:
        with open(path, "r+b") as f:
            f.seek(64 + 10)          # inside the first chunk's body
            byte = f.read(1)
            f.seek(64 + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
    cluster.restart_backup(0)

    epoch = dict(map(tuple, call(cluster.bootstrap, "recovery_status")["epochs"]))[owner]
    cluster.kill_broker(owner)
    wait_for(lambda: [owner, epoch] in call(cluster.bootstrap, "recovery_status")["failed"],
             "the owner to be failed over")
    wait_for(lambda: call(cluster.bootstrap, "recovery_status")["recovering"] == [],
             "the streamlet to be recovered")

    backup = call(cluster.backups[0].address, "stats")["stats"]
    broker = call(cluster.brokers[survivor].address, "stats")["stats"]
    print("backup 0 corrupt chunks:", backup.get("disk_chunks_corrupt"),
          "recovery read failures:", broker.get("recovery_read_failures"))
    assert backup.get("disk_chunks_corrupt", 0) >= 1          # a damaged copy was read ...
    assert broker.get("recovery_read_failures", 0) >= 1       # ... and abandoned
    assert broker.get("recovery_bytes_unreadable", 0) == 0    # another copy had every byte
    assert broker.get("recovery_dropped_chunks", 0) == 0

    everything = fk.read_everything(cluster.bootstrap, STREAM, RECORDS)
    fk.check_exactly_once(everything, [RECORDS], [set()], "reader after recovery")
