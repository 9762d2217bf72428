"""Seeking by time: in each group, the first record whose timestamp is at or after T.

Semantics are Kafka's offsetsForTimes: for each group, the *earliest offset* whose record
timestamp is >= T. Records are not timestamp-ordered (producers stamp them, clocks differ, a
producer may send old times), so "earliest offset" is not "smallest timestamp >= T": a later
record with a timestamp < T is still read after the returned position, as in Kafka.

Index: per group, the running maximum of the record timestamps over its chunks, one i64 per
chunk in append order (Kafka's time index holds the same "max timestamp so far"). The running
maximum never decreases, so a binary search finds the first chunk holding any record >= T
exactly, whatever the order of the timestamps: every chunk before it has only records < T.
Inside that chunk a scan of its timestamp column finds the record. No bounded scan is needed
and the answer is exact.

Only durable chunks are indexed (readers never see past `durable`, a chunk boundary). The index
is built lazily, on the first query of a group, and extended by later queries to the chunks
appended since: the append path pays nothing (a compressed chunk's timestamps need
decompressing). It is derived from the stored chunks alone, so a group reloaded from disk or
rebuilt by recovery (a new Group object) rebuilds it on its next query. Its memory is 8 bytes per
chunk, bounded by the group's size (G segments of whole chunks).

Building is bounded per request (INDEX_*_PER_REQUEST_MAX): the broker's loop serves nothing
else while it runs, so a request that would index more answers `not_ready` (retriable) once the
budget is spent, keeping what it indexed; the client's retry goes on from there.

A group with no durable record >= T answers its durable end: reading from there gets the
records appended later. Kafka returns null for a time after the last record; kera returns the
end, so the answer is always a position to read from.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right

import numpy as np

from kera.codec.chunk import Chunk
from kera.errors import NotReady


# Indexing work one request may do before it answers not_ready: chunks whose timestamps it reads
# (measured 13 µs a chunk of 100 records: a plain chunk's column is read in place, 53 ms for
# 4096) and stored bytes it touches (a compressed chunk is decompressed whole: measured 0.2 ms
# per plain MiB with zstd, 0.5 with lz4, on very compressible data; ~1 ms is a safe guess). At
# most about 0.1 s of the broker's loop per request.
INDEX_CHUNKS_PER_REQUEST_MAX = 4096
INDEX_BYTES_PER_REQUEST_MAX = 64 * 1024 * 1024


class IndexBudget:
    """What is left of one request's indexing work."""

    __slots__ = ("chunks", "bytes")

    def __init__(self, chunks: int = INDEX_CHUNKS_PER_REQUEST_MAX,
                 nbytes: int = INDEX_BYTES_PER_REQUEST_MAX):
        self.chunks = chunks
        self.bytes = nbytes

    def take(self, size: int) -> None:
        """Spend one chunk of `size` bytes; NotReady once nothing is left."""
        if self.chunks <= 0 or self.bytes <= 0:
            raise NotReady("the broker is building this streamlet's time index (bounded work "
                           "per request); ask again, it goes on where it stopped")
        self.chunks -= 1
        self.bytes -= size


class GroupTimeIndex:
    """The running maximum timestamp (µs) of a group's durable chunks, in append order."""

    __slots__ = ("running_max_us", "seg_starts", "next_seg", "next_chunk")

    def __init__(self):
        self.running_max_us = array("q")   # one per indexed chunk, never decreasing
        self.seg_starts = array("Q")       # index in running_max_us of each segment's first chunk
        self.next_seg = 0                  # (segment, chunk) of the first chunk not yet indexed
        self.next_chunk = 0

    def extend(self, group, budget: IndexBudget) -> None:
        """Index the durable chunks appended since the last call, within `budget`."""
        segments, limit = group.segments, group.durable
        top = self.running_max_us[-1] if self.running_max_us else -2**63
        while self.next_seg < len(segments):
            seg = segments[self.next_seg]
            if self.next_chunk == 0 and len(self.seg_starts) == self.next_seg:
                self.seg_starts.append(len(self.running_max_us))
            while self.next_chunk < len(seg) and seg.bases[self.next_chunk] < limit:
                budget.take(seg.sizes[self.next_chunk])
                top = max(top, int(chunk_timestamps_us(seg, self.next_chunk).max(initial=top)))
                self.running_max_us.append(top)
                self.next_chunk += 1
            if self.next_chunk < len(seg) or self.next_seg == len(segments) - 1:
                return   # stopped at the durable head, or this segment may still grow
            self.next_seg += 1
            self.next_chunk = 0

    def stale(self, group) -> bool:
        """The group lost chunks this index covers (only a group under recovery is cut)."""
        segments = group.segments
        if self.next_seg >= len(segments):
            return self.next_seg > len(segments) or self.next_chunk > 0
        return self.next_chunk > len(segments[self.next_seg])

    def first_chunk_at(self, timestamp_us: int) -> tuple[int, int] | None:
        """(segment, chunk) of the first indexed chunk holding a record >= `timestamp_us`."""
        n = bisect_left(self.running_max_us, timestamp_us)
        if n == len(self.running_max_us):
            return None
        si = bisect_right(self.seg_starts, n) - 1
        return si, n - self.seg_starts[si]


def chunk_timestamps_us(seg, index: int) -> np.ndarray:
    """The timestamp column of stored chunk `index` of `seg` (verified when appended)."""
    return stored_chunk(seg, index).timestamps


def stored_chunk(seg, index: int) -> Chunk:
    """Stored chunk `index` of `seg` (verified when appended)."""
    view = seg.view(index)
    if view is None:
        err = seg.read_error(index)
        raise err if err is not None else NotReady(
            "a chunk of this streamlet is no longer in memory (its stream is being deleted)")
    return Chunk(view, check=False)


def record_at_or_after(group, offset: int) -> tuple[int, int] | None:
    """(offset, timestamp µs) of the first durable record of `group` at or after `offset`: the
    record itself, or past the gaps of a compacted range (docs/COMPACTION.md); None when the
    group holds none there."""
    loc = group.locate(offset)
    if loc is None:
        return None
    si, ci = loc
    for seg in group.segments[si:]:
        for i in range(ci, len(seg)):
            if seg.bases[i] >= group.durable:
                return None
            c = stored_chunk(seg, i)
            offsets = seg.bases[i] + c.record_offsets()
            k = int(np.searchsorted(offsets, offset))
            if k < len(c):
                return int(offsets[k]), int(c.timestamps[k])
        ci = 0
    return None


def group_offset_at(group, timestamp_us: int, budget: IndexBudget) -> int:
    """The first offset of `group` whose record timestamp is >= `timestamp_us`, or its durable
    end when no durable record is. NotReady when `budget` runs out first."""
    index = group.time_index
    if index is None or index.stale(group):
        index = group.time_index = GroupTimeIndex()
    index.extend(group, budget)
    found = index.first_chunk_at(timestamp_us)
    if found is None:
        return group.durable
    seg = group.segments[found[0]]
    c = stored_chunk(seg, found[1])
    i = int(np.argmax(c.timestamps >= timestamp_us))
    deltas = c.offset_deltas   # a compacted chunk's record i is not offset i
    return seg.bases[found[1]] + (i if deltas is None else int(deltas[i]))


def streamlet_cursor_at(streamlet, timestamp_us: int,
                        budget: IndexBudget | None = None) -> tuple[int, dict[int, int]]:
    """(low, offsets), a reader's cursor (as in a fetch read) at the first record >= T of every
    retained group: groups below `low` are finished and wholly before T; groups missing from
    `offsets` start at 0. No group at all: (first_group, {}). NotReady when indexing the
    groups takes more than `budget` (default: one request's)."""
    budget = IndexBudget() if budget is None else budget
    low = None
    offsets: dict[int, int] = {}
    for group in streamlet.groups:
        off = group_offset_at(group, timestamp_us, budget)
        if low is None and group.finished and off >= group.head:
            continue   # wholly before T and never to grow: below the cursor
        if low is None:
            low = group.id
        if off:
            offsets[group.id] = off
    if low is None:
        low = streamlet.first_group + len(streamlet.groups)
    return low, offsets
