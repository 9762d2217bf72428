"""A broker's tier writes (kera.broker.tier_files.write_segment): a new segment file is written
with O_DIRECT, past the page cache, and holds exactly the segment's bytes under a record that
`scan` accepts; an R=1 segment's file, which its live writes made, is rewritten through the page
cache, keeping the bytes it held, and not writing again the bytes its live writes put there; a
device refusing the alignment falls back to the page cache for good. Page-cache residency is
read with util-linux's `fincore`."""

import errno
import os
import random
import shutil
import subprocess

import pytest

from kera.codec import chunk
from kera.backup import direct_write
from kera.broker import tier_files

FINCORE_TIMEOUT_S = 30.0


def _resident_bytes(path) -> int:
    fincore = shutil.which("fincore")
    assert fincore, "fincore (util-linux) is missing: apt-get install util-linux"
    out = subprocess.run([fincore, "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True, timeout=FINCORE_TIMEOUT_S)
    return int(out.stdout.strip())


def _segment(seed: int, chunks: int = 5) -> tuple[bytes, tier_files.SegmentRecord]:
    """Whole chunks of random sizes (the length is not a multiple of a block) and their record."""
    rng = random.Random(seed)
    data = b"".join(chunk.encode(1, i, 7, 0, [rng.randbytes(rng.randrange(1, 9000))])
                    for i in range(chunks))
    assert len(data) % direct_write.BLOCK_BYTES
    record = tier_files.SegmentRecord(7, 0, seed, 0, 0, len(data), chunks, 0, chunks, 0, 0,
                                      1 << 20, 0, True)
    return data, record


@pytest.fixture
def direct(tmp_path, monkeypatch):
    """O_DIRECT taken as it is at a daemon's start; skipped where tmp_path refuses it."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError as err:
        if err.errno == errno.EINVAL:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        raise
    os.unlink(tmp_path / "probe")
    monkeypatch.setattr(direct_write, "_works", True)


def _written(root, record, data) -> bytes:
    body = tier_files.seg_path(root, record.key).read_bytes()
    assert [r for r in tier_files.scan(root) if r.key == record.key] == [record]
    return body


def test_a_new_segment_file_skips_the_page_cache_and_holds_exactly_the_segment(tmp_path, direct):
    data, record = _segment(1)
    padded = data + b"\xee" * 5000           # capacity past `length`: not written
    tier_files.write_segment(tmp_path, record, memoryview(padded))
    assert _written(tmp_path, record, data) == data
    assert direct_write._works is True


def test_the_write_left_no_page_cache_behind(tmp_path, direct):
    data, record = _segment(2, chunks=40)
    tier_files.write_segment(tmp_path, record, data)
    assert _resident_bytes(tier_files.seg_path(tmp_path, record.key)) == 0
    on_disk = tier_files.seg_path(tmp_path, record.key).read_bytes()
    assert on_disk == data


def test_an_r1_segment_file_is_rewritten_through_the_page_cache(tmp_path, direct):
    data, record = _segment(3)
    path = tier_files.seg_path(tmp_path, record.key)
    path.parent.mkdir(parents=True)
    path.write_bytes(data[:1000])           # acknowledged R=1 bytes, written before the ack
    tier_files.write_segment(tmp_path, record, data)
    assert _resident_bytes(path) > 0
    assert _written(tmp_path, record, data) == data
    assert direct_write._works is True


def test_a_device_refusing_the_alignment_makes_tier_writes_fall_back(tmp_path, direct,
                                                                     monkeypatch):
    # 256-byte blocks are below this device's logical block: the kernel refuses those O_DIRECT
    # writes with EINVAL, as a device with blocks larger than BLOCK_BYTES would refuse ours.
    monkeypatch.setattr(direct_write, "BLOCK_BYTES", 256)
    monkeypatch.setattr(direct_write, "_ZEROS", bytes(256))
    data = chunk.encode(1, 0, 7, 0, [b"x"])    # padded to one 256-byte block
    assert len(data) <= 256
    record = _segment(4)[1]._replace(length=len(data), chunks=1, end_offset=1)
    tier_files.write_segment(tmp_path, record, data)
    assert direct_write._works is False
    assert _written(tmp_path, record, data) == data
    more, again = _segment(5)
    tier_files.write_segment(tmp_path, again, more)
    assert _written(tmp_path, again, more) == more


def test_bytes_an_r1_file_already_holds_are_not_written_again(tmp_path, direct):
    data, record = _segment(6)
    path = tier_files.seg_path(tmp_path, record.key)
    path.parent.mkdir(parents=True)
    kept = 3000
    path.write_bytes(b"\x5a" * kept)        # what live writes put there (a marker, to see it)
    tier_files.write_segment(tmp_path, record, data, on_file_bytes=kept)
    assert _written(tmp_path, record, data) == b"\x5a" * kept + data[kept:]


@pytest.mark.parametrize("file_bytes", [None, 1000], ids=["no-file", "shorter"])
def test_bytes_claimed_but_not_on_file_are_written(tmp_path, direct, file_bytes):
    data, record = _segment(7)
    path = tier_files.seg_path(tmp_path, record.key)
    if file_bytes is not None:
        path.parent.mkdir(parents=True)
        path.write_bytes(data[:file_bytes])
    tier_files.write_segment(tmp_path, record, data, on_file_bytes=3000)
    assert _written(tmp_path, record, data) == data
