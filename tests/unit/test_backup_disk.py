"""Replica files (kera.backup.disk, kera.backup.meta) and the flusher shell (kera.backup.worker)."""

import errno
import os
import select
import time

import pytest

from kera.codec import chunk
from kera.backup import disk, meta
from kera.backup.meta import CorruptMeta, Meta
from kera.backup.store import DiskRead, ReplicaStore
from kera.backup.worker import Worker
from kera.errors import CorruptChunk, StorageError

KEY = (3, 2, 41)


def make_chunk(seq: int, n: int = 4, size: int = 50) -> bytes:
    return chunk.encode(9, seq, 1, 0, [bytes([65 + seq % 26]) * size] * n)


def wait_for(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


# --------------------------------------------------------------------------- metadata record

def test_meta_round_trip():
    for record in (Meta(0, 0, 0, 0, False), Meta(2**64 - 1, 2**32 - 1, 2**64 - 1, 2**64 - 1, True)):
        assert meta.decode(meta.encode(record)) == record
    assert len(meta.encode(Meta(1, 2, 3, 4, True))) == meta.SIZE


def test_meta_checksum_catches_every_bit_flip():
    good = meta.encode(Meta(3, 2, 41, 123456, True))
    for bit in range(8 * len(good)):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptMeta):
            meta.decode(bytes(bad))
    for size in (0, 39, 41):
        with pytest.raises(CorruptMeta):
            meta.decode((good * 2)[:size])


# --------------------------------------------------------------------------- flushing

def flush_all(root, store: ReplicaStore) -> None:
    while not store.idle():
        for job in store.take_flush_jobs(0.0):
            disk.flush(root, job)
            store.flush_done(job, None, 0.0)


def test_flush_writes_the_same_bytes_and_a_metadata_record(tmp_path):
    store = ReplicaStore()
    a, b, c = (make_chunk(i) for i in range(3))
    store.replicate(KEY, 0, [a, b], "memory", False, None, 0.0)
    flush_all(tmp_path, store)
    seg = tmp_path / "3" / "0002-000000000041.seg"
    assert seg.read_bytes() == a + b
    assert disk.read_meta(seg.with_suffix(".meta")) == Meta(3, 2, 41, len(a + b), False)
    store.replicate(KEY, len(a + b), [c], "memory", True, None, 0.0)
    flush_all(tmp_path, store)
    assert seg.read_bytes() == a + b + c
    assert disk.read_meta(seg.with_suffix(".meta")) == Meta(3, 2, 41, len(a + b + c), True)
    assert sorted(p.name for p in (tmp_path / "3").iterdir()) == [
        "0002-000000000041.meta", "0002-000000000041.seg"]


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real = os.pwritev

    def stingy(fd, buffers, offset):  # a file system that writes 7 bytes at a time
        head = bytes(buffers[0])[:7]
        return real(fd, [head], offset)

    monkeypatch.setattr(os, "pwritev", stingy)
    store = ReplicaStore()
    data = [make_chunk(i) for i in range(3)]
    store.replicate(KEY, 0, data, "memory", False, None, 0.0)
    flush_all(tmp_path, store)
    assert disk.segment_path(tmp_path, KEY).read_bytes() == b"".join(data)


def test_scan_finds_good_replicas_and_skips_damaged_ones(tmp_path):
    store = ReplicaStore()
    for key in ((1, 0, 0), (1, 0, 1), (2, 5, 7), (2, 5, 8)):
        store.replicate(key, 0, [make_chunk(0)], "memory", key == (1, 0, 0), None, 0.0)
    flush_all(tmp_path, store)
    disk.meta_path(tmp_path, (2, 5, 8)).write_bytes(b"\x00" * meta.SIZE)      # bad checksum
    disk.segment_path(tmp_path, (1, 0, 1)).write_bytes(b"short")             # file shorter than record
    (tmp_path / "1" / "0000-000000000009.meta.tmp").write_bytes(b"leftover")  # ignored
    (tmp_path / "notes").mkdir()
    found = disk.scan(tmp_path)
    assert [(m.broker_id, m.vlog, m.vseg, m.closed) for m in found] == [(1, 0, 0, True), (2, 5, 7, False)]
    assert disk.scan(tmp_path / "missing") == []


# --------------------------------------------------------------------------- reading back

def test_read_chunks_verifies_every_chunk(tmp_path):
    store = ReplicaStore()
    data = [make_chunk(i) for i in range(4)]
    total = sum(map(len, data))
    store.replicate(KEY, 0, data, "memory", True, None, 0.0)
    flush_all(tmp_path, store)
    assert store.read(KEY, 0, 1) == DiskRead(KEY, 0, total, 1)
    assert [c.tobytes() for c in disk.read_chunks(tmp_path, DiskRead(KEY, 0, total, 1))] == data[:1]
    got = disk.read_chunks(tmp_path, DiskRead(KEY, len(data[0]), total, 10**6))
    assert [c.tobytes() for c in got] == data[1:]
    # The limit (what the metadata names) is never passed.
    got = disk.read_chunks(tmp_path, DiskRead(KEY, 0, len(data[0]) + len(data[1]), 10**6))
    assert [c.tobytes() for c in got] == data[:2]
    with pytest.raises(CorruptChunk, match="boundary"):
        disk.read_chunks(tmp_path, DiskRead(KEY, 5, total, 10**6))
    path = disk.segment_path(tmp_path, KEY)
    damaged = bytearray(path.read_bytes())
    damaged[len(data[0]) + 100] ^= 1
    path.write_bytes(bytes(damaged))
    assert [c.tobytes() for c in disk.read_chunks(tmp_path, DiskRead(KEY, 0, total, 1))] == data[:1]
    with pytest.raises(CorruptChunk, match="checksum"):
        disk.read_chunks(tmp_path, DiskRead(KEY, 0, total, 10**6))


# --------------------------------------------------------------------------- the flusher shell

def completions(worker: Worker) -> list:
    select.select([worker.wake_fd], [], [], 5.0)  # the wake-up pipe signals a finished job
    return wait_for(worker.completions)


def test_flusher_thread_writes_and_reports(tmp_path):
    store = ReplicaStore()
    worker = Worker("test-flusher", lambda job: disk.flush(tmp_path, job), 4)
    try:
        a = make_chunk(0)
        assert store.replicate(KEY, 0, [a], "disk", False, "token", 0.0) is None
        (job,) = store.take_flush_jobs(0.0)
        worker.submit(job)
        ((done, _, error),) = completions(worker)
        assert done is job and error is None
        assert store.flush_done(done, error, 0.0) == [("token", len(a))]
        assert disk.segment_path(tmp_path, KEY).read_bytes() == a
    finally:
        worker.close()


def test_unwritable_directory_reports_storage_error(tmp_path):
    (tmp_path / "3").write_bytes(b"a file where the broker's directory should be")
    store = ReplicaStore()
    worker = Worker("test-flusher", lambda job: disk.flush(tmp_path, job), 4)
    try:
        assert store.replicate(KEY, 0, [make_chunk(0)], "disk", False, "token", 0.0) is None
        worker.submit(store.take_flush_jobs(0.0)[0])
        ((job, _, error),) = completions(worker)
        assert isinstance(error, OSError)
        ((token, reply),) = store.flush_done(job, error, 0.0)
        assert token == "token" and isinstance(reply, StorageError)
        assert store.stats()["storage_errors"] == 1
    finally:
        worker.close()


def test_full_disk_reports_storage_error(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full)
    store = ReplicaStore()
    worker = Worker("test-flusher", lambda job: disk.flush(tmp_path, job), 4)
    try:
        store.replicate(KEY, 0, [make_chunk(0)], "disk", False, "token", 0.0)
        worker.submit(store.take_flush_jobs(0.0)[0])
        ((job, _, error),) = completions(worker)
        assert isinstance(error, OSError) and error.errno == errno.ENOSPC
        ((_, reply),) = store.flush_done(job, error, 0.0)
        assert isinstance(reply, StorageError) and "No space" in reply.message
        assert not disk.meta_path(tmp_path, KEY).exists()  # nothing claims the unsynced bytes
    finally:
        worker.close()
