"""The broker's transactions over real daemons, with kera's wire only (no transactional client):
a transactional chunk is verified with the coordinator before it is stored, read_committed
readers see it only once the coordinator's commit marker is durable, read_uncommitted ones at
once, and an aborted transaction's records never reach a read_committed reader."""

from __future__ import annotations

import time

from kera.codec import chunk, txn
from kera.net.rpc import Connection

TIMEOUT_S = 20.0


def _read(broker: Connection, sid: int, isolation: str) -> list:
    header, frames = broker.call("fetch", {"reads": [[sid, 0, {"low": 0, "offsets": {}}, 1 << 20]],
                                           "isolation": isolation})
    assert header["results"][0][0] is None, header
    return [v for f in frames for c in chunk.frame_chunks(f) for v in chunk.Chunk(c).values()]


def _until(fn, want, what: str):
    deadline = time.monotonic() + TIMEOUT_S
    while (got := fn()) != want:
        assert time.monotonic() < deadline, f"{what}: {got!r}"
        time.sleep(0.05)


def test_commit_and_abort_through_coordinator_and_broker(local_cluster):
    cluster = local_cluster(brokers=1)
    with cluster.admin() as admin:
        admin.create_stream("txout", streamlets=1)
        desc = admin.describe_stream("txout")
    sid = desc["id"]
    coord = Connection(cluster.bootstrap.split(",")[0])
    broker = Connection(cluster.brokers[0].address)
    try:
        ids = coord.call("txn_init", {"transactional_id": "job-1", "timeout_ms": 60_000})[0]
        pid, epoch = ids["producer_id"], ids["epoch"]
        owner = {"transactional_id": "job-1", "producer_id": pid, "epoch": epoch}
        kpid = txn.kera_producer_id(pid, epoch)

        def produce(seq: int, value: bytes):
            c = chunk.encode(kpid, txn.txn_sequence(seq), sid, 0, [value])
            header, _ = broker.call("produce", {}, [c])
            assert isinstance(header["results"][0][0], int), header

        produce(0, b"committed")
        assert _read(broker, sid, "read_uncommitted") == [b"committed"]
        assert _read(broker, sid, "read_committed") == []
        assert coord.call("txn_describe", {"transactional_id": "job-1"})[0]  # the part was added
        coord.call("txn_end", {**owner, "commit": True})
        _until(lambda: _read(broker, sid, "read_committed"), [b"committed"], "after the commit")

        # the next transaction opens again (the id completes once its marker is durable)
        _until(lambda: _try_end(coord, owner), True, "the first transaction to complete")
        produce(1, b"aborted")
        coord.call("txn_end", {**owner, "commit": False})
        _until(lambda: _read(broker, sid, "read_uncommitted"), [b"committed", b"aborted"],
               "read_uncommitted")
        time.sleep(0.5)   # the abort marker lands meanwhile: hidden open and once aborted
        assert _read(broker, sid, "read_committed") == [b"committed"]
    finally:
        coord.close()
        broker.close()


def _try_end(coord: Connection, owner: dict) -> bool:
    state = coord.call("txn_describe", {"transactional_id": owner["transactional_id"]})[0]
    return str(state.get("state", "")).lower() in ("completecommit", "complete_commit")
