"""Producer and Consumer against a real local cluster (coordinator, brokers, a backup).

Values carry their own identity — (producer index, sequence number) in their first 12 bytes —
so a reader can check exact content, no loss, no duplicate and per-producer order.
"""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest

from kera import Consumer, Producer
from kera.codec import chunk as chunkcodec
from kera.errors import ClientClosed, RecordTooLarge, Timeout, UnknownStream
from kera.codec.position import Position

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = pytest.mark.security_modes

VALUE_BYTES = 100
ID = struct.Struct("<IQ")  # producer index, sequence number


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=1, log_level="WARNING")


_names = iter(range(10**6))


def new_stream(cluster, **kw):
    name = f"pc-{next(_names)}"
    kw.setdefault("streamlets", 4)
    with cluster.admin() as admin:
        admin.create_stream(name, **kw)
    return name


def values_for(producer: int, start: int, n: int) -> np.ndarray:
    """n fixed-size values (2-D uint8) numbered start.. for `producer`."""
    out = np.zeros((n, VALUE_BYTES), dtype=np.uint8)
    ids = np.zeros(n, dtype=[("p", "<u4"), ("s", "<u8")])
    ids["p"] = producer
    ids["s"] = np.arange(start, start + n)
    out[:, :12] = ids.view(np.uint8).reshape(n, 12)
    out[:, 12:] = (np.arange(start, start + n) % 251).astype(np.uint8)[:, None]
    return out


def value(producer: int, seq: int) -> bytes:
    return values_for(producer, seq, 1)[0].tobytes()


def drain(consumer: Consumer, expected: int, timeout_s: float = 60.0) -> list:
    """poll_batch until `expected` records arrived (or fail after timeout_s)."""
    batches, got = [], 0
    deadline = time.monotonic() + timeout_s
    while got < expected:
        assert time.monotonic() < deadline, f"only {got} of {expected} records within {timeout_s} s"
        for b in consumer.poll_batch(timeout_s=0.5):
            batches.append(b)
            got += len(b)
    assert got == expected
    return batches


def identities(batches) -> np.ndarray:
    """Structured array (p, s, streamlet, group, offset) of every record read, in read order;
    checks each value's filler bytes too."""
    parts = []
    for b in batches:
        n = len(b)
        off = b.value_offsets.astype(np.int64)
        assert (np.diff(off) == VALUE_BYTES).all()
        grid = np.frombuffer(b.values_blob, dtype=np.uint8, count=n * VALUE_BYTES).reshape(n, VALUE_BYTES)
        ids = grid[:, :12].copy().view([("p", "<u4"), ("s", "<u8")]).reshape(n)
        assert (grid[:, 12:] == (ids["s"] % 251).astype(np.uint8)[:, None]).all(), "value bytes differ"
        rec = np.zeros(n, dtype=[("p", "<u4"), ("s", "<u8"), ("sl", "<u4"), ("g", "<u4"), ("off", "<u8")])
        rec["p"], rec["s"] = ids["p"], ids["s"]
        rec["sl"], rec["g"], rec["off"] = b.streamlet, b.group, b.offsets
        parts.append(rec)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=[("p", "<u4"), ("s", "<u8")])


def check_exactly_once_in_order(recs: np.ndarray, sent: dict[int, int]) -> None:
    """Every (producer, seq) in range(sent[producer]) read exactly once, and each producer's
    records in one streamlet read in the order they were sent."""
    for p, n in sent.items():
        mine = recs[recs["p"] == p]
        seqs = np.sort(mine["s"])
        assert len(seqs) == n and (seqs == np.arange(n)).all(), f"producer {p}: loss or duplicate"
        for sl in np.unique(mine["sl"]):
            in_sl = mine[mine["sl"] == sl]["s"]
            assert (np.diff(in_sl.astype(np.int64)) > 0).all(), f"producer {p} out of order in streamlet {sl}"
    assert len(recs) == sum(sent.values())


# --------------------------------------------------------------------------- round trips

def test_million_records_round_trip_four_streamlets_two_groups(cluster):
    # Small groups so that groups close and consumers move their cursors past them.
    stream = new_stream(cluster, streamlets=4, active_groups=2, segment_size_bytes=256 * 1024,
                        group_segments=2)
    total, keyed, single = 1_000_000, 100_000, 50_000
    # Producer ids 0 and 1: slots 0 and 1 of the two active groups.
    with Producer(cluster.bootstrap, producer_id=0) as p0, Producer(cluster.bootstrap, producer_id=1) as p1:
        n0 = total - keyed - single
        for a in range(0, n0, 100_000):
            p0.send_batch(stream, values_for(0, a, min(100_000, n0 - a)))
        keys = [b"key-%d" % (i % 1000) for i in range(keyed)]
        p1.send_batch(stream, values_for(1, 0, keyed), keys=keys)
        for i in range(keyed, keyed + single):
            p1.send(stream, value(1, i), key=b"key-%d" % (i % 1000))
        p0.flush()
        p1.flush()
        assert p0.stats["acked"] == n0 and p1.stats["acked"] == keyed + single
        assert p0.stats["records_failed"] == 0 == p1.stats["records_failed"]
    with Consumer(cluster.bootstrap, stream) as c:
        batches = drain(c, total)
        assert c.poll_batch(timeout_s=0.2) == []  # nothing more
        positions = c.positions()
    recs = identities(batches)
    check_exactly_once_in_order(recs, {0: n0, 1: keyed + single})
    # Offsets inside each group are dense from 0 and read in order; both slots were used.
    groups = set()
    for sl in range(4):
        for g in np.unique(recs[recs["sl"] == sl]["g"]):
            offs = recs[(recs["sl"] == sl) & (recs["g"] == g)]["off"]
            assert (offs == np.arange(len(offs))).all()
            groups.add((sl, int(g)))
    assert len(groups) > 8, "small groups: several per streamlet"
    # Keyed records: one key, one streamlet.
    mine = recs[recs["p"] == 1]
    key_of = (mine["s"] % 1000)
    for k in (0, 1, 999):
        assert len(np.unique(mine[key_of == k]["sl"])) == 1
    assert {p.streamlet for p in positions} == {0, 1, 2, 3}


def test_record_api_and_numpy_arrow_values(cluster):
    pa = pytest.importorskip("pyarrow")
    stream = new_stream(cluster, streamlets=1)
    with Producer(cluster.bootstrap) as p:
        p.send(stream, b"one", key=b"k", timestamp=123)
        p.send_batch(stream, np.array([b"two", b"three"], dtype="S5"), timestamps=[5, 6])
        p.send_batch(stream, pa.array([b"four", b""], pa.binary()), keys=[None, b"k2"])
        p.send(stream, bytearray(b"six"))
        p.flush()
    with Consumer(cluster.bootstrap, stream) as c:
        got = [c.poll(10) for _ in range(6)]
        assert c.poll(0.1) is None
    assert [(r.key, r.value) for r in got] == [(b"k", b"one"), (None, b"two"), (None, b"three"),
                                               (None, b"four"), (b"k2", b""), (None, b"six")]
    assert [r.timestamp for r in got[:3]] == [123, 5, 6]
    assert [r.offset for r in got] == list(range(6))
    assert all(r.stream == stream and r.streamlet == 0 and r.group == 0 for r in got)
    with Consumer(cluster.bootstrap, stream) as c:
        table = pa.Table.from_batches([b.to_arrow() for b in drain(c, 6)])
        assert table.column("value").to_pylist() == [b"one", b"two", b"three", b"four", b"", b"six"]
        assert table.column("key").to_pylist() == [b"k", None, None, None, b"k2", None]
        assert table.column("timestamp").to_pylist()[:3] == [123, 5, 6]


def test_millisecond_timestamps_are_taken_as_such_and_never_stored_as_1970(cluster):
    import time as _time

    from kera.errors import BadRequest
    stream = new_stream(cluster, streamlets=1)
    now_ms = int(_time.time() * 1000)
    with Producer(cluster.bootstrap) as p:
        with pytest.raises(BadRequest, match="looks like milliseconds"):
            p.send(stream, b"x", timestamp=now_ms)
        with pytest.raises(BadRequest, match="looks like milliseconds"):
            p.send_batch(stream, [b"y", b"z"], timestamps=[now_ms, now_ms + 1])
        p.send(stream, b"a", timestamp_ms=now_ms)
        p.send_batch(stream, [b"b", b"c"], timestamps_ms=[now_ms + 1, now_ms + 2])
        p.flush()
    with Consumer(cluster.bootstrap, stream) as c:
        got = [c.poll(10) for _ in range(3)]
        assert c.poll(0.1) is None
    assert [(r.value, r.timestamp_ms) for r in got] == [(b"a", now_ms), (b"b", now_ms + 1),
                                                        (b"c", now_ms + 2)]

def test_several_producers_and_consumers_at_once(cluster):
    stream = new_stream(cluster, streamlets=4, active_groups=2, replication=2)
    per_producer, producers = 60_000, 3
    total = per_producer * producers
    errors: list = []
    results: dict = {0: [], 1: []}
    read = [0]
    lock = threading.Lock()

    def produce(i):
        try:
            with Producer(cluster.bootstrap, producer_id=100 + i, linger_ms=2) as p:
                for a in range(0, per_producer, 3000):
                    if i == 2:  # one producer record by record, keyed
                        for s in range(a, a + 3000):
                            p.send(stream, value(i, s), key=b"%d" % (s % 17))
                    else:
                        p.send_batch(stream, values_for(i, a, 3000))
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def consume(member):
        # Two consumers split the stream (streamlets of parity `member`) while producers run.
        try:
            with Consumer(cluster.bootstrap, stream, member=member, members=2) as c:
                deadline = time.monotonic() + 120
                while read[0] < total and time.monotonic() < deadline:
                    batches = c.poll_batch(timeout_s=0.2)
                    with lock:
                        results[member] += batches
                        read[0] += sum(len(b) for b in batches)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(m,)) for m in (0, 1)]
    threads += [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for member in (0, 1):
        assert set(identities(results[member])["sl"] % 2) == {member}
    recs = np.concatenate([identities(results[0]), identities(results[1])])
    check_exactly_once_in_order(recs, {i: per_producer for i in range(producers)})


def test_concurrent_produce_and_consume_sees_everything_in_order(cluster):
    stream = new_stream(cluster, streamlets=2)
    n = 200_000
    with Consumer(cluster.bootstrap, stream, start="latest", cache_chunks_max=8) as c:
        def produce():
            with Producer(cluster.bootstrap, producer_id=7) as p:
                for a in range(0, n, 5000):
                    p.send_batch(stream, values_for(0, a, 5000))
                    time.sleep(0.001)
        t = threading.Thread(target=produce)
        t.start()
        batches = drain(c, n)
        t.join(60)
    check_exactly_once_in_order(identities(batches), {0: n})


# --------------------------------------------------------------------------- positions

def test_resume_from_saved_positions_no_gap_no_duplicate(cluster):
    stream = new_stream(cluster, streamlets=3, active_groups=2, segment_size_bytes=64 * 1024,
                        group_segments=1)
    n = 30_000
    with Producer(cluster.bootstrap, producer_id=4) as p:
        p.send_batch(stream, values_for(0, 0, n // 2))
        for i in range(n // 2, n):
            p.send(stream, value(0, i), key=b"%d" % (i % 11))
    seen = []
    start = "earliest"
    # Several sessions, each stopping part way through a chunk, resuming from positions().
    for session, take in enumerate([1, 777, 5000, 12345, 999]):
        with Consumer(cluster.bootstrap, stream, start=start) as c:
            for _ in range(take):
                r = c.poll(10)
                assert r is not None
                seen.append(ID.unpack_from(r.value)[1])
            start = c.positions()
            assert all(isinstance(pos, Position) for pos in start)
    with Consumer(cluster.bootstrap, stream, start=start) as c:
        rest = identities(drain(c, n - len(seen)))
        assert c.poll(0.3) is None
    all_seqs = np.sort(np.concatenate([np.array(seen, dtype=np.uint64), rest["s"]]))
    assert (all_seqs == np.arange(n)).all()


def test_positions_mid_batch_and_latest(cluster):
    stream = new_stream(cluster, streamlets=1)
    with Producer(cluster.bootstrap) as p:
        p.send_batch(stream, values_for(0, 0, 1000))
    with Consumer(cluster.bootstrap, stream, start="latest") as late:
        assert late.poll(0.2) is None
        with Producer(cluster.bootstrap) as p:
            p.send_batch(stream, values_for(0, 1000, 10))
        got = identities(drain(late, 10))
        assert got["s"].tolist() == list(range(1000, 1010))
    with Consumer(cluster.bootstrap, stream) as c:
        c.poll(5)
        c.poll(5)
        (b, *_) = c.poll_batch(timeout_s=5, max_chunks=1)
        assert b.offset == 2  # the rest of the chunk the record API was in
        pos = c.positions()
        assert [p[:4] for p in pos] == [Position(stream, 0, 0, b.next_offset)[:4]]
        assert pos[0].epoch is not None   # the history the position points into
    with Consumer(cluster.bootstrap, stream, start=pos) as c:
        assert c.poll(5).offset == b.next_offset


def test_streamlet_subset(cluster):
    stream = new_stream(cluster, streamlets=4)
    with Producer(cluster.bootstrap) as p:
        p.send_batch(stream, values_for(0, 0, 20_000))
    with Consumer(cluster.bootstrap, stream, streamlets=[1, 3]) as c:
        assert {pos.streamlet for pos in c.positions()} == {1, 3}
        t = time.monotonic()
        got = []
        while time.monotonic() - t < 1.0:
            got += c.poll_batch(timeout_s=0.2)
    assert got and {b.streamlet for b in got} == {1, 3}


# --------------------------------------------------------------------------- idempotence

def test_a_retried_chunk_is_stored_once(cluster):
    stream = new_stream(cluster, streamlets=2)
    with Producer(cluster.bootstrap) as p:
        info = p.stream_info(stream)
        first = chunkcodec.encode(555, 0, info.id, 1, [b"a", b"b"])
        second = chunkcodec.encode(555, 1, info.id, 1, [b"c"])
        p.send_chunk(stream, first)
        p.send_chunk(stream, first)  # a retry of the same chunk, same identity
        p.flush()
        p.send_chunk(stream, first)  # again, after it was acknowledged
        p.send_chunk(stream, second)
        p.flush()
        # A deterministic writer replaying the same batch: stored once.
        nxt = p.send_batch_as(stream, 0, [b"x", b"y"], producer_id=556, sequence_start=0)
        p.send_batch_as(stream, 0, [b"x", b"y"], producer_id=556, sequence_start=0)
        p.flush()
        assert nxt == 1
    with Consumer(cluster.bootstrap, stream) as c:
        got = []
        while (r := c.poll(1.0)) is not None:
            got.append((r.streamlet, r.value))
    assert sorted(got) == [(0, b"x"), (0, b"y"), (1, b"a"), (1, b"b"), (1, b"c")]


# --------------------------------------------------------------------------- errors

def test_unknown_stream_is_a_clear_error_within_the_timeout(cluster):
    t = time.monotonic()
    with Producer(cluster.bootstrap, request_timeout_s=5) as p:
        with pytest.raises(UnknownStream, match="no-such-stream"):
            p.send("no-such-stream", b"x")
        with pytest.raises(UnknownStream):
            p.send_batch("no-such-stream", [b"x"])
    with pytest.raises(UnknownStream, match="no-such-stream"):
        Consumer(cluster.bootstrap, "no-such-stream", request_timeout_s=5)
    assert time.monotonic() - t < 5


def test_deleted_stream_fails_producer_flush_and_consumer_poll(cluster):
    stream = new_stream(cluster, streamlets=2)
    with Producer(cluster.bootstrap) as p:
        p.send_batch(stream, [b"a"] * 10)
    c = Consumer(cluster.bootstrap, stream, request_timeout_s=5)
    try:
        assert len(drain(c, 10, timeout_s=10)) >= 1
        with cluster.admin() as admin:
            admin.delete_stream(stream)
        t = time.monotonic()
        with pytest.raises(UnknownStream):
            while time.monotonic() - t < 15:
                c.poll(0.5)
        assert time.monotonic() - t < 15
    finally:
        c.close()
    p = Producer(cluster.bootstrap, request_timeout_s=5)
    try:
        with pytest.raises(UnknownStream):
            p.send(stream, b"x")
    finally:
        p.close()


def wait_broker_forgets(info, timeout_s=10.0):
    """Until the brokers owning the stream have applied its deletion."""
    from kera.net import rpc
    deadline = time.monotonic() + timeout_s
    for sl in range(info.streamlets):
        while True:
            try:
                rpc.call(info.address_of(sl), "offsets", {"sid": info.id, "sl": sl}, timeout_s=2)
            except UnknownStream:
                break
            assert time.monotonic() < deadline, "broker still serves a deleted stream"
            time.sleep(0.02)


def test_flush_reports_records_that_could_not_be_stored(cluster):
    stream = new_stream(cluster, streamlets=2)
    p = Producer(cluster.bootstrap, linger_ms=60_000, request_timeout_s=5)
    try:
        for i in range(100):
            p.send(stream, b"v", key=b"%d" % i)  # held in open chunks (long linger)
        info = p.stream_info(stream)
        with cluster.admin() as admin:
            admin.delete_stream(stream)
        wait_broker_forgets(info)
        with pytest.raises(UnknownStream, match=f"100 records failed: stream '{stream}' streamlet"):
            p.flush(timeout=30)
        assert p.stats["records_failed"] == 100 and p.stats["acked"] == 0
        p.flush(timeout=5)  # reported once
    finally:
        p.close()


def test_record_too_large_and_closed_producer(cluster):
    stream = new_stream(cluster, streamlets=1)
    p = Producer(cluster.bootstrap, max_record_bytes=1000)
    with pytest.raises(RecordTooLarge):
        p.send(stream, b"x" * 1001)
    with pytest.raises(RecordTooLarge):
        p.send_batch(stream, [b"ok", b"x" * 1001])
    p.send(stream, b"y" * 1000)  # larger than nothing else: fits its own chunk
    p.close()
    with pytest.raises(ClientClosed):
        p.send(stream, b"z")
    with Consumer(cluster.bootstrap, stream) as c:
        assert c.poll(5).value == b"y" * 1000
        assert c.poll(0.2) is None


def test_full_buffer_blocks_then_times_out_when_the_broker_is_gone(fresh_cluster):
    cl = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    with cl.admin() as admin:
        admin.create_stream("s", streamlets=1)
    p = Producer(cl.bootstrap, buffer_bytes=64 * 1024, send_timeout_s=0.5, request_timeout_s=1,
                 retries_max=2)
    try:
        p.send("s", b"warm")
        p.flush(timeout=10)
        cl.kill_broker(0)
        t = time.monotonic()
        with pytest.raises(Timeout, match="buffer"):
            for _ in range(10_000):
                p.send("s", b"v" * 100)
        assert time.monotonic() - t < 5
        with pytest.raises((Timeout, Exception)):
            p.flush(timeout=30)
    finally:
        try:
            p.close(timeout=1)
        except Exception:  # noqa: BLE001 - the records could not be stored, as expected
            pass


def test_producer_carries_on_after_a_broker_restart(fresh_cluster):
    """An R=1 broker killed and restarted on its data dir keeps what it acknowledged (issue 10:
    written to its files before the ack); the producer reconnects and stores what it sends next."""
    cl = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    with cl.admin() as admin:
        admin.create_stream("s", streamlets=2)
    with Producer(cl.bootstrap, request_timeout_s=2, producer_id=9) as p:
        p.send_batch("s", values_for(0, 0, 1000))
        p.flush(timeout=10)
        cl.kill_broker(0)
        cl.restart_broker(0)
        p.send_batch("s", values_for(1, 0, 5000))
        p.flush(timeout=60)
        assert p.stats["records_failed"] == 0
    with Consumer(cl.bootstrap, "s") as c:
        recs = identities(drain(c, 6000, timeout_s=30))
        assert c.poll(0.3) is None
    check_exactly_once_in_order(recs, {0: 1000, 1: 5000})

