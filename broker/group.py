"""A group: a fixed-size sub-partition of a streamlet, up to G segments of whole chunks.

Record offsets are dense from 0 within a group, and its records' numbers continue the previous
group of its slot (kera.broker.streamlet): record `offset` is number `number_base + offset`.
The group has two heads: `head` (records appended) and `durable` (records stored on every copy
the stream asks for); readers never see past `durable`. A chunk that does not fit the last
segment of a full group closes the group.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from bisect import bisect_right

from kera.broker.segment import Segment

_tiebreak = itertools.count()  # orders waiters with equal offsets without comparing them


class _Read:
    """What one `Group.read` has taken so far, and its bounds."""
    __slots__ = ("limit", "max_bytes", "at_least_one", "max_frames", "frames", "total", "chunks")

    def __init__(self, limit: int, max_bytes: int, at_least_one: bool, max_frames: int):
        self.limit = limit                    # the durable head: nothing at or past it
        self.max_bytes = max_bytes
        self.at_least_one = at_least_one
        self.max_frames = max_frames
        self.frames: list = []
        self.total = 0
        self.chunks = 0

    def segment(self, seg: Segment, ci: int) -> bool:
        """Take chunks `ci`.. of `seg`; False once a bound stopped the read."""
        if seg.tier is None and seg.mv is not None:
            return self._in_memory(seg, ci)
        return self._checked(seg, ci)

    def _room(self, size: int) -> bool:
        """The chunk fits the byte budget, or it is the one chunk a read must return."""
        return self.total + size <= self.max_bytes or (self.at_least_one and not self.chunks)

    def _in_memory(self, seg: Segment, ci: int) -> bool:
        bases, sizes = seg.bases, seg.sizes
        first, n, run = ci, len(bases), 0
        more = True
        while ci < n:
            size = sizes[ci]
            if bases[ci] >= self.limit or not self._room(size):
                more = False
                break
            run += size
            self.total += size
            self.chunks += 1
            ci += 1
        if run:
            pos = seg.positions[first]
            self.frames.append(seg.mv[pos:pos + run])
        return more and len(self.frames) < self.max_frames

    def _checked(self, seg: Segment, ci: int) -> bool:
        bases, sizes = seg.bases, seg.sizes
        while ci < len(bases):
            size = sizes[ci]
            if bases[ci] >= self.limit or not self._room(size) \
                    or len(self.frames) >= self.max_frames:
                return False
            view = seg.view(ci)
            if view is None:
                err = seg.read_error(ci)   # a damaged chunk on disk: say so, do not loop
                if err is not None and not self.frames:
                    raise err
                return False
            self.frames.append(view)
            self.total += size
            self.chunks += 1
            ci += 1
        return len(self.frames) < self.max_frames


class Group:
    __slots__ = ("id", "slot", "max_segments", "segment_size_bytes", "segments", "seg_bases",
                 "head", "durable", "closed", "vlog", "waiters", "stream_id", "streamlet",
                 "created_ms", "last_ms", "time_index", "number_base", "pool")

    def __init__(self, group_id: int, slot: int, max_segments: int, segment_size_bytes: int,
                 stream_id: int = 0, streamlet: int = 0):
        self.id = group_id
        self.slot = slot
        self.max_segments = max_segments
        self.segment_size_bytes = segment_size_bytes
        self.stream_id = stream_id
        self.streamlet = streamlet
        self.segments: list[Segment] = []
        self.seg_bases = array("Q")   # first record offset of each segment, for bisect
        self.head = 0                 # records appended
        self.durable = 0              # records durable (<= head)
        self.closed = False
        self.vlog = None              # the VirtualLog replicating this group (None: R=1)
        # (end_offset, tiebreak, waiter): produce requests waiting for records to be durable.
        self.waiters: list = []
        # Broker wall clock (ms) at the group's first and latest append: retention and the
        # time-based close of idle active groups use them (kera.broker.retention).
        self.created_ms = 0
        self.last_ms = 0
        # Seeking by time (kera.broker.time_index.GroupTimeIndex), built on the first query.
        self.time_index = None
        # The record number of offset 0 in the slot's dense numbering; None when unknown (a
        # placeholder, or data written before record numbers): its chunks keep what they carry.
        self.number_base: int | None = None
        # Where new segments take their memory from (kera.broker.segment_pool); None: fresh.
        self.pool = None


    # ------------------------------------------------------------------ append
    def append(self, chunk, size: int, count: int) -> tuple[Segment, int] | None:
        """Store a verified chunk; returns (segment, index in segment), or None when the group
        is full: it is then closed and the chunk belongs in a new group."""
        assert not self.closed, "append to a closed group"
        assert size <= self.segment_size_bytes, "chunk larger than a segment"
        seg = self.segments[-1] if self.segments else None
        if seg is None or not seg.fits(size):
            if len(self.segments) >= self.max_segments:
                self.closed = True
                return None
            seg = Segment(self, len(self.segments), self.segment_size_bytes, self.pool)
            self.segments.append(seg)
            self.seg_bases.append(self.head)
        base = self.number_base
        index = seg.append(chunk, size, self.id, self.head, count,
                           None if base is None else base + self.head)
        self.head += count
        return seg, index

    # ------------------------------------------------------------------ durability
    def set_durable(self, end_offset: int) -> list:
        """Records below `end_offset` are durable; returns the waiters that are now satisfied."""
        assert end_offset <= self.head, "durable head passes the head"
        if end_offset > self.durable:
            self.durable = end_offset
        done = []
        waiters = self.waiters
        while waiters and waiters[0][0] <= self.durable:
            done.append(heapq.heappop(waiters)[2])
        return done

    def wait(self, end_offset: int, waiter) -> bool:
        """Register `waiter` for records below `end_offset`; False if they already are durable."""
        if end_offset <= self.durable:
            return False
        heapq.heappush(self.waiters, (end_offset, next(_tiebreak), waiter))
        return True

    def take_waiters(self) -> list:
        waiters = [w[2] for w in self.waiters]
        self.waiters.clear()
        return waiters

    @property
    def finished(self) -> bool:
        """Closed and wholly durable: nothing more will ever be readable in it."""
        return self.closed and self.durable == self.head

    def durable_bytes_from(self, offset: int) -> int:
        """Bytes of the durable chunks holding records at or past `offset` (the chunk a reader
        is inside counts whole): a reader's lag in bytes. O(segments), not O(chunks)."""
        if offset >= self.durable:
            return 0
        si, ci = self.locate(offset)
        # The durable head is a chunk boundary: chunks from the one at `durable` on are not.
        end = self.locate(self.durable) if self.durable < self.head else None
        total = 0
        for n in range(si, len(self.segments)):
            seg = self.segments[n]
            start = seg.positions[ci] if n == si else 0
            if end is not None and n == end[0]:
                return total + seg.positions[end[1]] - start
            total += seg.used_bytes - start
        return total

    def describe(self) -> list:
        """`[g, slot, start, durable_end, closed]` as in the protocol. `closed` is reported only
        once every record is durable, so a reader at `durable_end` of a closed group really is
        at its end."""
        return [self.id, self.slot, 0, self.durable, self.finished]

    # ------------------------------------------------------------------ read
    def locate(self, offset: int) -> tuple[int, int] | None:
        """(segment number, chunk index) of the chunk holding record `offset`."""
        if offset >= self.head or not self.segments:
            return None
        si = bisect_right(self.seg_bases, offset) - 1
        seg = self.segments[si]
        return si, bisect_right(seg.bases, offset) - 1

    def read(self, offset: int, max_bytes: int, at_least_one: bool,
             max_frames: int) -> tuple[list, int, int]:
        """Whole durable chunks from the one holding `offset` on, up to `max_bytes` (one chunk
        over the budget when `at_least_one`) in at most `max_frames` views; returns (views,
        bytes, chunks). The chunks of a segment in memory are back to back, so they go as one
        view (a frame then holds several whole chunks, as readers expect: zmq's cost is per
        frame, ~10 us, more than a 4 KiB chunk's copy); those of a file, each checked as read,
        one view each. Raises the chunk's error (not_ready, corrupt_chunk) when the first one
        is a damaged chunk of a segment file."""
        limit = self.durable
        if offset >= limit or max_frames < 1:
            return [], 0, 0
        si, ci = self.locate(offset)
        read = _Read(limit, max_bytes, at_least_one, max_frames)
        for seg in self.segments[si:]:
            if not read.segment(seg, ci):
                break
            ci = 0
        return read.frames, read.total, read.chunks

    def iter_chunks_reversed(self):
        """(segment, index) of every chunk, newest first (used by rare recovery scans)."""
        for seg in reversed(self.segments):
            for i in range(len(seg) - 1, -1, -1):
                yield seg, i

    def release(self) -> None:
        for seg in self.segments:
            seg.release()
