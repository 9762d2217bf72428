"""Replication through shared virtual logs, end to end: a real coordinator, broker and backups
(subprocesses) and a client speaking the wire protocol.

What is proven here (issue 3):
- R=3: every acknowledged chunk is in the memory of both backups (byte for byte the chunk the
  broker serves) and, once the flusher ran, in their replica files byte for byte; with
  durability "disk" it is on disk already when the acknowledgement arrives;
- a consumer never receives a chunk before it is durable (a stopped backup holds it back);
- 128 one-streamlet streams: V=1 consolidates many chunks into each replication write, while
  one virtual log per sub-partition (V=128) approaches one write per chunk (broker counters);
- the coordinator knows which backups hold which virtual segment, across its own restart.
"""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path

import pytest

from kera import Consumer

from kera.codec import chunk

from kera.net import rpc
from kera.backup import meta as meta_codec
from kera.coordinator import store as coordinator_store

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = [pytest.mark.timeout(180), pytest.mark.security_modes]

WAIT_S = 30.0
BROKER_ID = 0   # LocalCluster: broker i registers as broker id i


# ---------------------------------------------------------------------------- helpers

def wait_for(cond, what: str, timeout_s: float = WAIT_S, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def stats_of(address: str) -> dict:
    return rpc.call(address, "stats", timeout_s=5)[0]["stats"]


class Writer:
    """An idempotent producer over the wire: requests of chunks (any streams), a window of them in
    flight, retriable refusals retried with the same sequence. `acked` maps (sid, sl, seq) to
    the time its acknowledgement arrived."""

    def __init__(self, address: str, producer_id: int, timeout_s: float = 20.0):
        self.conn = rpc.Connection(address, timeout_s=timeout_s)
        self.pid = producer_id
        self.seq: collections.Counter = collections.Counter()
        self.acked: dict[tuple[int, int, int], float] = {}
        self.retries = 0

    def chunk(self, sid: int, sl: int = 0, values=(b"v" * 100,) * 40) -> bytes:
        seq = self.seq[(sid, sl)]
        self.seq[(sid, sl)] += 1
        return chunk.encode(self.pid, seq, sid, sl, list(values))

    def send_all(self, requests: list[list[bytes]], window: int = 4, budget_s: float = 60.0):
        todo = collections.deque(requests)
        in_flight: dict[int, list[bytes]] = {}
        deadline = time.monotonic() + budget_s
        while todo or in_flight:
            assert time.monotonic() < deadline, "produce requests never completed"
            while todo and len(in_flight) < window:
                frames = todo.popleft()
                in_flight[self.conn.send("produce", {}, frames)] = frames
            header, _ = self.conn.recv()
            frames = in_flight.pop(header["id"])
            if not header["ok"]:
                assert header["retriable"], header
                self._retry(todo, frames)
                continue
            again = []
            for c, res in zip(frames, header["results"], strict=True):
                if isinstance(res[0], str):
                    assert res[2], res   # only retriable refusals (replication_failed, gap)
                    again.append(c)
                else:
                    h = chunk.read_header(c)
                    self.acked[(h.stream_id, h.streamlet, h.sequence)] = time.monotonic()
            if again:
                self._retry(todo, again)

    def _retry(self, todo, frames) -> None:
        self.retries += 1
        todo.appendleft(frames)
        time.sleep(0.05)

    def close(self) -> None:
        self.conn.close()


def broker_chunks(address: str, sid: int, sl: int = 0) -> list[bytes]:
    """Every durable chunk of a streamlet as the broker serves it to consumers (stamped)."""
    low, offsets, out = 0, {}, []
    with rpc.Connection(address, timeout_s=10) as conn:
        for _ in range(100_000):
            header, frames = conn.call("fetch", {"reads": [[sid, sl, {"low": low, "offsets": offsets},
                                                            1 << 20]]})
            err, _, groups = header["results"][0]
            assert err is None, err
            for view in (v for f in frames for v in chunk.frame_chunks(f)):
                c = chunk.Chunk(view)
                offsets[c.header.group] = c.header.base_offset + len(c)
                out.append(bytes(view))
            described = {g[0]: g for g in groups}
            while low in described and described[low][4] and offsets.get(low, 0) == described[low][3]:
                offsets.pop(low, None)
                low += 1
            if not frames:
                return out
    raise AssertionError("reading never ended")


def identity(c: bytes) -> tuple[int, int, int, int]:
    h = chunk.read_header(c)
    return h.producer_id, h.stream_id, h.streamlet, h.sequence


def replica_list(address: str) -> list[dict]:
    return rpc.call(address, "list_replicas", {"broker_id": BROKER_ID}, timeout_s=5)[0]["replicas"]


def replica_chunks(address: str, vlog: int, vseg: int) -> list[bytes]:
    """The chunks of one replica, read back through `read_replica` (memory, else disk)."""
    out, offset = [], 0
    with rpc.Connection(address, timeout_s=10) as conn:
        while True:
            header, frames = conn.call("read_replica", {"broker_id": BROKER_ID, "vlog": vlog,
                                                        "vseg": vseg, "offset": offset,
                                                        "max_bytes": 1 << 20})
            for f in frames:
                data = f.bytes
                at = 0
                while at < len(data):      # a frame may hold several whole chunks
                    size = chunk.chunk_size(data, at)
                    chunk.verify(data[at:at + size])
                    out.append(data[at:at + size])
                    at += size
            if header["end"] == header["length"]:
                return out
            assert frames and header["end"] > offset
            offset = header["end"]


def backup_dir(cluster, i: int) -> Path:
    return cluster.data_dir / f"backup-{i}" / str(BROKER_ID)


def seg_file(cluster, i: int, vlog: int, vseg: int, suffix: str = "seg") -> Path:
    return backup_dir(cluster, i) / f"{vlog:04d}-{vseg:012d}.{suffix}"


def flushed(address: str) -> bool:
    s = stats_of(address)
    return s["unflushed_bytes"] == 0 and s["flush_jobs_out"] == 0


def create(cluster, name: str, **kw) -> int:
    with cluster.admin() as admin:
        return admin.create_stream(name, **kw)["id"]


# ---------------------------------------------------------------------------- R=3 copies

# (records of 100 bytes per chunk, requests): ~4 KiB chunks, and ~64 KiB ones: above the
# zero-copy threshold, below the bound under which senders pack runs into shared frames
# (kera.codec.frame_pack). Under 8 MiB in all, so no virtual segment closes.
CHUNK_SHAPES = [(40, 40), (640, 10)]


@pytest.mark.parametrize("records,request_count", CHUNK_SHAPES, ids=["4KiB", "64KiB"])
def test_r3_acked_chunks_are_in_both_backups_memory_then_on_their_disks(fresh_cluster, records,
                                                                        request_count):
    cluster = fresh_cluster(brokers=1, backups=2, log_level="WARNING")
    broker = cluster.brokers[0].address
    sids = [create(cluster, f"r3-{i}", replication=3, streamlets=2) for i in range(3)]
    writer = Writer(broker, producer_id=11)
    # Each request carries one chunk per streamlet of every stream: 6 chunks.
    requests = [[writer.chunk(sid, sl, (b"v" * 100,) * records) for sid in sids for sl in (0, 1)]
                for _ in range(request_count)]
    writer.send_all(requests)
    total = 6 * request_count
    assert len(writer.acked) == total
    served = {identity(c): c for sid in sids for sl in (0, 1) for c in broker_chunks(broker, sid, sl)}
    assert set(served) == {(11, *k) for k in writer.acked}

    # Right after the acks: both backups hold every acknowledged chunk in memory. The virtual
    # segment (8 MiB) is still open, so its replica keeps every byte in memory.
    in_memory = []
    for b in cluster.backups:
        reps = replica_list(b.address)
        assert reps and all(r["in_memory"] and r["memory_from"] == 0 and not r["closed"] for r in reps)
        content = {(r["vlog"], r["vseg"]): replica_chunks(b.address, r["vlog"], r["vseg"]) for r in reps}
        assert sum(map(len, content.values())) == total
        chunks = {identity(c): c for cs in content.values() for c in cs}
        assert chunks == served, "a backup's copy differs from the broker's"
        # A replica is its virtual log in append order: per streamlet, sequences ascend.
        for cs in content.values():
            for key in {identity(c)[1:3] for c in cs}:
                seqs = [identity(c)[3] for c in cs if identity(c)[1:3] == key]
                assert seqs == sorted(seqs)
        in_memory.append(content)
    assert in_memory[0] == in_memory[1], "the two backups hold different replicas"

    # After the flusher ran: the same bytes in the replica files, and `ls` order is log order.
    for i, b in enumerate(cluster.backups):
        wait_for(lambda: flushed(b.address), f"backup {i} to flush")
        names = sorted(p.name for p in backup_dir(cluster, i).iterdir())
        assert names == sorted(n for (vlog, vseg) in in_memory[i]
                               for n in (seg_file(cluster, i, vlog, vseg).name,
                                         seg_file(cluster, i, vlog, vseg, "meta").name))
        for (vlog, vseg), cs in in_memory[i].items():
            data = b"".join(cs)
            assert seg_file(cluster, i, vlog, vseg).read_bytes() == data
            meta = meta_codec.decode_file(seg_file(cluster, i, vlog, vseg, "meta").read_bytes())
            assert (meta.broker_id, meta.vlog, meta.vseg, meta.length) == (BROKER_ID, vlog, vseg, len(data))
    writer.close()


def test_disk_durability_acks_only_what_is_fsynced(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=2, log_level="WARNING")
    broker = cluster.brokers[0].address
    sid = create(cluster, "disk", replication=3, durability="disk")
    writer = Writer(broker, producer_id=12)
    for _ in range(5):
        writer.send_all([[writer.chunk(sid)] for _ in range(8)])
        # Nothing is in flight once every request is answered: every acknowledged byte is in
        # the replica files already (no waiting for a flusher here).
        for i, b in enumerate(cluster.backups):
            reps = replica_list(b.address)
            assert reps and all(r["disk_length"] == r["length"] for r in reps), reps
            on_disk = [c for r in reps for c in _split(seg_file(cluster, i, r["vlog"], r["vseg"])
                                                       .read_bytes()[:r["disk_length"]])]
            assert {identity(c)[3] for c in on_disk} == {k[2] for k in writer.acked}
    assert set(map(identity, broker_chunks(broker, sid))) == {(12, *k) for k in writer.acked}
    writer.close()


def _split(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        size = chunk.chunk_size(data, at)
        chunk.verify(data[at:at + size])
        out.append(data[at:at + size])
        at += size
    return out


# ---------------------------------------------------------------------------- visibility

def test_a_consumer_never_receives_a_chunk_before_it_is_durable(fresh_cluster):
    # Heartbeats every 50 ms: the stopped backup is declared dead (after 1 s) while stopped, so
    # its return (the only backup that can take the third copy) is exercised too.
    cluster = fresh_cluster(brokers=1, backups=2, log_level="WARNING", heartbeat_interval_ms=50)
    broker = cluster.brokers[0].address
    sid = create(cluster, "vis", replication=3)
    writer = Writer(broker, producer_id=13)
    writer.send_all([[writer.chunk(sid)] for _ in range(5)])
    consumer = Consumer(cluster.bootstrap, "vis", start="earliest")
    stopped = cluster.backups[1]
    conn = rpc.Connection(broker, timeout_s=20)
    try:
        assert _records(consumer, 5 * 40, "the durable chunks") == 5 * 40

        appended = stats_of(broker)["bytes_appended"]
        stopped.signal(signal.SIGSTOP)      # it stops answering: nothing more can be durable
        held_back = [writer.chunk(sid) for _ in range(5)]
        pending = {conn.send("produce", {}, [c]): c for c in held_back}
        wait_for(lambda: stats_of(broker)["chunks_appended"] == 10, "the broker to append")
        # The live backup acknowledged them: the chunks exist on the broker and one backup...
        wait_for(lambda: sum(r["length"] for r in replica_list(cluster.backups[0].address))
                 == stats_of(broker)["bytes_appended"], "the live backup to hold the new chunks")
        assert stats_of(broker)["bytes_appended"] > appended
        # ... yet they are not durable: no producer acknowledgement, no consumer sees them.
        failed = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert consumer.poll_batch(timeout_s=0.1) == []
            with rpc.Connection(broker, timeout_s=5) as probe:
                groups = probe.call("offsets", {"sid": sid, "sl": 0})[0]["groups"]
            assert sum(g[3] for g in groups) == 5 * 40, "the durable head moved without both backups"
            while conn.sock.poll(0):
                # Only a (retriable) failure may come back now: after the broker's produce
                # timeout, were this machine slow enough to reach it.
                header, _ = conn.recv()
                assert not header["ok"] and header["code"] == "replication_failed", header
                failed.append(pending.pop(header["id"]))
    finally:
        stopped.signal(signal.SIGCONT)
    try:
        # Acknowledged once the backup answers again. A request answered replication_failed is
        # retried with the same chunk: a duplicate, acknowledged once the original is durable.
        while pending:
            header, _ = conn.recv()
            c = pending.pop(header["id"])
            if header["ok"]:
                assert not isinstance(header["results"][0][0], str), header
            else:
                assert header["code"] == "replication_failed", header
                failed.append(c)
        writer.send_all([[c] for c in failed])
        assert _records(consumer, 5 * 40, "the chunks made durable") == 5 * 40
        assert stats_of(broker)["chunks_appended"] == 10, "a retried chunk was stored twice"
    finally:
        conn.close()
        consumer.close()
    writer.close()


def _records(consumer, expected: int, what: str) -> int:
    got = 0
    deadline = time.monotonic() + WAIT_S
    while got < expected:
        assert time.monotonic() < deadline, f"{what}: only {got} of {expected} records"
        got += sum(len(b) for b in consumer.poll_batch(timeout_s=0.2))
    assert got == expected
    return got


# ---------------------------------------------------------------------------- consolidation

STREAMS = 128


def _consolidation_run(fresh_cluster, virtual_logs: int) -> dict:
    cluster = fresh_cluster(brokers=1, backups=1, virtual_logs=virtual_logs, log_level="WARNING")
    broker = cluster.brokers[0].address
    with cluster.admin(timeout_s=60) as admin:
        names = [f"c{i}" for i in range(STREAMS)]
        for name in names:   # all created first: the broker picks them up together
            admin.create_stream(name, replication=2, wait_ready=False)
        sids = [admin.wait_ready(name)["id"] for name in names]
    writer = Writer(broker, producer_id=14)
    values = (b"x" * 100,) * 8       # ~1 KiB chunks: the count matters here, not the bytes
    # One chunk per stream per request, like a producer feeding 128 streams; two requests in
    # flight, so at most two chunks of one group can wait for one write.
    writer.send_all([[writer.chunk(sid, 0, values) for sid in sids] for _ in range(20)], window=2)
    assert len(writer.acked) == 20 * STREAMS
    s = stats_of(broker)
    assert s["chunks_appended"] == 20 * STREAMS and s["durable_lag_bytes"] == 0
    writer.close()
    return s


def test_one_virtual_log_consolidates_replication_writes(fresh_cluster):
    shared = _consolidation_run(fresh_cluster, virtual_logs=1)
    own = _consolidation_run(fresh_cluster, virtual_logs=STREAMS)
    ratio_shared = shared["replication_writes"] / shared["chunks_appended"]
    ratio_own = own["replication_writes"] / own["chunks_appended"]
    print(f"\nreplication writes per chunk appended: V=1 {ratio_shared:.3f} "
          f"({shared['chunks_per_replication_write']:.1f} chunks/write), V={STREAMS} "
          f"{ratio_own:.3f} ({own['chunks_per_replication_write']:.2f} chunks/write)")
    assert shared["virtual_logs"] == 1 and own["virtual_logs"] == STREAMS
    # V=1: every request's 128 chunks travel together (and more pile up while one is in flight).
    assert ratio_shared <= 0.05 and shared["chunks_per_replication_write"] >= 20
    # One log per sub-partition: a write carries at most the two chunks of its group that can
    # wait, so at least one write per two chunks, and typically close to one per chunk.
    assert ratio_own >= 0.5 and own["chunks_per_replication_write"] <= 2
    # Every chunk was sent to the backup exactly once in both layouts.
    # Every chunk was sent to the backup once in both layouts (more only if a write had to be
    # retried, which a very slow machine may cause).
    for s in (shared, own):
        if not s.get("replica_failures") and not s.get("replication_throttled"):
            assert s["replication_chunks"] == s["chunks_appended"]
            assert s["replication_bytes"] == s["bytes_appended"]


# ---------------------------------------------------------------------------- coordinator map

def test_the_coordinator_knows_which_backups_hold_each_virtual_segment(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=3, virtual_logs=2, log_level="WARNING",
                            extra_broker_args=["--virtual-segment-bytes", str(64 * 1024)])
    broker = cluster.brokers[0].address
    sids = [create(cluster, f"m{i}", replication=3, streamlets=2) for i in range(2)]
    writer = Writer(broker, producer_id=15)
    writer.send_all([[writer.chunk(sid, sl) for sid in sids for sl in (0, 1)] for _ in range(30)])

    def held() -> dict:
        out: dict = {}
        for b, d in enumerate(cluster.backups):
            for r in replica_list(d.address):
                out.setdefault((r["vlog"], r["vseg"]), []).append(b)
        return {k: sorted(v) for k, v in out.items()}

    def reported() -> dict:
        with cluster.admin() as admin:
            return {(vlog, vseg): sorted(backups)
                    for _, vlog, vseg, backups in admin.replicas(broker_id=BROKER_ID)}

    truth = held()
    assert len(truth) > 4 and all(len(v) == 2 for v in truth.values())
    # Replicas are closed when the broker closes their virtual segment: all but each log's newest.
    newest = {vlog: max(vseg for v, vseg in truth if v == vlog) for vlog, _ in truth}
    for d in cluster.backups:
        for r in replica_list(d.address):
            assert r["closed"] == (r["vseg"] != newest[r["vlog"]]), r
    assert {k[0] for k in truth} == {0, 1}, "both virtual logs in use"
    wait_for(lambda: reported() == truth, "the coordinator's map to match the backups")
    # Spread: every backup holds some virtual segments, none holds them all.
    counts = collections.Counter(b for v in truth.values() for b in v)
    assert len(counts) == 3 and max(counts.values()) < len(truth)
    with cluster.admin() as admin:
        by_backup = admin.replicas(backup_id=2)
    assert [(e[1], e[2]) for e in by_backup] == sorted(k for k, v in truth.items() if 2 in v)

    # Persisted with the metadata (a change is on disk before the heartbeat is answered), and
    # known again after a restart.
    state = coordinator_store.load(cluster.data_dir / "coordinator")   # snapshot + change log
    assert {(vlog, vseg): sorted(b) for vlog, vseg, b in state["replicas"][str(BROKER_ID)]} == truth
    cluster.kill_coordinator()
    cluster.restart_coordinator()
    wait_for(lambda: reported() == truth, "the restarted coordinator to know the replicas")
    writer.close()
