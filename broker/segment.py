"""A segment: one fixed-capacity in-memory buffer holding whole chunks of one group, back to back.

The buffer is an anonymous mmap, so a segment costs address space when opened and resident
memory only as chunks are written into it (the kernel hands out zero pages lazily). Each chunk
is copied in once and stamped in place; the per-chunk index lives in compact arrays, never in a
Python object per chunk.
"""

from __future__ import annotations

import logging
import mmap
from array import array

from kera.codec.chunk import stamp

_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
# madvise(MADV_POPULATE_WRITE) (Linux 5.14; Python 3.11's mmap does not name it): fault a range
# in with one call instead of one trap per 4 KiB page. Copying chunks into fresh memory
# measured 2.1 us per 4 KiB chunk populated ahead against 3.1-3.6 us faulted page by page, and
# 31-34 us against 45 us per 64 KiB chunk (issue 15; bench/test_segment_memory.py).
MADV_POPULATE_WRITE = 23
# How far ahead of its writes a segment is populated at most. The window grows with what the
# segment holds (never more than that again), so a segment that receives little stays small:
# thousands of quiet streams must not each make 1 MiB resident.
POPULATE_AHEAD_MAX_BYTES = 1 << 20
_PAGE_BYTES = mmap.PAGESIZE
_populate_works = True    # False once the kernel refused (older than 5.14): fault page by page

log = logging.getLogger(__name__)


def anonymous_buffer(size: int) -> mmap.mmap:
    """Zero-filled memory that costs RSS only as it is written.

    Private, not the default shared mapping, whose page faults cost more. No transparent huge
    pages: on this project's machine (a VM whose balloon returns freed 2 MiB blocks to its
    host) a huge-page fault takes a block the host must fault in again 4 KiB at a time, and
    measured copying 64 KiB chunks into fresh segments: 110-165 us per chunk with huge pages,
    45 us with plain pages (9 us with huge pages only when the blocks happened to be warm).
    Reused memory costs 2 us, hence the pool (kera.broker.segment_pool)."""
    return mmap.mmap(-1, size, flags=_PRIVATE)


class Segment:
    __slots__ = ("group", "number", "capacity_bytes", "buf", "mv", "used_bytes", "positions",
                 "sizes", "bases", "counts", "tier", "memory", "pool", "populated_bytes")

    def __init__(self, group, number: int, capacity_bytes: int, pool=None):
        self.group = group                  # the owning Group (None in tests that need none)
        self.number = number                # index of this segment inside its group
        self.capacity_bytes = capacity_bytes
        # The anonymous buffer the segment owns until it leaves memory (`drop_memory`), taken
        # from and given back to `pool` (kera.broker.segment_pool.SegmentPool) when it has one.
        self.pool = pool
        memory, reused = ((anonymous_buffer(capacity_bytes), False) if pool is None
                          else pool.take_telling_reuse(capacity_bytes))
        self.memory: mmap.mmap | None = memory
        self.buf: mmap.mmap | None = self.memory
        self.mv: memoryview | None = memoryview(self.buf)
        self.used_bytes = 0
        # The buffer's first bytes known to be faulted in: all of a reused one.
        self.populated_bytes = capacity_bytes if reused else 0
        # One entry per chunk, in append order. u32 positions/sizes: a segment is at most
        # 1 GiB (the coordinator's bound); u64 record offsets.
        self.positions = array("I")
        self.sizes = array("I")
        self.bases = array("Q")             # record offset (in the group) of the chunk's first record
        self.counts = array("I")            # records in the chunk
        # Set once the segment was written to the broker's disk and dropped from memory
        # (kera.broker.tier): `buf`/`mv` are then None, or a read-only map of the file while
        # the tier keeps it mapped.
        self.tier = None

    def __len__(self) -> int:
        return len(self.positions)

    def fits(self, size: int) -> bool:
        return self.used_bytes + size <= self.capacity_bytes

    def append(self, chunk, size: int, group_id: int, base_offset: int, count: int,
               number: int | None = None) -> int:
        """Copy a verified chunk of `size` bytes in, stamp it (with the record `number` of its
        first record, when known), index it; returns its index. The caller checked `fits`."""
        pos = self.used_bytes
        end = pos + size
        assert end <= self.capacity_bytes, "chunk overflows its segment"
        if end > self.populated_bytes:
            self._populate(end)
        view = self.mv[pos:end]
        view[:] = chunk
        stamp(view, group_id, self.number, base_offset, number)
        self.used_bytes = end
        self.positions.append(pos)
        self.sizes.append(size)
        self.bases.append(base_offset)
        self.counts.append(count)
        return len(self.positions) - 1

    def _populate(self, end: int) -> None:
        """Fault in the buffer up to `end` and a window beyond it (as large as what is already
        written, at most POPULATE_AHEAD_MAX_BYTES) with one madvise call."""
        global _populate_works
        start = self.populated_bytes
        ahead = min(POPULATE_AHEAD_MAX_BYTES, max(start, _PAGE_BYTES))
        stop = -(-max(end, start + ahead) // _PAGE_BYTES) * _PAGE_BYTES   # whole pages
        stop = min(stop, self.capacity_bytes)
        self.populated_bytes = stop
        if _populate_works and ahead:
            try:
                self.memory.madvise(MADV_POPULATE_WRITE, start, stop - start)
            except OSError as err:   # EINVAL before Linux 5.14: the copy faults the pages
                _populate_works = False
                log.info("segments fault their pages one by one: madvise(MADV_POPULATE_WRITE) "
                         "refused (%s)", err)

    def view(self, index: int) -> memoryview | None:
        """The stored bytes of chunk `index` (no copy); None once the segment is released."""
        mv = self.mv
        if mv is None:
            mv = self.mapped()
            if mv is None:
                return None
        pos = self.positions[index]
        view = mv[pos:pos + self.sizes[index]]
        tier = self.tier
        if tier is not None and not tier.good(self, index, view):
            return tier.repaired.get(index)   # a damaged chunk: its replica's copy, or None
        return view

    def read_error(self, index: int):
        """Why `view(index)` gave None for a damaged chunk (kera.broker.tier.TierFile.error)."""
        return None if self.tier is None else self.tier.error(self, index)

    def end_offset(self, index: int) -> int:
        """Record offset just past chunk `index`."""
        return self.bases[index] + self.counts[index]

    def mapped(self) -> memoryview | None:
        """The segment's bytes: in memory, or mapped from its file on disk (tiered); None once
        released (or when its file cannot be read)."""
        mv = self.mv
        if mv is None and self.tier is not None:
            mv = self.tier.map(self)
        return mv

    @property
    def released(self) -> bool:
        return self.mv is None and self.tier is None

    def drop_memory(self) -> None:
        """Let the in-memory bytes go (written to disk, or deleted): to the pool, which reuses
        them once the last outstanding view (e.g. a frame zmq is still sending) is gone, or to
        the system then."""
        self.mv = None
        self.buf = None
        memory, self.memory = self.memory, None
        if memory is not None and self.pool is not None:
            self.pool.give(memory)

    def release(self) -> None:
        """Drop the buffer (its group or stream was deleted). The index stays, so accounting
        that walks old references keeps working."""
        self.drop_memory()
        self.tier = None

