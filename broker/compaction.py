"""Compaction's decisions, sans-IO: which records of a compacted streamlet survive a pass, how
the survivors are cut into chunks that keep their record numbers, and when a streamlet is due.

docs/COMPACTION.md has the design; this module is its pure core, with no segment, clock or
thread: records, numbers and milliseconds in, records and plans out. The rules are Kafka's
log cleaner's:

- A pass reads the streamlet's *dirty* records (appended since the last pass, up to the
  `dirty_end` that min.compaction.lag.ms allows) into a map key -> number of its latest record
  (`OffsetMap`). Its memory is bounded (`OFFSET_MAP_BYTES_MAX`): when full, the dirty range
  ends at the record that did not fit, and the next pass goes on from there.
- Every record below the dirty end is then kept iff no later record of its key is in the map
  (`survives`): a record of the clean part whose key the dirty part never wrote is already the
  latest of its key, since earlier passes kept nothing else.
- A tombstone (null value) is the latest record of a deleted key. It survives the pass that
  first reaches it, which stamps it `cleaned_ms`, and every later pass until
  `delete.retention.ms` after that, so a reader that is behind by less still sees the delete
  (KIP-534's delete horizon). Then it goes, and the key with it.
- Records without a key are never appended to a compacted stream (kera.broker.core refuses
  them); ones written before the policy became `compact` are removed, as Kafka's cleaner does.
- Record numbers never change: survivors are cut into `Piece`s, each covering a contiguous
  range of numbers (its span) of which it holds some, so the numbers between are gaps; a range
  where nothing survives is a piece with no record, so every number stays inside one piece.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

# Memory of one pass's offset map: each key's bytes plus what a Python dict entry and an int
# cost (measured ~100 bytes on CPython 3.11 for small keys). 64 MiB maps about 500,000
# 32-byte keys per pass, which is Kafka's default cleaner buffer (128 MiB for 2 threads).
OFFSET_MAP_BYTES_MAX = 64 * 1024 * 1024
OFFSET_MAP_ENTRY_OVERHEAD_BYTES = 100
# One compacted chunk holds at most this many bytes of record data (keys, values, headers):
# the producers' default chunk size, so compacted chunks read and replicate like produced ones.
PIECE_BYTES_MAX = 16 * 1024
# Bytes a record costs in a chunk besides its key, value and headers: its timestamp (8), value
# and key offsets (4 + 4), key and value null flags (1 + 1), header index (4), number delta (4).
RECORD_OVERHEAD_BYTES = 26


class Record(NamedTuple):
    """One record as compaction sees it. `cleaned_ms`: when a pass first kept it (None: dirty,
    no pass reached it yet); tombstones are timed from it."""
    number: int
    key: bytes | None
    value: bytes | None            # None: a tombstone
    timestamp_us: int
    headers: tuple = ()
    cleaned_ms: int | None = None

    def size(self) -> int:
        """Bytes it takes in a chunk (for cutting pieces and counting bytes)."""
        return (RECORD_OVERHEAD_BYTES + len(self.key or b"") + len(self.value or b"")
                + sum(len(k) + len(v or b"") + 8 for k, v in self.headers))


class Piece(NamedTuple):
    """A compacted chunk to be: numbers `first` .. `first + span - 1`, holding `records` (some of
    those numbers, ascending; the others are gaps)."""
    first: int
    span: int
    records: tuple


class OffsetMap:
    """Key -> number of its latest dirty record, in bounded memory (OFFSET_MAP_BYTES_MAX)."""
    __slots__ = ("latest", "bytes", "bytes_max")

    def __init__(self, bytes_max: int = OFFSET_MAP_BYTES_MAX):
        self.latest: dict[bytes, int] = {}
        self.bytes = 0
        self.bytes_max = bytes_max

    def add(self, records: Iterable[Record]) -> int | None:
        """Map the records (ascending numbers); returns the number of the first one that did not
        fit (the dirty range ends there), or None when all did."""
        latest = self.latest
        for r in records:
            if r.key is None:
                continue   # never survives (`survives`): nothing to remember
            if r.key not in latest:
                cost = len(r.key) + OFFSET_MAP_ENTRY_OVERHEAD_BYTES
                if self.bytes + cost > self.bytes_max and latest:   # one key always fits:
                    return r.number                                   # each pass progresses
                self.bytes += cost
            latest[r.key] = r.number
        return None


def survives(r: Record, latest: dict, now_ms: int, delete_retention_ms: int) -> bool:
    """Whether record `r` (below the dirty end) is kept by a pass at `now_ms`."""
    if r.key is None:
        return False
    if latest.get(r.key, -1) > r.number:
        return False          # superseded by a later record of its key
    if r.value is None and r.cleaned_ms is not None:
        return now_ms - r.cleaned_ms < delete_retention_ms
    return True


def compact(records: Iterable[Record], latest: dict, now_ms: int,
            delete_retention_ms: int) -> list[Record]:
    """The survivors of `records` (ascending numbers, below the dirty end), each tombstone
    stamped `cleaned_ms` = `now_ms` if this pass is the first to keep it (only tombstones are
    timed: a chunk keeps one time for them, `delete_horizon_ms`)."""
    out = []
    for r in records:
        if survives(r, latest, now_ms, delete_retention_ms):
            if r.value is None and r.cleaned_ms is None:
                r = r._replace(cleaned_ms=now_ms)
            out.append(r)
    return out


class Segment(NamedTuple):
    """A closed segment as a pass sees it: numbers `first` .. `end - 1`, its records (some of
    those numbers, ascending: earlier passes may have left gaps)."""
    first: int
    end: int
    records: list


class Rewrite(NamedTuple):
    """A pass's new content for the segment at `index` of the ones it was given (-1: the
    caller's one segment)."""
    index: int
    pieces: list
    bytes_before: int
    bytes_after: int


def plan_pass(segments: list[Segment], clean_end: int, now_ms: int, delete_retention_ms: int,
              map_bytes_max: int = OFFSET_MAP_BYTES_MAX) -> tuple[list[Rewrite], int]:
    """One pass over a streamlet's closed segments (in order, back to back) whose records below
    `clean_end` were compacted by earlier passes: (the segments that change and their
    pieces, the new clean end). The composition of `map_dirty` and `rewrite_segment`, which
    a shell calls one segment at a time so that only one segment's records are in memory."""
    offsets = OffsetMap(map_bytes_max)
    dirty_end = clean_end
    for seg in segments:
        dirty_end, full = map_dirty(offsets, seg, clean_end)
        if full:
            break
    rewrites = []
    for i, seg in enumerate(segments):
        if seg.first >= dirty_end:
            break
        w = rewrite_segment(seg, offsets.latest, dirty_end, now_ms, delete_retention_ms)
        if w is not None:
            rewrites.append(w._replace(index=i))
    return rewrites, max(clean_end, dirty_end)


def map_dirty(offsets: OffsetMap, seg: Segment, clean_end: int) -> tuple[int, bool]:
    """Phase 1 of a pass, for the next closed segment in order: map its dirty records (those at
    or past `clean_end`). Returns (the dirty end so far, whether the map is full: then the
    dirty range ends there and the pass maps no further segment)."""
    if seg.end <= clean_end:
        return clean_end, False
    stop = offsets.add(r for r in seg.records if r.number >= clean_end)
    return (seg.end, False) if stop is None else (stop, True)


def rewrite_segment(seg: Segment, latest: dict, dirty_end: int, now_ms: int,
                    delete_retention_ms: int) -> Rewrite | None:
    """Phase 2 of a pass, for one closed segment starting below the dirty end: its pieces, or
    None when it would not change (no record goes and no tombstone is first timed: no
    rewrite for nothing). Records at or past the dirty end are kept as they are."""
    below = [r for r in seg.records if r.number < dirty_end]
    kept = compact(below, latest, now_ms, delete_retention_ms)
    if kept == below:
        return None
    kept += [r for r in seg.records if r.number >= dirty_end]
    return Rewrite(-1, pack(kept, seg.first, seg.end), _size(seg.records), _size(kept))


def _size(records: Iterable[Record]) -> int:
    return sum(r.size() for r in records)


def pack(survivors: list[Record], first: int, end: int,
         piece_bytes_max: int = PIECE_BYTES_MAX) -> list[Piece]:
    """Cut the survivors of numbers `first` .. `end - 1` into pieces that cover that range
    exactly, back to back, each at most `piece_bytes_max` of records (one record over it goes
    alone). Nothing survives: one empty piece spans the range, so every number stays placed."""
    assert first < end, "a segment covers at least one number"
    pieces: list[Piece] = []
    start, held, size = first, [], 0
    for r in survivors:
        assert first <= r.number < end and (not held or held[-1].number < r.number), \
            "survivors ascend within the range"
        if held and size + r.size() > piece_bytes_max:
            pieces.append(Piece(start, r.number - start, tuple(held)))
            start, held, size = r.number, [], 0
        held.append(r)
        size += r.size()
    pieces.append(Piece(start, end - start, tuple(held)))
    return pieces


def delete_horizon_ms(piece: Piece) -> int | None:
    """When a piece's tombstones were first cleaned, the latest of them (None: it holds none):
    a chunk carries one time, and the latest keeps every tombstone at least its full time."""
    times = [r.cleaned_ms for r in piece.records if r.value is None]
    return max(times) if times else None


def dirty_ratio(clean_bytes: int, dirty_bytes: int) -> float:
    """Kafka's cleanable ratio: the dirty share of the bytes a pass could compact."""
    total = clean_bytes + dirty_bytes
    return dirty_bytes / total if total else 0.0


def due(clean_bytes: int, dirty_bytes: int, oldest_dirty_ms: int | None, now_ms: int,
        min_ratio: float, max_lag_ms: int) -> bool:
    """Whether a streamlet should be compacted now: enough of it is dirty, or its oldest dirty
    record waited max.compaction.lag.ms (0: no maximum)."""
    if not dirty_bytes:
        return False
    if max_lag_ms and oldest_dirty_ms is not None and now_ms - oldest_dirty_ms >= max_lag_ms:
        return True
    return dirty_ratio(clean_bytes, dirty_bytes) >= min_ratio


def cleanable_end(closed: Iterable[tuple[int, int]], now_ms: int, min_lag_ms: int) -> int | None:
    """The end number of the closed records a pass may reach: `closed` lists (end number, last
    append ms) of each closed, durable segment in order; a segment appended to less than
    min.compaction.lag.ms ago stops the range (records younger than that stay as written)."""
    end = None
    for seg_end, last_ms in closed:
        if now_ms - last_ms < min_lag_ms:
            break
        end = seg_end
    return end
