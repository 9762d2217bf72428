"""A broker restarting a replica from offset 0 (`replicate` with `reset`): the backup discards
what it holds of it (memory and disk) and takes the write as its new content. Without it, a
replica held only on disk (a restarted backup, or flushed bytes that left memory under a memory
bound) refused every rewrite from 0, and a virtual segment with no other backup free never
became durable (tests/sim seeds 10 and 5)."""

import pytest

from kera.codec import chunk
from kera.backup import disk
from kera.backup.meta import Meta
from kera.backup.store import DropJob, FlushJob, ReplicaStore, StoreConfig
from kera.broker.core import Broker, BrokerConfig
from kera.errors import BadRequest, CorruptChunk, KeraError

KEY = (7, 0, 1)


def make_chunk(seq: int, size: int = 10) -> bytes:
    return chunk.encode(1, seq, 5, 0, [bytes([seq % 256]) * size] * 3)


class FakeDisk:
    """Runs the store's flusher jobs in order, as the flusher thread does, on in-memory files."""

    def __init__(self):
        self.files: dict = {}
        self.metas: dict = {}
        self.log: list = []

    def run(self, job) -> None:
        self.log.append(job)
        if isinstance(job, DropJob):
            self.metas.pop(job.key, None)
            self.files.pop(job.key, None)
            return
        data = self.files.setdefault(job.key, bytearray())
        assert len(data) >= job.offset, "a flush past the end of the file"
        del data[job.offset:]
        for b in job.buffers:
            data += b
        self.metas[job.key] = job.meta


def flush_all(store: ReplicaStore, fake: FakeDisk, now: float = 0.0) -> list:
    replies = []
    while not store.idle():
        for job in store.take_flush_jobs(now):
            fake.run(job)
            replies += store.flush_done(job, None, now)
    return replies


def rewrite(store, frames, key=KEY, durability="memory", token=None, close=False):
    """What the backup server does with a write that carries `reset`."""
    failed = store.reset(key, 0, frames)
    return failed, store.replicate(key, 0, frames, durability, close, token, 0.0)


def held(store, key=KEY) -> bytes:
    return b"".join(bytes(c) for c in store.replicas[key].chunks)


# --------------------------------------------------------------------------- the store

def test_rewrite_of_a_replica_loaded_from_disk_replaces_it():
    a, b, c = (make_chunk(i) for i in range(3))
    fake = FakeDisk()
    fake.files[KEY] = bytearray(a + b)
    fake.metas[KEY] = Meta(*KEY, len(a + b), False)
    store = ReplicaStore()
    store.load(fake.metas[KEY])               # a restarted backup: every byte is on disk only
    with pytest.raises(BadRequest, match="offset mismatch"):
        store.replicate(KEY, 0, [a, c], "memory", False, None, 0.0)   # no reset: refused
    failed, length = rewrite(store, [a, c])
    assert failed == [] and length == len(a + c)
    assert held(store) == a + c and store.replicas[KEY].memory_from == 0
    flush_all(store, fake)
    # The old files go first (metadata record first), then the new content is written from 0.
    assert isinstance(fake.log[0], DropJob) and fake.log[1].offset == 0
    assert bytes(fake.files[KEY]) == a + c and fake.metas[KEY].length == len(a + c)
    stats = store.stats()
    assert stats["replicas_reset"] == 1 and stats["replicas"] == 1
    assert stats["unflushed_bytes"] == 0 and stats["replicas_on_disk"] == 1


def test_rewrite_after_flushed_bytes_left_memory():
    a, b, c = (make_chunk(i, size=100) for i in range(3))
    size = len(a)
    store = ReplicaStore(StoreConfig(max_unflushed_bytes=3 * size, max_memory_bytes=3 * size))
    fake = FakeDisk()
    store.replicate(KEY, 0, [a, b], "memory", False, None, 0.0)
    flush_all(store, fake)
    other = (7, 0, 2)
    store.replicate(other, 0, [c, make_chunk(3, size=100)], "memory", False, None, 0.0)
    assert store.replicas[KEY].memory_from > 0    # made room: KEY's flushed bytes left memory
    flush_all(store, fake)
    with pytest.raises(BadRequest, match="offset mismatch"):
        store.replicate(KEY, 0, [a, c], "memory", False, None, 0.0)
    failed, length = rewrite(store, [a, c])
    assert length == len(a + c) and held(store) == a + c
    flush_all(store, fake)
    assert bytes(fake.files[KEY]) == a + c
    assert store.stats()["memory_bytes"] == sum(r.memory_bytes for r in store.replicas.values())


def test_disk_writes_waiting_for_the_discarded_content_get_an_error():
    a, b = make_chunk(0), make_chunk(1)
    store = ReplicaStore()
    fake = FakeDisk()
    assert store.replicate(KEY, 0, [a], "disk", False, "old", 0.0) is None
    failed, length = rewrite(store, [a, b], durability="disk", token="new")
    assert length is None
    assert [(token, err.code) for token, err in failed] == [("old", "bad_request")]
    assert "reset" in failed[0][1].message
    assert flush_all(store, fake) == [("new", len(a + b))]
    assert bytes(fake.files[KEY]) == a + b


def test_reset_while_a_flush_of_the_old_content_is_in_flight():
    a, b, c = (make_chunk(i) for i in range(3))
    store = ReplicaStore()
    fake = FakeDisk()
    store.replicate(KEY, 0, [a, b], "disk", False, "old", 0.0)
    [old_job] = store.take_flush_jobs(0.0)    # out at the flusher
    failed, length = rewrite(store, [c], durability="disk", token="new")
    assert [t for t, _ in failed] == ["old"] and length is None
    assert store.take_flush_jobs(0.0) == []   # the new content waits for the old flush
    fake.run(old_job)
    assert store.flush_done(old_job, None, 0.0) == []   # settles nothing of the new content
    assert flush_all(store, fake) == [("new", len(c))]
    assert isinstance(fake.log[1], DropJob) and fake.log[2].offset == 0
    assert bytes(fake.files[KEY]) == c and fake.metas[KEY] == Meta(*KEY, len(c), False)
    stats = store.stats()
    assert stats["unflushed_bytes"] == 0 and stats["flush_jobs_out"] == 0
    assert stats["memory_bytes"] == len(c) and stats["replicas_open"] == 1


def test_reset_of_a_closed_replica_and_of_an_unknown_one():
    a, b = make_chunk(0), make_chunk(1)
    store = ReplicaStore()
    store.replicate(KEY, 0, [a], "memory", True, None, 0.0)
    _, length = rewrite(store, [b], close=False)
    assert length == len(b) and not store.replicas[KEY].closed
    assert store.replicate(KEY, len(b), [a], "memory", False, None, 0.0) == len(b + a)
    assert rewrite(store, [a], key=(7, 0, 9)) == ([], len(a))   # nothing to discard


def test_a_corrupt_or_misplaced_reset_write_changes_nothing():
    a, b = make_chunk(0), make_chunk(1)
    store = ReplicaStore()
    store.replicate(KEY, 0, [a], "memory", False, None, 0.0)
    bad = bytearray(b)
    bad[-1] ^= 1
    with pytest.raises(CorruptChunk):
        store.reset(KEY, 0, [bytes(bad)])
    with pytest.raises(BadRequest, match="offset 0"):
        store.reset(KEY, len(a), [b])
    assert held(store) == a and store.stats().get("replicas_reset", 0) == 0


def test_first_flush_of_a_file_truncates_what_was_there(tmp_path):
    """kera.backup.disk: a flush at 0 starts the file over, whatever an earlier incarnation of
    the replica (whose removal may have failed) left in it."""
    a, b, c = (make_chunk(i) for i in range(3))
    disk.flush(tmp_path, FlushJob(KEY, 0, (memoryview(a + b),), Meta(*KEY, len(a + b), True)))
    disk.flush(tmp_path, FlushJob(KEY, 0, (memoryview(c),), Meta(*KEY, len(c), False)))
    assert disk.segment_path(tmp_path, KEY).read_bytes() == c
    assert disk.scan(tmp_path) == [Meta(*KEY, len(c), False)]


# --------------------------------------------------------------------------- with a broker

def test_a_lone_backup_restarted_from_disk_is_rewritten_from_zero():
    """Seed 10: R=3 with two backups; backup 1 restarts with its replica on disk only, the
    broker staffs the virtual segment on it again from offset 0, and it must take the rewrite."""
    desc = {"name": "s", "id": 1, "streamlets": 1, "active_groups": 1, "replication": 3,
            "group_segments": 16, "segment_size_bytes": 1 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [3], "brokers": {}, "version": 1, "ready": True}
    backups = [{"id": i, "address": f"h:{i}", "node": f"n{i}", "alive": True} for i in (1, 2)]
    broker = Broker("n0", BrokerConfig(), broker_id=3)
    broker.apply_metadata([desc], 1)
    broker.placement.set_backups(backups, 0.0)
    stores = {1: ReplicaStore(), 2: ReplicaStore()}
    disks = {1: FakeDisk(), 2: FakeDisk()}

    def deliver(writes, now):
        for w in writes:
            store, f = stores[w.backup_id], w.fields
            key = (f["broker_id"], f["vlog"], f["vseg"])
            try:
                if f.get("reset"):
                    store.reset(key, f["offset"], w.frames)
                header = {"length": store.replicate(key, f["offset"], w.frames, f["durability"],
                                                    f["close"], None, now)}
                err = None
            except KeraError as e:
                header, err = None, e
            broker.write_done(w, header, err, now)
            flush_all(store, disks[w.backup_id])

    def produce(seq, now):
        token = f"p{seq}"
        broker.produce(token, [chunk.encode(1, seq, 1, 0, [b"x" * 50] * 4)], now)
        deliver(broker.sync(now), now)
        return token

    produce(0, 0.0)
    assert [t for t, _ in broker.take_replies()] == ["p0"]
    # Backup 1 is declared dead, restarts and loads its replica from disk.
    broker.placement.set_backups(backups[1:], 1.0)
    stores[1] = ReplicaStore()
    for meta in disks[1].metas.values():
        stores[1].load(meta)
    broker.placement.set_backups(backups, 1.1)
    produce(1, 1.2)
    now = 1.2
    while now < 5.0 and not broker.take_replies():
        now += 0.25
        deliver(broker.sync(now), now)
    assert now < 5.0, "the restarted backup never took the rewrite"
    assert stores[1].stats()["replicas_reset"] == 1
    replica = next(iter(stores[1].replicas.values()))
    assert replica.length == next(iter(stores[2].replicas.values())).length
