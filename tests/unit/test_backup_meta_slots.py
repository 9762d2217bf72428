"""The replica commit record in two slots (kera.backup.meta, kera.backup.disk.write_meta): each
flush commits into the other slot in place; a torn slot falls back to the previous record;
files of the single-record format (version 1) still load and are carried on."""

from __future__ import annotations

import os
import struct

import pytest
from crc32c import crc32c

from kera.backup import disk, meta
from kera.backup.meta import CorruptMeta, Meta

KEY = (3, 2, 41)


def record(length: int, closed: bool = False) -> Meta:
    return Meta(*KEY, length, closed)


def legacy_record(m: Meta) -> bytes:
    """A version-1 record as backups before the slots wrote it (40 bytes, no seq)."""
    body = struct.pack("<4sHHQIQQ", meta.MAGIC, meta.VERSION_SINGLE, int(m.closed), m.broker_id,
                       m.vlog, m.vseg, m.length)
    return body + struct.pack("<I", crc32c(body))


def path_of(root):
    path = disk.meta_path(root, KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_flushes_alternate_slots_and_the_newest_wins(tmp_path):
    path = path_of(tmp_path)
    assert disk.write_meta(tmp_path, record(10)) is True        # created: dir needs an fsync
    assert path.stat().st_size == meta.SIZE                     # slot 0 only
    assert disk.write_meta(tmp_path, record(20)) is False
    assert path.stat().st_size == meta.SLOT_BYTES + meta.SIZE   # slot 1 written in place
    disk.write_meta(tmp_path, record(30, closed=True))          # slot 0 again
    data = path.read_bytes()
    assert meta.decode_numbered(data[:meta.SIZE]) == (2, record(30, True))
    second = data[meta.SLOT_BYTES:meta.SLOT_BYTES + meta.SIZE]
    assert meta.decode_numbered(second) == (1, record(20))
    assert disk.read_meta(path) == record(30, True)
    assert path.stat().st_size == meta.SLOT_BYTES + meta.SIZE   # bounded: never grows past 2 slots


def test_a_torn_slot_falls_back_to_the_previous_record_and_is_written_next(tmp_path):
    path = path_of(tmp_path)
    disk.write_meta(tmp_path, record(10))
    disk.write_meta(tmp_path, record(20))                       # seq 1, slot 1
    data = bytearray(path.read_bytes())
    data[meta.SLOT_BYTES + 30] ^= 0xFF                          # a crash tore slot 1
    path.write_bytes(bytes(data))
    assert disk.read_meta(path) == record(10)                   # what was committed before
    disk.write_meta(tmp_path, record(25))                       # seq 1 again, into slot 1
    assert meta.newest(path.read_bytes()) == (1, record(25))


def test_a_slot_cut_short_is_not_a_record(tmp_path):
    path = path_of(tmp_path)
    disk.write_meta(tmp_path, record(10))
    second = meta.encode(record(20), 1)
    with open(path, "r+b") as f:                                # torn while extending the file
        f.seek(meta.SLOT_BYTES)
        f.write(second[:meta.SIZE - 5])
    assert disk.read_meta(path) == record(10)


def test_no_valid_slot_is_corrupt_and_a_new_write_starts_over(tmp_path):
    path = path_of(tmp_path)
    path.write_bytes(b"\x00" * (meta.SLOT_BYTES + meta.SIZE))
    with pytest.raises(CorruptMeta, match="slot 0.*slot 1"):
        disk.read_meta(path)
    assert disk.write_meta(tmp_path, record(5)) is False
    assert disk.read_meta(path) == record(5)


def test_a_file_over_two_slots_is_refused():
    with pytest.raises(CorruptMeta, match="over"):
        meta.newest(meta.encode(record(1)) + b"\x00" * (meta.FILE_BYTES_MAX - meta.SIZE + 1))


def test_a_single_record_file_still_loads_and_is_carried_on(tmp_path):
    path = path_of(tmp_path)
    path.write_bytes(legacy_record(record(77)))
    disk.segment_path(tmp_path, KEY).write_bytes(b"x" * 77)
    assert disk.read_meta(path) == record(77)
    assert disk.scan(tmp_path) == [record(77)]
    disk.write_meta(tmp_path, record(99, closed=True))         # seq 1: slot 1, slot 0 kept
    data = path.read_bytes()
    assert data[:meta.SIZE_SINGLE] == legacy_record(record(77))
    assert disk.read_meta(path) == record(99, True)


def test_a_torn_first_slot_write_after_a_single_record_keeps_the_old_record(tmp_path):
    path = path_of(tmp_path)
    path.write_bytes(legacy_record(record(77)))
    with open(path, "r+b") as f:
        f.seek(meta.SLOT_BYTES)
        f.write(meta.encode(record(99), 1)[:20])
    assert disk.read_meta(path) == record(77)


def test_flush_fsyncs_the_directory_only_when_it_created_a_file(tmp_path, monkeypatch):
    from kera.backup.store import ReplicaStore
    from kera.codec import chunk
    synced = []
    monkeypatch.setattr(disk, "fsync_dir", lambda path: synced.append(os.fspath(path)))
    store = ReplicaStore()
    offset = 0
    for i in range(3):
        c = chunk.encode(9, i, 1, 0, [b"v" * 50] * 4)
        store.replicate(KEY, offset, [c], "memory", False, None, 0.0)
        offset += len(c)
        for job in store.take_flush_jobs(0.0):
            disk.flush(tmp_path, job)
            store.flush_done(job, None, 0.0)
    directory = os.fspath(tmp_path / str(KEY[0]))
    assert synced == [os.fspath(tmp_path), directory]          # the new folder, then the new files
    assert disk.read_meta(disk.meta_path(tmp_path, KEY)).length == offset
