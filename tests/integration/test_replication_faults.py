"""Replication faults end to end (real coordinator, broker and backups as subprocesses):

- a backup that stops answering (SIGSTOP) makes the broker move the open virtual segment to
  another backup and re-send what it holds: every acknowledgement still stands on R copies,
  and the coordinator's map of who holds what follows;
- replication writes with a bad checksum, a truncated frame, trailing bytes, an out-of-order
  offset or an unknown virtual segment are refused by a backup that a live broker replicates
  to, store nothing, and the broker's replication goes on unharmed.
"""

from __future__ import annotations

import signal
import time

import pytest

from kera.codec import chunk

from kera.net import rpc
from kera.errors import KeraError

from test_replication import (BROKER_ID, Writer, broker_chunks, create, flushed, identity,
                              replica_chunks, replica_list, seg_file, stats_of, wait_for)

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = [pytest.mark.timeout(180), pytest.mark.security_modes]


def holdings(address: str) -> dict[tuple, bytes]:
    """Every chunk a backup holds for the broker, by identity (from memory or disk)."""
    out = {}
    for r in replica_list(address):
        for c in replica_chunks(address, r["vlog"], r["vseg"]):
            out[identity(c)] = c
    return out


def test_a_backup_that_stops_answering_is_replaced_and_no_ack_is_lost(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=3, log_level="WARNING",
                            extra_broker_args=["--virtual-segment-bytes", str(128 * 1024)])
    broker = cluster.brokers[0].address
    sid = create(cluster, "stop", replication=3, streamlets=2)
    writer = Writer(broker, producer_id=21)
    writer.send_all([[writer.chunk(sid, 0), writer.chunk(sid, 1)] for _ in range(20)])

    # Stop a backup that holds the open virtual segment: the next writes to it go unanswered.
    open_holders = {}
    for i, b in enumerate(cluster.backups):
        for r in replica_list(b.address):
            if not r["closed"]:
                open_holders[(r["vlog"], r["vseg"])] = open_holders.get((r["vlog"], r["vseg"]), []) + [i]
    newest = max(open_holders)
    victim = open_holders[newest][0]
    live = [i for i in range(3) if i != victim]
    stopped_at = time.monotonic()
    cluster.backups[victim].signal(signal.SIGSTOP)
    try:
        # Stalls for the replication timeout, then goes on with the other two backups.
        writer.send_all([[writer.chunk(sid, 0), writer.chunk(sid, 1)] for _ in range(30)],
                        budget_s=90)
        after = [k for k, t in writer.acked.items() if t > stopped_at]
        assert len(after) == 60
        served = {identity(c): c for sl in (0, 1) for c in broker_chunks(broker, sid, sl)}
        # The stopped backup cannot have acknowledged anything since: every chunk acknowledged
        # after the stop is on both other backups, byte for byte the broker's copy.
        for i in live:
            held = holdings(cluster.backups[i].address)
            for k in after:
                assert held.get((21, *k)) == served[(21, *k)], f"backup {i} lacks {k}"
        s = stats_of(broker)
        assert s.get("replica_failures", 0) + s.get("replicas_lost", 0) >= 1
        assert s["durable_lag_bytes"] == 0

        # The coordinator learns where every virtual segment is now: the two live backups
        # (the stopped one is declared dead meanwhile and its replicas are rebuilt elsewhere).
        def map_moved() -> bool:
            with cluster.admin() as admin:
                entries = admin.replicas(broker_id=BROKER_ID)
            return entries and all(sorted(e[3]) == live for e in entries)
        wait_for(map_moved, "the coordinator's map to leave the stopped backup")
    finally:
        cluster.backups[victim].signal(signal.SIGCONT)

    # Nothing acknowledged is lost, and each streamlet reads back in order.
    for sl in (0, 1):
        seqs = [identity(c)[3] for c in broker_chunks(broker, sid, sl)]
        assert seqs == list(range(50))
    assert len(writer.acked) == 100
    writer.close()


# ---------------------------------------------------------------------------- bad frames

def test_bad_replication_writes_are_refused_and_store_nothing(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING")
    broker, backup = cluster.brokers[0].address, cluster.backups[0].address
    sid = create(cluster, "bad", replication=2)
    writer = Writer(broker, producer_id=22)
    writer.send_all([[writer.chunk(sid)] for _ in range(5)])
    [rep] = replica_list(backup)
    vlog, vseg, length = rep["vlog"], rep["vseg"], rep["length"]

    foreign = chunk.encode(99, 0, sid, 0, [b"z" * 50] * 5)
    flipped = bytearray(foreign)
    flipped[len(foreign) // 2] ^= 0x10
    base = {"broker_id": BROKER_ID, "vlog": vlog, "vseg": vseg, "offset": length,
            "durability": "memory", "close": False}
    cases = [
        ("bad checksum", {}, [bytes(flipped)], "corrupt_chunk"),
        ("good then truncated", {}, [foreign, foreign[:-7]], "corrupt_chunk"),
        ("truncated header", {}, [foreign[:20]], "corrupt_chunk"),
        ("trailing bytes", {}, [foreign + b"\0\0\0"], "corrupt_chunk"),
        ("empty frame", {}, [b""], "corrupt_chunk"),
        ("offset past the end", {"offset": length + len(foreign)}, [foreign], "bad_request"),
        ("rewrite from 0", {"offset": 0}, [foreign], "bad_request"),
        ("unknown virtual segment", {"vseg": vseg + 999, "offset": 4096}, [foreign], "bad_request"),
        ("bad durability", {"durability": "paper"}, [foreign], "bad_request"),
        ("offset not an integer", {"offset": "0"}, [foreign], "bad_request"),
    ]
    rejected_before = stats_of(backup)["chunks_rejected"]
    # What a broker sends: in a secure cluster only broker 0's key may write its replicas.
    key = str(cluster.keys.secret("broker-0")) if cluster.keys else None
    with rpc.Connection(backup, timeout_s=5, key_file=key) as conn:
        for what, override, frames, code in cases:
            with pytest.raises(KeraError) as err:
                conn.call("replicate", {**base, **override}, frames)
            assert err.value.code == code, what
            # (the flusher may have moved disk_length meanwhile: that is not a store)
            assert [(r["vlog"], r["vseg"], r["length"], r["closed"]) for r in replica_list(backup)] \
                == [(vlog, vseg, length, False)], f"{what}: something was stored"
    assert stats_of(backup)["chunks_rejected"] - rejected_before >= 5

    # The broker's own replication carries on at the right offset: the foreign chunk never got
    # into the replica, which holds exactly the broker's chunks, in memory and on disk.
    writer.send_all([[writer.chunk(sid)] for _ in range(5)])
    served = broker_chunks(broker, sid)
    assert [identity(c)[3] for c in served] == list(range(10))
    assert replica_chunks(backup, vlog, vseg) == served
    wait_for(lambda: flushed(backup), "the backup to flush")
    assert seg_file(cluster, 0, vlog, vseg).read_bytes() == b"".join(served)
    assert stats_of(broker).get("replica_failures", 0) == 0
    writer.close()


# ---------------------------------------------------------------------------- bounds, disk errors

def test_bounded_backup_buffers_push_back_and_lose_nothing(fresh_cluster):
    # Tiny bounds: nearly every write finds the flusher busy and is answered `throttled`; the
    # broker retries it, and flushed bytes leave memory to keep under the memory bound.
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                            extra_backup_args=["--max-unflushed-bytes", str(16 * 1024),
                                               "--max-memory-bytes", str(64 * 1024)])
    broker, backup = cluster.brokers[0].address, cluster.backups[0].address
    sid = create(cluster, "bounded", replication=2, streamlets=2)
    writer = Writer(broker, producer_id=23)
    writer.send_all([[writer.chunk(sid, 0), writer.chunk(sid, 1)] for _ in range(60)], window=8)
    assert len(writer.acked) == 120
    k, b = stats_of(backup), stats_of(broker)
    assert k["throttled"] >= 1 and b["replication_throttled"] >= 1
    assert k["memory_bytes"] <= 64 * 1024 + 8 * 1024   # the bound, plus at most one chunk
    served = {identity(c): c for sl in (0, 1) for c in broker_chunks(broker, sid, sl)}
    assert holdings(backup) == served          # memory or disk, nothing lost or added
    wait_for(lambda: flushed(backup), "the backup to flush")
    for r in replica_list(backup):
        data = seg_file(cluster, 0, r["vlog"], r["vseg"]).read_bytes()
        assert data == b"".join(replica_chunks(backup, r["vlog"], r["vseg"]))
    writer.close()


def test_a_backup_whose_disk_fails_reports_it_and_the_broker_moves_on(fresh_cluster):
    # A file where backup 1's directory for broker 0 belongs: every flush there fails, as on a
    # full disk. With "disk" durability, its acknowledgements become storage errors.
    cluster = fresh_cluster(brokers=1, backups=2, virtual_logs=4, log_level="WARNING")
    (cluster.data_dir / "backup-1").mkdir(exist_ok=True)
    (cluster.data_dir / "backup-1" / str(BROKER_ID)).write_bytes(b"not a directory")
    broker = cluster.brokers[0].address
    sids = [create(cluster, f"full-{i}", replication=2, durability="disk") for i in range(4)]
    writer = Writer(broker, producer_id=24)
    writer.send_all([[writer.chunk(sid) for sid in sids] for _ in range(10)], budget_s=90)
    assert len(writer.acked) == 40
    failing, healthy = stats_of(cluster.backups[1].address), stats_of(cluster.backups[0].address)
    assert failing["storage_errors"] >= 1, "the failing disk was never written to"
    assert cluster.backups[1].running(), "a failing disk must not stop the backup"
    assert stats_of(broker)["replica_failures"] >= 1
    # Every acknowledged chunk is on the healthy backup's disk.
    reps = replica_list(cluster.backups[0].address)
    assert all(r["disk_length"] == r["length"] for r in reps)
    on_disk = {identity(c) for r in reps
               for c in _chunks(seg_file(cluster, 0, r["vlog"], r["vseg"]).read_bytes())}
    assert on_disk >= {(24, *k) for k in writer.acked}
    writer.close()


def _chunks(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        size = chunk.chunk_size(data, at)
        out.append(data[at:at + size])
        at += size
    return out
