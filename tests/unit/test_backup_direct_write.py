"""Replica files written with O_DIRECT (kera.backup.direct_write, kera.backup.disk.flush): any
offset and length, across the staging buffer's end, leave the file holding exactly the bytes
written, as buffered writes do; a file shorter than the flush's offset is an error, not a gap."""

import errno
import os
import random

import pytest

from kera.codec import chunk
from kera.backup import direct_write, disk
from kera.backup.meta import Meta
from kera.backup.store import FlushJob

BLOCK = direct_write.BLOCK_BYTES


def _open_direct(path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as err:
        if err.errno == errno.EINVAL:
            pytest.skip(f"{path.parent}'s filesystem refuses O_DIRECT")
        raise


@pytest.mark.parametrize("seed", range(4))
def test_appends_at_any_offset_leave_exactly_the_bytes_written(tmp_path, monkeypatch, seed):
    # A staging buffer of 3 blocks: most appends cross its end at least once.
    monkeypatch.setattr(direct_write, "STAGING_BYTES", 3 * BLOCK)
    rng = random.Random(seed)
    path = tmp_path / "replica.seg"
    fd = _open_direct(path)
    expect = bytearray()
    try:
        for _ in range(40):
            buffers = [rng.randbytes(rng.choice([0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 5, 9000]))
                       for _ in range(rng.randrange(1, 5))]
            direct_write.write(fd, [memoryview(b) for b in buffers], len(expect))
            expect += b"".join(buffers)
            assert os.fstat(fd).st_size == len(expect)
            assert path.read_bytes() == bytes(expect)
    finally:
        os.close(fd)


def test_a_file_shorter_than_the_offset_is_refused(tmp_path):
    fd = _open_direct(tmp_path / "short.seg")
    try:
        direct_write.write(fd, [b"x" * 100], 0)
        with pytest.raises(OSError, match="ends at byte 100, before the 200 bytes"):
            direct_write.write(fd, [b"y"], 200)
    finally:
        os.close(fd)


def test_the_staging_buffer_is_reused_after_a_failed_write(tmp_path, monkeypatch):
    # A write refused half way (256-byte blocks on this 512-byte device: its first 4 KiB go,
    # its padded tail is refused) leaves this thread's staging buffer full of its bytes. The
    # next write reuses that buffer and must store only its own bytes, behind the head it
    # reads back, and cut off the rest.
    monkeypatch.setattr(direct_write, "STAGING_BYTES", BLOCK)
    bad, good = _open_direct(tmp_path / "bad.seg"), _open_direct(tmp_path / "good.seg")
    try:
        direct_write.write(good, [b"g" * 10], 0)
        monkeypatch.setattr(direct_write, "BLOCK_BYTES", 256)
        monkeypatch.setattr(direct_write, "_ZEROS", bytes(256))
        with pytest.raises(OSError) as refused:
            direct_write.write(bad, [b"x" * (BLOCK + 188)], 0)
        assert refused.value.errno == errno.EINVAL
        assert (tmp_path / "bad.seg").read_bytes() == b"x" * BLOCK   # the part that went
        monkeypatch.setattr(direct_write, "BLOCK_BYTES", BLOCK)
        monkeypatch.setattr(direct_write, "_ZEROS", bytes(BLOCK))
        direct_write.write(good, [b"h" * 5], 10)
        assert (tmp_path / "good.seg").read_bytes() == b"g" * 10 + b"h" * 5
    finally:
        os.close(bad)
        os.close(good)


def _chunks(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [chunk.encode(1, i, 2, 0, [rng.randbytes(rng.randrange(1, 3000))]) for i in range(n)]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_flushes_write_the_replica_through_either_path(tmp_path, monkeypatch, direct):
    if direct:
        os.close(_open_direct(tmp_path / "probe"))
    monkeypatch.setattr(direct_write, "_works", direct)
    key = (1, 0, 7)
    data, offset = _chunks(30, 1), 0
    for cut in (5, 6, 19, 30):
        done = sum(map(len, data[:cut]))
        start = sum(map(len, data[:offset]))
        disk.flush(tmp_path, FlushJob(key, start, tuple(memoryview(c) for c in data[offset:cut]),
                                      Meta(*key, done, False)))
        assert disk.segment_path(tmp_path, key).read_bytes() == b"".join(data[:cut])
        offset = cut
    total = len(b"".join(data))     # not a multiple of a block: a close rewrites nothing
    disk.flush(tmp_path, FlushJob(key, total, (), Meta(*key, total, True)))
    assert disk.segment_path(tmp_path, key).read_bytes() == b"".join(data)
    assert direct_write._works is direct    # O_DIRECT was taken, not given up on
    [record] = disk.scan(tmp_path)
    assert (record.length, record.closed) == (total, True)
    assert total % BLOCK


def test_a_device_refusing_the_alignment_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    # Blocks of 256 bytes are below this device's logical block (512 or more): the kernel
    # refuses those O_DIRECT writes with EINVAL, as a device with blocks larger than
    # BLOCK_BYTES would refuse ours.
    os.close(_open_direct(tmp_path / "probe"))
    monkeypatch.setattr(direct_write, "_works", True)
    monkeypatch.setattr(direct_write, "BLOCK_BYTES", 256)
    monkeypatch.setattr(direct_write, "_ZEROS", bytes(256))
    key, data = (1, 0, 8), [chunk.encode(1, 0, 2, 0, [b"x"])]   # padded to one 256-byte block
    assert len(data[0]) <= 256
    disk.flush(tmp_path, FlushJob(key, 0, tuple(map(memoryview, data)),
                                  Meta(*key, len(b"".join(data)), False)))
    assert direct_write._works is False
    assert disk.segment_path(tmp_path, key).read_bytes() == b"".join(data)
    more = _chunks(2, 3)
    disk.flush(tmp_path, FlushJob(key, len(b"".join(data)), tuple(map(memoryview, more)),
                                  Meta(*key, len(b"".join(data + more)), True)))
    assert disk.segment_path(tmp_path, key).read_bytes() == b"".join(data + more)
