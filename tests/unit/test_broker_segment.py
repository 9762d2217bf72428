"""Segments: one copy in, stamped in place, indexed; memory only as it is written."""

import os

import pytest

from kera import chunk
from kera.broker.segment import Segment


def make(n=5, producer=3, seq=0, sid=9, sl=1, value=b"v" * 20):
    return chunk.encode(producer, seq, sid, sl, [value] * n)


def test_append_copies_stamps_and_indexes():
    seg = Segment(None, 2, 64 * 1024)
    a, b = make(5), make(7, seq=1)
    original = bytes(a)
    i = seg.append(a, len(a), 4, 100, 5)
    j = seg.append(b, len(b), 4, 105, 7)
    assert (i, j) == (0, 1)
    assert a == original  # the caller's buffer is untouched: the stamp is on the stored copy
    assert list(seg.positions) == [0, len(a)] and list(seg.sizes) == [len(a), len(b)]
    assert list(seg.bases) == [100, 105] and list(seg.counts) == [5, 7]
    assert seg.used_bytes == len(a) + len(b)
    h = chunk.verify(seg.view(1))
    assert (h.group, h.segment, h.base_offset, h.sequence) == (4, 2, 105, 1)
    assert chunk.Chunk(seg.view(0)).values() == [b"v" * 20] * 5
    assert seg.end_offset(1) == 112


def test_fits_is_exact():
    c = make(3)
    seg = Segment(None, 0, 2 * len(c))
    assert seg.fits(len(c))
    seg.append(c, len(c), 0, 0, 3)
    assert seg.fits(len(c))
    seg.append(c, len(c), 0, 3, 3)
    assert not seg.fits(1)


def test_release_drops_the_buffer_but_keeps_the_index():
    c = make(3)
    seg = Segment(None, 0, 4096)
    seg.append(c, len(c), 0, 0, 3)
    view = seg.view(0)
    seg.release()
    assert seg.released and seg.view(0) is None
    assert len(seg) == 1 and seg.sizes[0] == len(c)
    assert bytes(view[:2]) == c[:2]  # an outstanding view stays valid


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_segments_cost_resident_memory_only_once_written():
    before = _rss_bytes()
    segs = [Segment(None, i, 8 * 1024 * 1024) for i in range(32)]  # 256 MiB of capacity
    c = make(10)
    for seg in segs:
        seg.append(c, len(c), 0, 0, 10)
    grown = _rss_bytes() - before
    assert grown < 32 * 1024 * 1024, f"RSS grew by {grown} bytes for 256 MiB of mostly empty segments"
