"""The broker daemon as a real subprocess (with a real coordinator and backups): it survives
thousands of malformed messages and still serves exact produce/fetch; replicated produce is
acknowledged through backups, and a backup killed with SIGKILL loses nothing and its replicas
are rebuilt on the surviving backup."""

from __future__ import annotations

import random
import struct
import time

import msgpack
import pytest
import zmq

from kera.codec import chunk

from kera.net import rpc

from kera.codec import wire
from kera.errors import KeraError

WAIT_S = 30.0


def wait_for(cond, what: str, timeout_s: float = WAIT_S, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


class Writer:
    """A minimal idempotent producer over rpc: one chunk per streamlet per request, a window of
    requests in flight, retries of retriable refusals with the same sequence."""

    def __init__(self, address: str, sid: int, producer_id: int, timeout_s: float = 15.0):
        self.conn = rpc.Connection(address, timeout_s=timeout_s)
        self.sid = sid
        self.pid = producer_id
        self.seq: dict[int, int] = {}
        self.acked: list[tuple[int, int, list]] = []   # (streamlet, seq, [g, seg, base, number])

    def write(self, streamlet: int, count: int, values=(b"value",) * 20, window: int = 8):
        todo = []
        for _ in range(count):
            seq = self.seq.get(streamlet, 0)
            self.seq[streamlet] = seq + 1
            todo.append((seq, chunk.encode(self.pid, seq, self.sid, streamlet, list(values))))
        in_flight: dict[int, tuple[int, bytes]] = {}
        deadline = time.monotonic() + WAIT_S * 2
        while todo or in_flight:
            assert time.monotonic() < deadline, "writes never completed"
            while todo and len(in_flight) < window:
                seq, c = todo.pop(0)
                in_flight[self.conn.send("produce", {}, [c])] = (seq, c)
            header, _ = self.conn.recv()
            seq, c = in_flight.pop(header["id"])
            if not header["ok"]:
                assert header["retriable"], header
                todo.insert(0, (seq, c))
                time.sleep(0.05)
                continue
            [res] = header["results"]
            if isinstance(res[0], str):
                assert res[2], res   # only retriable refusals are expected here
                todo.insert(0, (seq, c))
                time.sleep(0.05)
                continue
            self.acked.append((streamlet, seq, res))
        # A retried sequence may be re-sent after a later one was refused with a gap: re-order.
        self.acked.sort(key=lambda a: (a[0], a[1]))

    def close(self):
        self.conn.close()


def read_all(address: str, sid: int, streamlet: int, max_bytes: int = 64 * 1024) -> list:
    """Every durable chunk of a streamlet, as a consumer reads it."""
    low, offsets, out = 0, {}, []
    with rpc.Connection(address, timeout_s=10) as conn:
        for _ in range(100_000):
            header, frames = conn.call("fetch", {"reads": [[sid, streamlet, {"low": low, "offsets": offsets}, max_bytes]]})
            err, n, groups = header["results"][0]
            assert err is None, err
            for view in (v for f in frames for v in chunk.frame_chunks(f)):
                c = chunk.Chunk(view)               # verifies both checksums and the columns
                h = c.header
                assert h.base_offset == offsets.get(h.group, 0), "gap or duplicate in a group"
                offsets[h.group] = h.base_offset + len(c)
                out.append(c)
            described = {g[0]: g for g in groups}
            while low in described and described[low][4] and offsets.get(low, 0) == described[low][3]:
                offsets.pop(low, None)
                low += 1
            if not frames:
                return out
    raise AssertionError("reading never ended")


def broker_stats(address: str) -> dict:
    return rpc.call(address, "stats", timeout_s=5)[0]["stats"]


# ---------------------------------------------------------------------------- fuzzing

def _valid_chunk(rng, sid):
    return chunk.encode(rng.randrange(1000, 2000), 0, sid, 0, [b"f" * rng.randrange(1, 50)] * rng.randrange(1, 30))


def _damaged(rng, sid) -> bytes:
    buf = bytearray(_valid_chunk(rng, sid))
    kind = rng.randrange(6)
    if kind == 0:
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        buf = buf[:rng.randrange(len(buf))]
    elif kind == 2:
        buf += bytes(rng.randrange(1, 100))
    elif kind == 3:   # checksums made consistent again, layout fields wrong
        struct.pack_into("<I", buf, 44, rng.randrange(2**32))
        struct.pack_into("<I", buf, 4, chunk.header_crc(buf))
    elif kind == 4:
        struct.pack_into("<I", buf, 12, rng.randrange(2**32))
        struct.pack_into("<I", buf, 4, chunk.header_crc(buf))
    else:
        buf[3] = rng.randrange(256) | chunk.FLAG_KEYS   # claims key columns it lacks
        struct.pack_into("<I", buf, 4, chunk.header_crc(buf))
    return bytes(buf)


def _junk(rng, depth=0):
    choices = [lambda: rng.randrange(-2**63, 2**64), lambda: rng.random(), lambda: None,
               lambda: True, lambda: "x" * rng.randrange(5), lambda: bytes(rng.randrange(5))]
    if depth < 3:
        choices += [lambda: [_junk(rng, depth + 1) for _ in range(rng.randrange(5))],
                    lambda: {_junk(rng, 3): _junk(rng, depth + 1) for _ in range(rng.randrange(4))}]
    return rng.choice(choices)()


def _fuzz_message(rng, sid) -> list[bytes]:
    kind = rng.randrange(8)
    rid = rng.randrange(2**31)
    if kind == 0:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))]
    if kind == 1:
        return [msgpack.packb(_junk(rng), use_bin_type=True)]
    if kind == 2:   # a real op with fields of the wrong shapes
        fields = {k: _junk(rng) for k in rng.sample(["reads", "sid", "sl", "acks", "results"], 3)}
        return [wire.request(rng.choice(["produce", "fetch", "offsets", "stats", "replicate"]), rid, fields),
                *[bytes(rng.randrange(100)) for _ in range(rng.randrange(3))]]
    if kind in (3, 4):
        frames = [_damaged(rng, sid) for _ in range(rng.randrange(1, 4))]
        return [wire.request("produce", rid, {"acks": rng.choice([True, False])}), *frames]
    if kind == 5:
        read = [rng.choice([sid, 999, -1, "s"]), rng.choice([0, 1, 7, 2**40]),
                rng.choice([{"low": 0, "offsets": {}}, {"low": rng.randrange(10), "offsets": {0: 2**64 - 1}},
                            {"offsets": {"a": 1}}, [], None, {"low": -5}]),
                rng.choice([0, 1, 2**63, -1, 1.5])]
        return [wire.request("fetch", rid, {"reads": rng.choice([[read], [read] * 3, read, "r"])})]
    if kind == 6:
        return [wire.request("offsets", rid, {"sid": _junk(rng), "sl": _junk(rng)})]
    # a valid chunk for a stream that does not exist, or a streamlet out of range
    c = chunk.encode(5, 0, rng.choice([sid + 1000, sid]), rng.choice([5, 2**31]), [b"z"])
    return [wire.request("produce", rid, {}), c]


def test_fuzzed_broker_keeps_serving_exact_data(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    with cluster.admin() as admin:
        stream = admin.create_stream("fuzz", streamlets=2, replication=1, segment_size_bytes=64 * 1024,
                                     group_segments=2)
    sid = stream["id"]
    address = cluster.brokers[0].address
    writer = Writer(address, sid, producer_id=1)
    writer.write(0, 10)

    rng = random.Random(20240601)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    sent = 0
    replies: list[dict] = []
    try:
        for i in range(3000):
            sock.send_multipart(_fuzz_message(rng, sid))
            sent += 1
            while sock.poll(0):
                replies.append(wire.unpack_header(sock.recv_multipart()[0]))
        sock.send_multipart([wire.request("produce", 1, {}), *[b"x"] * (wire.MAX_FRAMES + 1)])
        sent += 1
        deadline = time.monotonic() + WAIT_S
        while len(replies) < sent and time.monotonic() < deadline:
            if sock.poll(200):
                replies.append(wire.unpack_header(sock.recv_multipart()[0]))
    finally:
        sock.close()
    assert len(replies) == sent, "every message with a header frame gets exactly one reply"
    internal = [r for r in replies if r.get("code") == "internal"]
    assert not internal, f"unexpected exceptions in the broker: {internal[:3]}"
    assert cluster.brokers[0].running

    writer.write(0, 10)
    writer.write(1, 5)
    chunks = read_all(address, sid, 0, max_bytes=2000)
    assert [(c.header.producer_id, c.header.sequence) for c in chunks] == [(1, s) for s in range(20)]
    assert all(c.values() == [b"value"] * 20 for c in chunks)
    assert [(c.header.group, c.header.segment, c.header.base_offset, c.header.number)
            for c in chunks] == [tuple(res) for sl, _, res in writer.acked if sl == 0]
    assert len(read_all(address, sid, 1)) == 5
    stats = broker_stats(address)
    assert stats["chunks_appended"] == 25
    assert stats["refused_corrupt_chunk"] > 100
    with rpc.Connection(address, timeout_s=5) as conn:
        groups = conn.call("offsets", {"sid": sid, "sl": 0})[0]["groups"]
        assert sum(g[3] for g in groups) == 20 * 20
        with pytest.raises(KeraError) as exc:
            conn.call("offsets", {"sid": sid + 1000, "sl": 0})
        assert exc.value.code == "unknown_stream"
    writer.close()


def test_replicated_produce_survives_a_backup_kill_and_restores_its_replicas(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=2, heartbeat_interval_ms=50, log_level="WARNING",
                            extra_broker_args=["--virtual-segment-bytes", str(64 * 1024)])
    with cluster.admin() as admin:
        stream = admin.create_stream("rep", streamlets=2, replication=2, active_groups=2)
    sid = stream["id"]
    address = cluster.brokers[0].address
    writer = Writer(address, sid, producer_id=3)
    big = (b"v" * 200,) * 50          # ~10 KiB chunks
    writer.write(0, 30, big)
    writer.write(1, 30, big)
    stats = broker_stats(address)
    assert stats["durable_lag_bytes"] == 0 and stats["replication_writes"] > 0
    assert stats["virtual_segments"] > 2

    cluster.kill_backup(0)             # SIGKILL: its in-memory replicas are gone
    writer.write(0, 30, big)           # stalls for at most the replication timeout, then goes on
    writer.write(1, 30, big)

    for sl in (0, 1):
        chunks = read_all(address, sid, sl)
        assert [(c.header.producer_id, c.header.sequence) for c in chunks] == [(3, s) for s in range(60)]
    appended = broker_stats(address)["bytes_appended"]
    survivor = cluster.backups[1].address
    broker_id = 0

    def survivor_holds_everything():
        header, _ = rpc.call(survivor, "list_replicas", {"broker_id": broker_id}, timeout_s=5)
        return sum(r["length"] for r in header["replicas"]) == appended

    # Every virtual segment (the finished ones the dead backup held too) is now on the survivor.
    wait_for(survivor_holds_everything, "the surviving backup to hold every chunk")
    stats = broker_stats(address)
    assert stats.get("replicas_lost", 0) + stats.get("replica_failures", 0) > 0
    writer.close()
