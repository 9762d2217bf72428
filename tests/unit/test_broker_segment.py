"""Segments: one copy in, stamped in place, indexed; memory only as it is written."""

import ctypes
import errno
import mmap
import os

import pytest

from kera.codec import chunk
from kera.broker import segment as segment_module
from kera.broker.segment import Segment
from kera.broker.segment_pool import SegmentPool


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


def _mapping_rss_bytes(buf) -> int:
    """Resident bytes of the mapping that holds `buf` (an mmap), from /proc/self/smaps."""
    view = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(view)
    del view   # the export would pin the buffer
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_a_fresh_segment_is_populated_ahead_of_its_writes_within_what_it_holds():
    """Pages are faulted in a window at a time (one madvise), ahead of the copy; the window is
    never larger than what the segment already holds, nor POPULATE_AHEAD_MAX_BYTES."""
    page = mmap.PAGESIZE
    seg = Segment(None, 0, 8 * 1024 * 1024)
    c = make(180, value=b"v" * 20)                       # ~4.5 KiB: not page-aligned
    seg.append(c, len(c), 0, 0, 180)
    assert seg.populated_bytes == -(-len(c) // page) * page   # nothing written yet: no window
    windows = 0
    for i in range(1, 400):
        before = seg.populated_bytes
        seg.append(c, len(c), 0, 180 * i, 180)
        assert seg.used_bytes <= seg.populated_bytes <= max(
            2 * seg.used_bytes, seg.used_bytes + segment_module.POPULATE_AHEAD_MAX_BYTES) + 2 * page
        assert seg.populated_bytes % page == 0
        if seg.populated_bytes != before and segment_module._populate_works:
            # Linux 5.14+: the whole window is resident before anything is written into it
            assert _mapping_rss_bytes(seg.memory) >= seg.populated_bytes > seg.used_bytes + page
            windows += 1
    assert windows >= 5 or not segment_module._populate_works
    assert chunk.Chunk(seg.view(399)).values() == [b"v" * 20] * 180


def test_a_kernel_that_refuses_to_populate_leaves_the_copy_to_fault_pages(monkeypatch):
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(segment_module, "_populate_works", True)
    monkeypatch.setattr(segment_module, "anonymous_buffer",
                        lambda size: Refusing(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    seg = Segment(None, 0, 1024 * 1024)
    c = make(10)
    seg.append(c, len(c), 0, 0, 10)
    seg.append(c, len(c), 0, 10, 10)
    assert segment_module._populate_works is False       # asked once, then never again
    assert chunk.Chunk(seg.view(1)).values() == [b"v" * 20] * 10


def test_a_reused_buffer_is_not_populated_again():
    pool = SegmentPool(16 * 1024 * 1024)
    first = Segment(None, 0, 1024 * 1024, pool)
    c = make(10)
    first.append(c, len(c), 0, 0, 10)
    assert first.populated_bytes < first.capacity_bytes
    first.drop_memory()
    again = Segment(None, 1, 1024 * 1024, pool)
    assert pool.reused == 1 and again.populated_bytes == again.capacity_bytes
    again.append(c, len(c), 0, 0, 10)
    assert chunk.Chunk(again.view(0)).values() == [b"v" * 20] * 10
