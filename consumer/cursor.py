"""Cursor bookkeeping of the consumer, on both of its sides. Sans-IO.

A streamlet's cursor is `low` (every group below it is finished) and the next offset of each
group from `low` up (a group missing from `offsets` starts at 0); on the wire it is the fetch
request's `{"low": g0, "offsets": {g: off}}`.

* FetchCursor — the request thread's: advanced as chunks arrive, so the next fetch continues
  after them; decides from the broker's group table when groups are finished.
* ConsumedCursor — the caller's: advanced only as the caller consumes what the request thread
  queued (chunks, then "low moved" marks, in the same order), so `positions()` is exactly what
  was consumed, never what was merely fetched.
"""

from __future__ import annotations

from typing import NamedTuple

from kera.codec.chunk import FLAG_SPARSE, Chunk, ChunkHeader, offsets_covered
from kera.errors import BadRequest, KeraError
from kera.codec.position import Position

GROUPS_MAX = 1 << 20


class GroupInfo(NamedTuple):
    """One entry of a broker's group table (`offsets` and `fetch` replies), read by the
    consumer and by the Spark connector (kera.spark.offsets)."""
    group: int
    slot: int
    start: int
    durable_end: int
    closed: bool

    @property
    def finished_at(self) -> int | None:
        """The group's final offset when it can grow no more, else None."""
        return self.durable_end if self.closed else None


def parse_groups(groups) -> list[GroupInfo]:
    """Validate a broker's `[[g, slot, start, durable_end, closed], ...]` table."""
    if not isinstance(groups, list) or len(groups) > GROUPS_MAX:
        raise BadRequest("groups must be a list")
    out = []
    for entry in groups:
        if (not isinstance(entry, list) or len(entry) != 5 or not isinstance(entry[4], bool)
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry[:4])
                or entry[2] > entry[3]):
            raise BadRequest(f"malformed group entry {entry!r}")
        out.append(GroupInfo(*entry))
    return out


class FetchCursor:
    __slots__ = ("streamlet", "low", "offsets", "earliest", "epoch")

    def __init__(self, streamlet: int, low: int = 0, offsets: dict[int, int] | None = None,
                 earliest: bool = False, epoch: int | None = None):
        self.streamlet = streamlet
        # The streamlet history the cursor points into; None until the broker names it.
        self.epoch = epoch
        self.low = low
        self.offsets = {g: o for g, o in (offsets or {}).items() if g >= low}
        # start="earliest": until the broker's first group table, ask it to begin at its first
        # retained group (groups below were deleted by retention) instead of refusing `low`.
        self.earliest = earliest

    def wire(self) -> dict:
        out = {"low": self.low, "offsets": dict(self.offsets)}
        if self.earliest:
            out["earliest"] = True
        if self.epoch is not None:
            out["epoch"] = self.epoch
        return out

    def on_chunk(self, header: ChunkHeader, chunk: Chunk | None = None) -> int | None:
        """A fetched chunk: returns how many of its leading records lie before the cursor (to
        skip), or None when none of it is new (a stale or repeated chunk). A compacted chunk
        (docs/COMPACTION.md) ends at its span, past records it no longer holds, and which of
        its records lie before the cursor only the `chunk` itself tells."""
        g = header.group
        if g < self.low:
            return None
        cur = self.offsets.get(g, 0)
        base = header.base_offset
        end = base + offsets_covered(header)
        if end <= cur:
            return None
        self.offsets[g] = end
        if cur <= base:
            return 0
        if header.flags & FLAG_SPARSE:
            assert chunk is not None, "a compacted chunk's records are numbered by its deltas"
            return chunk.records_below(cur - base)
        return cur - base

    def on_groups(self, groups: list[GroupInfo]) -> int | None:
        """Apply the broker's group table; returns the new `low` when finished groups let it
        move up, else None. A group is finished when it is closed and read to its end."""
        table = {gi.group: gi for gi in groups}
        low = self.low
        if self.earliest and table:
            # The broker began at its first retained group: the groups below it are gone.
            self.earliest = False
            low = max(low, min(table))
        while True:
            gi = table.get(low)
            if gi is None or not gi.closed or self.offsets.get(low, 0) < gi.durable_end:
                break
            low += 1
        if low == self.low:
            return None
        self.low = low
        self.offsets = {g: o for g, o in self.offsets.items() if g >= low}
        return low

    @classmethod
    def at_end(cls, streamlet: int, groups: list[GroupInfo], first_group: int = 0) -> "FetchCursor":
        """A cursor at the durable end of every group (start="latest"); `first_group`: the
        broker's first retained group (the `offsets` reply's)."""
        low = first_group

        for gi in sorted(groups):
            if gi.closed and gi.group == low:
                low += 1
        return cls(streamlet, low, {gi.group: gi.durable_end for gi in groups})


class ChunkItem:
    """A fetched chunk of `part` = (stream name, streamlet) in the consumer's cache: its records
    from index `skip` on are to be delivered; `first` is the offset of the first of them (`end`
    when none is left) and `end` the offset after the chunk. A compacted chunk's records lie at
    its offset deltas (`offset_at`): ordinary ones, at `first + i`, need no lookup."""
    __slots__ = ("part", "stream", "streamlet", "group", "first", "skip", "chunk", "end", "epoch",
                 "count", "sparse")

    def __init__(self, part: tuple, chunk: Chunk, skip: int, epoch: int | None = None):
        h = chunk.header
        self.part = part
        self.stream, self.streamlet = part
        self.epoch = epoch
        self.group = h.group
        self.skip = skip
        self.chunk = chunk
        self.count = h.record_count - skip   # records to deliver
        self.sparse = bool(h.flags & FLAG_SPARSE)
        self.end = h.base_offset + offsets_covered(h)
        self.first = self.offset_at(0) if self.sparse else h.base_offset + skip

    def offset_at(self, i: int) -> int:
        """The offset of the i-th record to deliver (0 <= i <= count; `end` past the last)."""
        if i >= self.count:
            return self.end
        if not self.sparse:
            return self.first + i
        return self.chunk.header.base_offset + int(self.chunk.offset_deltas[self.skip + i])

    def offsets(self):
        """The offsets of the records to deliver: a range, or a list for a compacted chunk."""
        if not self.sparse:
            return range(self.first, self.end)
        return (self.chunk.header.base_offset + self.chunk.record_offsets()[self.skip:]).tolist()

    def numbers(self):
        """Their record numbers, as `offsets()`; None for data written before numbers."""
        first = self.chunk.first_number
        if first is None:
            return None
        if not self.sparse:
            return range(first + self.skip, first + self.skip + self.count)
        return (first + self.chunk.record_offsets()[self.skip:]).tolist()


class LowItem(NamedTuple):
    """Every group of `part` (stream, streamlet) below `low` is finished (once what precedes
    is consumed)."""
    part: tuple
    low: int


class ErrorItem(NamedTuple):
    error: KeraError


class ResetItem(NamedTuple):
    """The streamlet's position was lost (`on_lost_position`): the caller's cursor restarts
    at (low, offsets) of the new history `epoch`, after what precedes is consumed. `part`:
    (stream, streamlet)."""
    part: tuple
    low: int
    offsets: dict
    epoch: int | None


class ConsumedCursor:
    __slots__ = ("streamlet", "low", "offsets", "epoch")

    def __init__(self, streamlet: int, low: int = 0, offsets: dict[int, int] | None = None,
                 epoch: int | None = None):
        self.streamlet = streamlet
        self.low = low
        self.offsets = {g: o for g, o in (offsets or {}).items() if g >= low}
        self.epoch = epoch

    def consumed(self, group: int, next_offset: int, epoch: int | None = None) -> None:
        if epoch is not None:
            self.epoch = epoch
        if group >= self.low:
            self.offsets[group] = next_offset

    def finished_below(self, low: int) -> None:
        if low > self.low:
            self.low = low
            self.offsets = {g: o for g, o in self.offsets.items() if g >= low}

    def positions(self, stream: str, partial: tuple[int, int] | None = None) -> list[Position]:
        """Every group from `low` up to the highest one seen; `partial` = (group, next
        offset) of a chunk the caller is part way through."""
        offsets = self.offsets
        if partial is not None and partial[0] >= self.low:
            offsets = dict(offsets)
            offsets[partial[0]] = partial[1]
        top = max(offsets, default=self.low)
        return [Position(stream, self.streamlet, g, offsets.get(g, 0), self.epoch)
                for g in range(self.low, top + 1)]


def cursors_from_positions(positions: list[Position], stream: str) -> dict[int, tuple[int, dict[int, int]]]:
    """{streamlet: (low, {group: offset})} from positions() output; raises BadRequest on a
    position of another stream."""
    return {sl: (low, offsets) for sl, (low, offsets, _) in
            cursors_with_epochs(positions, stream).items()}


def cursors_with_epochs(positions: list[Position], stream: str) -> dict[int, tuple[int, dict, int | None]]:
    """{streamlet: (low, {group: offset}, epoch)}; positions of one streamlet must agree on
    the epoch (None: saved by code that predates epochs, not checked by the broker)."""
    out: dict[int, tuple[int, dict[int, int], int | None]] = {}
    for p in positions:
        p = Position(*p)
        if p.stream != stream:
            raise BadRequest(f"position {p} is not in stream '{stream}'")
        if p.streamlet < 0 or p.group < 0 or p.offset < 0:
            raise BadRequest(f"position {p} is negative")
        if p.epoch is not None and (not isinstance(p.epoch, int) or p.epoch < 0):
            raise BadRequest(f"position {p} has a bad epoch")
        low, offsets, epoch = out.get(p.streamlet, (p.group, {}, p.epoch))
        if epoch != p.epoch:
            raise BadRequest(f"positions of streamlet {p.streamlet} name two histories "
                             f"(epochs {epoch} and {p.epoch})")
        offsets[p.group] = p.offset
        out[p.streamlet] = (min(low, p.group), offsets, epoch)
    return out
