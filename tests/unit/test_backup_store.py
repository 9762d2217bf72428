"""The backup's sans-IO core (kera.backup.store), driven directly with a fake flusher."""

import pytest

from kera.codec import chunk
from kera.backup.store import DiskRead, ReplicaStore, StoreConfig
from kera.errors import BadRequest, CorruptChunk, NotReady, OffsetOutOfRange, StorageError, Throttled

KEY = (7, 0, 1)


def make_chunk(seq: int, n: int = 3, size: int = 10) -> bytes:
    return chunk.encode(1, seq, 5, 0, [bytes([seq % 256]) * size] * n)


def chunks(count: int, start: int = 0, **kw) -> list[bytes]:
    return [make_chunk(start + i, **kw) for i in range(count)]


def corrupt(buf: bytes, at: int) -> bytes:
    out = bytearray(buf)
    out[at] ^= 0x40
    return bytes(out)


class FakeFlusher:
    """Completes the store's flush jobs in memory: `disk` holds what a real flusher would write."""

    def __init__(self, store: ReplicaStore):
        self.store = store
        self.disk: dict = {}
        self.meta: dict = {}

    def run(self, now: float = 0.0, fail: Exception | None = None) -> list:
        replies = []
        for job in self.store.take_flush_jobs(now):
            if fail is None:
                data = self.disk.setdefault(job.key, bytearray())
                assert len(data) >= job.offset
                del data[job.offset:]
                for b in job.buffers:
                    data += b
                self.meta[job.key] = job.meta
            replies += self.store.flush_done(job, fail, now)
        return replies

    def drain(self, now: float = 0.0) -> list:
        replies = []
        while not self.store.idle():
            replies += self.run(now)
        return replies


def stored(store: ReplicaStore, key=KEY) -> bytes:
    replica = store.replicas[key]
    return b"".join(c.tobytes() for c in replica.chunks)


def write(store, frames, offset, key=KEY, durability="memory", close=False, token=None, now=0.0):
    return store.replicate(key, offset, frames, durability, close, token, now)


# --------------------------------------------------------------------------- appends

def test_ordered_appends_store_chunks_back_to_back():
    store = ReplicaStore()
    a, b, c = chunks(3)
    assert write(store, [a], 0) == len(a)
    assert write(store, [b, c], len(a)) == len(a + b + c)
    assert stored(store) == a + b + c
    stats = store.stats()
    assert stats["replicate_writes"] == 2 and stats["chunks_received"] == 3
    assert stats["bytes_received"] == len(a + b + c)
    assert stats["unflushed_bytes"] == len(a + b + c) == stats["memory_bytes"]


def test_frame_with_several_whole_chunks_is_split():
    store = ReplicaStore()
    a, b = chunks(2)
    assert write(store, [a + b], 0) == len(a + b)
    assert [x.tobytes() for x in store.read(KEY, len(a), 1)] == [b]
    assert len(store.replicas[KEY].chunks) == 2


def test_replicas_are_keyed_by_broker_vlog_vseg():
    store = ReplicaStore()
    a, b = chunks(2)
    write(store, [a], 0, key=(1, 0, 0))
    write(store, [b], 0, key=(1, 0, 1))
    write(store, [a], 0, key=(2, 0, 0))
    assert [r["vseg"] for r in store.list_replicas(1)] == [0, 1]
    assert [r["broker_id"] for r in store.list_replicas(2)] == [2]
    assert store.list_replicas(3) == []


# --------------------------------------------------------------------------- refusals

def test_offset_past_the_end_is_refused():
    store = ReplicaStore()
    a, b = chunks(2)
    write(store, [a], 0)
    with pytest.raises(BadRequest, match="offset mismatch"):
        write(store, [b], len(a) + 1)
    assert stored(store) == a


def test_unknown_replica_at_nonzero_offset_is_refused():
    store = ReplicaStore()
    with pytest.raises(BadRequest, match="unknown"):
        write(store, chunks(1), 100)
    assert not store.replicas


def test_different_bytes_at_a_stored_offset_are_refused():
    store = ReplicaStore()
    a, b = chunks(2)
    write(store, [a], 0)
    with pytest.raises(BadRequest, match="offset mismatch"):
        write(store, [b], 0)
    with pytest.raises(BadRequest, match="offset mismatch"):
        write(store, [], 0)  # an empty write must sit at the end
    assert stored(store) == a


def test_corrupt_chunk_refuses_the_whole_write_and_stores_nothing():
    store = ReplicaStore()
    first, second, third = chunks(3)
    write(store, [first], 0)
    for bad in (corrupt(third, 70), corrupt(third, 9), corrupt(third, 0)):
        with pytest.raises(CorruptChunk):
            write(store, [second, bad], len(first))
        assert stored(store) == first
        assert store.replicas[KEY].length == len(first)
    assert store.stats()["chunks_rejected"] == 6
    assert store.stats()["unflushed_bytes"] == len(first)
    # A fresh replica whose first write is corrupt is not created at all.
    with pytest.raises(CorruptChunk):
        write(store, [corrupt(second, 100)], 0, key=(9, 9, 9))
    assert (9, 9, 9) not in store.replicas


def test_truncated_or_padded_frames_are_refused():
    store = ReplicaStore()
    a, b = chunks(2)
    for frames in ([a[:-1]], [a[:40]], [a + b[:30]], [a + b"\x00"], [b""], [a, b[:-5]]):
        with pytest.raises(CorruptChunk):
            write(store, frames, 0)
    assert not store.replicas


def test_replica_size_is_bounded():
    a = make_chunk(0, n=10, size=100)
    store = ReplicaStore(StoreConfig(max_replica_bytes=2 * len(a)))
    write(store, [a, a], 0)
    with pytest.raises(BadRequest, match="more than"):
        write(store, [a], 2 * len(a))


def test_bad_durability_is_refused():
    with pytest.raises(BadRequest):
        write(ReplicaStore(), chunks(1), 0, durability="tape")


# --------------------------------------------------------------------------- retries

def test_retry_of_a_stored_write_is_acknowledged_once():
    store = ReplicaStore()
    a, b, c = chunks(3)
    write(store, [a], 0)
    write(store, [b, c], len(a))
    assert write(store, [b, c], len(a)) == len(a + b + c)
    assert write(store, [a], 0) == len(a)  # the reply names the end of the write
    assert stored(store) == a + b + c
    assert store.stats()["repeated_chunks"] == 3


def test_retry_that_carries_more_chunks_appends_only_the_new_ones():
    store = ReplicaStore()
    a, b, c = chunks(3)
    write(store, [a, b], 0)
    assert write(store, [b, c], len(a)) == len(a + b + c)
    assert stored(store) == a + b + c


def test_retry_of_a_closing_write_after_it_left_memory():
    store = ReplicaStore()
    flusher = FakeFlusher(store)
    a, b, c = chunks(3)
    write(store, [a], 0)
    write(store, [b, c], len(a), close=True)
    flusher.drain()
    assert store.replicas[KEY].memory_bytes == 0  # closed and on disk: dropped from memory
    assert write(store, [b, c], len(a), close=True) == len(a + b + c)
    with pytest.raises(BadRequest, match="offset mismatch"):
        write(store, [c, b], len(a), close=True)
    with pytest.raises(BadRequest, match="offset mismatch"):
        write(store, [a], 0)  # older than the last write: no longer comparable
    assert flusher.disk[KEY] == a + b + c


# --------------------------------------------------------------------------- close

def test_close_refuses_further_appends_and_is_flushed_in_the_metadata():
    store = ReplicaStore()
    flusher = FakeFlusher(store)
    a, b = chunks(2)
    write(store, [a], 0, close=True)
    with pytest.raises(BadRequest, match="closed"):
        write(store, [b], len(a))
    assert write(store, [], len(a), close=True) == len(a)  # closing again is harmless
    flusher.drain()
    assert flusher.meta[KEY].closed and flusher.meta[KEY].length == len(a)
    assert store.list_replicas(7)[0] == {
        "broker_id": 7, "vlog": 0, "vseg": 1, "length": len(a), "closed": True,
        "memory_from": len(a), "disk_length": len(a), "in_memory": False, "on_disk": True}


def test_close_without_chunks_after_data():
    store = ReplicaStore()
    flusher = FakeFlusher(store)
    a = make_chunk(0)
    write(store, [a], 0)
    flusher.drain()
    assert not flusher.meta[KEY].closed
    write(store, [], len(a), close=True)
    flusher.drain()
    assert flusher.meta[KEY].closed and flusher.disk[KEY] == a


# --------------------------------------------------------------------------- durability

def test_disk_durability_defers_the_ack_until_the_flush_completes():
    store = ReplicaStore()
    a, b = chunks(2)
    assert write(store, [a], 0, durability="disk", token="w1") is None
    assert write(store, [b], len(a), durability="disk", token="w2") is None
    jobs = store.take_flush_jobs(0.0)
    assert len(jobs) == 1 and jobs[0].offset == 0 and jobs[0].meta.length == len(a + b)
    # One flush makes both durable; each reply names the end of its own write.
    assert store.flush_done(jobs[0], None, 0.0) == [("w1", len(a)), ("w2", len(a + b))]
    # Already durable: a retry is answered at once.
    assert write(store, [b], len(a), durability="disk", token="w3") == len(a + b)


def test_disk_write_while_a_flush_is_in_flight_waits_for_the_next_flush():
    store = ReplicaStore()
    a, b = chunks(2)
    write(store, [a], 0, durability="disk", token="w1")
    (job1,) = store.take_flush_jobs(0.0)
    write(store, [b], len(a), durability="disk", token="w2")
    assert store.take_flush_jobs(0.0) == []  # one job per replica at a time
    assert store.flush_done(job1, None, 0.0) == [("w1", len(a))]
    (job2,) = store.take_flush_jobs(0.0)
    assert job2.offset == len(a) and [x.tobytes() for x in job2.buffers] == [b]
    assert store.flush_done(job2, None, 0.0) == [("w2", len(a + b))]


def test_disk_close_waits_for_the_closed_metadata():
    store = ReplicaStore()
    a = make_chunk(0)
    write(store, [a], 0)
    (job,) = store.take_flush_jobs(0.0)
    assert write(store, [], len(a), durability="disk", close=True, token="c") is None
    assert store.flush_done(job, None, 0.0) == []  # bytes are durable, the close is not
    (job,) = store.take_flush_jobs(0.0)
    assert job.buffers == () and job.meta.closed
    assert store.flush_done(job, None, 0.0) == [("c", len(a))]


def test_memory_durability_acks_before_any_flush():
    store = ReplicaStore()
    a = make_chunk(0)
    assert write(store, [a], 0, durability="memory") == len(a)
    assert store.replicas[KEY].flushed_length == 0


def test_shutdown_answers_waiting_writes():
    store = ReplicaStore()
    write(store, chunks(1), 0, durability="disk", token="w")
    (reply,) = store.abandon_waiters("stopping")
    assert reply[0] == "w" and isinstance(reply[1], NotReady)


# --------------------------------------------------------------------------- bounds

def test_unflushed_bound_throttles_until_the_flusher_catches_up():
    a = make_chunk(0, n=10, size=100)
    store = ReplicaStore(StoreConfig(max_unflushed_bytes=2 * len(a), max_memory_bytes=100 * len(a)))
    flusher = FakeFlusher(store)
    write(store, [a], 0)
    write(store, [a], len(a))
    with pytest.raises(Throttled) as info:
        write(store, [a], 2 * len(a))
    assert info.value.retriable
    assert store.replicas[KEY].length == 2 * len(a)
    assert store.stats()["throttled"] == 1
    flusher.drain()
    assert write(store, [a], 2 * len(a)) == 3 * len(a)


def test_one_oversized_write_passes_an_empty_flusher():
    a = make_chunk(0, n=10, size=100)
    store = ReplicaStore(StoreConfig(max_unflushed_bytes=len(a) // 2, max_memory_bytes=10 * len(a)))
    assert write(store, [a, a], 0) == 2 * len(a)
    with pytest.raises(Throttled):
        write(store, [a], 2 * len(a))


def test_memory_bound_lets_flushed_bytes_of_open_replicas_go():
    a = make_chunk(0, n=10, size=100)
    store = ReplicaStore(StoreConfig(max_unflushed_bytes=4 * len(a), max_memory_bytes=4 * len(a)))
    flusher = FakeFlusher(store)
    write(store, [a, a], 0, key=(1, 0, 0))
    write(store, [a, a], 0, key=(1, 0, 1))
    flusher.drain()
    assert store.memory_bytes == 4 * len(a)
    write(store, [a], 2 * len(a), key=(1, 0, 1))  # makes room by dropping (1,0,0)'s bytes
    assert store.memory_bytes <= 4 * len(a)
    assert store.replicas[(1, 0, 0)].memory_bytes == 0
    assert isinstance(store.read((1, 0, 0), 0, 1), DiskRead)
    # Bytes not yet flushed never leave memory: with all of it unflushed, writes wait.
    store2 = ReplicaStore(StoreConfig(max_unflushed_bytes=2 * len(a), max_memory_bytes=2 * len(a)))
    write(store2, [a, a], 0)
    with pytest.raises(Throttled):
        write(store2, [a], 0, key=(1, 1, 1))


def test_flush_jobs_in_flight_are_bounded():
    store = ReplicaStore(StoreConfig(flush_jobs_max=2))
    for vseg in range(5):
        write(store, chunks(1), 0, key=(1, 0, vseg))
    jobs = store.take_flush_jobs(0.0)
    assert len(jobs) == 2 and store.take_flush_jobs(0.0) == []
    store.flush_done(jobs[0], None, 0.0)
    assert len(store.take_flush_jobs(0.0)) == 1


def test_flush_job_size_is_bounded_but_takes_at_least_one_chunk():
    a = make_chunk(0, n=10, size=100)
    store = ReplicaStore(StoreConfig(flush_job_max_bytes=len(a) + 1))
    write(store, [a, a, a], 0)
    (job,) = store.take_flush_jobs(0.0)
    assert len(job.buffers) == 1 and not job.meta.closed


# --------------------------------------------------------------------------- storage errors

def test_failed_flush_reports_storage_error_then_recovers():
    store = ReplicaStore(StoreConfig(flush_retry_s=1.0))
    flusher = FakeFlusher(store)
    a, b = chunks(2)
    write(store, [a], 0, durability="disk", token="w1")
    replies = flusher.run(now=10.0, fail=OSError(28, "No space left on device"))
    assert len(replies) == 1 and replies[0][0] == "w1"
    assert isinstance(replies[0][1], StorageError) and replies[0][1].retriable
    with pytest.raises(StorageError):
        write(store, [b], len(a))
    assert store.stats()["storage_errors"] == 1 and store.stats()["replicas_failed"] == 1
    assert store.take_flush_jobs(10.5) == []  # backing off
    assert flusher.run(now=11.0, fail=OSError(5, "EIO")) == []
    assert store.take_flush_jobs(12.5) == []  # the back-off doubled
    assert flusher.drain(now=13.0) == []
    assert write(store, [b], len(a), durability="disk", token="w2") is None
    assert flusher.drain(now=13.0) == [("w2", len(a + b))]
    assert flusher.disk[KEY] == a + b and store.stats()["unflushed_bytes"] == 0


# --------------------------------------------------------------------------- reads

def test_read_from_memory_returns_whole_chunks():
    store = ReplicaStore()
    a, b, c = chunks(3)
    write(store, [a, b, c], 0)
    assert [x.tobytes() for x in store.read(KEY, 0, 1)] == [a]  # at least one chunk
    assert [x.tobytes() for x in store.read(KEY, len(a), len(b + c))] == [b, c]
    assert store.read(KEY, len(a + b + c), 100) == []
    with pytest.raises(BadRequest, match="boundary"):
        store.read(KEY, 3, 100)
    with pytest.raises(OffsetOutOfRange):
        store.read(KEY, len(a + b + c) + 1, 100)
    with pytest.raises(BadRequest, match="unknown"):
        store.read((0, 0, 0), 0, 100)


def test_loaded_replica_reads_from_disk_and_accepts_appends():
    from kera.backup.meta import Meta
    store = ReplicaStore()
    store.load(Meta(7, 0, 1, 500, False))
    assert store.read(KEY, 0, 100) == DiskRead(KEY, 0, 500, 100)
    b = make_chunk(1)
    assert write(store, [b], 500) == 500 + len(b)
    assert [x.tobytes() for x in store.read(KEY, 500, 1)] == [b]
    (job,) = store.take_flush_jobs(0.0)
    assert job.offset == 500


# --------------------------------------------------------------------------- seeded simulation

@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_the_store_consistent(seed):
    """Random writes, retries, bad writes, closes, flushes that fail or succeed, and a small
    memory: the counters match a recount, every deferred write is answered exactly once, and
    what reaches the (fake) disk is exactly what was acknowledged."""
    import random
    rng = random.Random(seed)
    pool = [make_chunk(i, n=rng.randrange(1, 5), size=rng.randrange(1, 200)) for i in range(40)]
    store = ReplicaStore(StoreConfig(max_unflushed_bytes=3000, max_memory_bytes=6000,
                                     flush_job_max_bytes=700, flush_jobs_max=3, flush_retry_s=0.5))
    flusher = FakeFlusher(store)
    keys = [(b, 0, v) for b in range(2) for v in range(3)]
    model = {k: [] for k in keys}          # acknowledged-or-stored chunks, per replica
    closed = {k: False for k in keys}
    last = {}                              # key -> (offset, chunks, close) of the last stored write
    waiting, answered = {}, {}
    now = 0.0
    tokens = iter(range(10**9))

    def settle(replies):
        for token, outcome in replies:
            assert token in waiting and token not in answered
            answered[token] = outcome

    for _ in range(400):
        now += rng.random() * 0.2
        key = rng.choice(keys)
        length = sum(map(len, model[key]))
        op = rng.random()
        try:
            if op < 0.45 and not closed[key]:
                new = rng.sample(pool, rng.randrange(0, 4))
                close = rng.random() < 0.1
                durability = rng.choice(["memory", "disk"])
                token = next(tokens)
                result = write(store, new, length, key=key, durability=durability, close=close,
                               token=token, now=now)
                model[key] += new
                closed[key] |= close
                if new:
                    last[key] = (length, new, close)
                end = length + sum(map(len, new))
                if result is None:
                    waiting[token] = end
                else:
                    assert result == end
            elif op < 0.55 and key in last:
                offset, new, close = last[key]
                assert write(store, new, offset, key=key, close=close, now=now) == offset + sum(map(len, new))
            elif op < 0.65:
                bad = corrupt(rng.choice(pool), rng.randrange(64))
                with pytest.raises((CorruptChunk, BadRequest)):
                    write(store, [rng.choice(pool), bad], length, key=key, now=now)
                with pytest.raises(BadRequest):
                    write(store, [rng.choice(pool)], length + rng.randrange(1, 50), key=key, now=now)
            else:
                fail = OSError(28, "No space left on device") if rng.random() < 0.15 else None
                settle(flusher.run(now=now, fail=fail))
        except (Throttled, StorageError):
            pass
        replicas = store.replicas.values()
        assert store.unflushed_bytes == sum(r.unflushed_bytes for r in replicas)
        assert store.memory_bytes == sum(r.memory_bytes for r in replicas) <= 6000 + 4 * 1000
        assert store.replicas_open == sum(not r.closed for r in replicas)
        assert store.replicas_on_disk == sum(r.on_disk for r in replicas)
        assert store.replicas_failed == sum(bool(r.failed) for r in replicas)
        for k, r in store.replicas.items():
            assert r.memory_from <= r.flushed_length <= r.length == sum(map(len, model[k]))

    for _ in range(100):  # let every back-off expire and flush everything
        now += 31.0
        settle(flusher.run(now=now))
        if store.idle():
            break
    assert store.idle()
    assert set(answered) == set(waiting)
    for token, outcome in answered.items():
        assert outcome == waiting[token] or isinstance(outcome, StorageError)
    for k, r in store.replicas.items():
        assert bytes(flusher.disk[k]) == b"".join(model[k])
        assert flusher.meta[k].length == r.length and flusher.meta[k].closed == closed[k]


def delayed_store(**cfg) -> ReplicaStore:
    return ReplicaStore(StoreConfig(flush_delay_s=0.05, flush_batch_bytes=4096, **cfg))


def test_memory_writes_wait_for_the_flush_delay_and_are_flushed_together():
    store = delayed_store()
    flusher = FakeFlusher(store)
    store.replicate(KEY, 0, chunks(1), "memory", False, "a", now=0.0)
    assert flusher.run(now=0.01) == [] and not flusher.disk
    end = store.replicate(KEY, len(chunks(1)[0]), chunks(1, start=1), "memory", False, "b",
                          now=0.03)
    assert flusher.run(now=0.049) == [] and not flusher.disk   # the oldest bytes set the wait
    flusher.run(now=0.05)
    assert len(flusher.disk[KEY]) == end   # both writes in one flush


def test_a_disk_write_or_a_full_batch_is_flushed_at_once():
    store = delayed_store()
    flusher = FakeFlusher(store)
    end = store.replicate(KEY, 0, chunks(1), "memory", False, "a", now=0.0)
    assert store.replicate(KEY, end, chunks(1, start=1), "disk", False, "b", now=0.0) is None
    assert [token for token, _ in flusher.run(now=0.0)] == ["b"]   # no wait: "b" waits on it
    other = (7, 0, 2)
    big = chunks(1, size=5000)                   # over the 4096-byte batch
    store.replicate(other, 0, big, "memory", False, "c", now=1.0)
    flusher.run(now=1.0)
    assert bytes(flusher.disk[other]) == big[0]


def test_a_flush_delay_must_not_be_negative():
    with pytest.raises(ValueError, match="flush_delay_s"):
        ReplicaStore(StoreConfig(flush_delay_s=-1))
