"""A compaction's rewrite of one closed segment, in memory: its stored chunks read as records
(kera.broker.compaction.Record), a pass's pieces built into compacted chunks (FLAG_SPARSE) in a
new Segment covering the same record offsets, and the swap of the two in their group. Sans-IO.

The swap is step 3 of docs/COMPACTION.md's rewrite (build, replicate, swap, release): the shell
makes it only once the new chunks are durable on R copies, then releases the old segment.
Because the new segment covers exactly the old one's offsets, nothing else of the group moves:
head, durable head, segment bases, record numbers and readers' positions stay valid.
"""

from __future__ import annotations

from kera.broker.compaction import Piece, Record, delete_horizon_ms
from kera.broker.compaction import Segment as PassSegment
from kera.broker.segment import Segment
from kera.broker.time_index import stored_chunk
from kera.codec.chunk import GENERATION_MAX, Chunk, compacted, encode_sparse, read_header


def segment_records(seg: Segment, number_base: int, mv: memoryview | None = None,
                    check: bool = False) -> list[Record]:
    """The records of a closed segment, in number order, as a pass reads them (a tombstone of
    an earlier rewrite keeps the time it was first kept: its chunk's delete horizon). Per
    record Python: the caller bounds how many segments it reads per turn. `mv`: the segment's
    memory as taken on the loop, for a reader on another thread, which must not map files
    through the tier nor see the segment's memory go (the view keeps it); `check`: `mv` maps
    a file, whose chunks are verified (both checksums) as every read of a file is."""
    out: list[Record] = []
    for i in range(len(seg)):
        if mv is None:
            c = stored_chunk(seg, i)
        else:
            pos = seg.positions[i]
            c = Chunk(mv[pos:pos + seg.sizes[i]], check=check)   # else checked when appended
        base = number_base + seg.bases[i]
        horizon = c.delete_horizon_ms
        headers = c.headers() if c.has_headers else [()] * len(c)
        for off, key, value, ts, hs in zip(c.record_offsets().tolist(), c.keys(), c.values(),
                                           c.timestamps.tolist(), headers):
            out.append(Record(base + off, key, value, ts, tuple(hs),
                              horizon if value is None else None))
    return out


def generation(seg: Segment, mv: memoryview | None = None) -> int:
    """Which rewrite of its segment `seg` is: 0 as appended, then 1, 2, ... (its chunks'
    headers carry it), up to GENERATION_MAX: a segment rewritten that often is left as is.
    `mv`: the segment's memory, as segment_records takes it."""
    if not len(seg):
        return 0
    h = stored_chunk(seg, 0).header if mv is None else read_header(mv[seg.positions[0]:])
    place = compacted(h)
    return 0 if place is None else place.generation


def piece_chunks(pieces: list[Piece], stream_id: int, streamlet: int, gen: int) -> list[bytes]:
    """The compacted chunks of a rewrite's pieces (generation `gen`), unstamped."""
    out = []
    for i, p in enumerate(pieces):
        rs = p.records
        out.append(encode_sparse(
            stream_id, streamlet, (gen, i, i == len(pieces) - 1),
            [r.key for r in rs], [r.value for r in rs], [r.timestamp_us for r in rs],
            [list(r.headers) for r in rs] if any(r.headers for r in rs) else None,
            [r.number - p.first for r in rs], p.span, delete_horizon_ms(p)))
    return out


def build_segment(group, si: int, pieces: list[Piece], gen: int | None = None) -> Segment:
    """A new segment for segment `si` of `group` holding `pieces` (numbers), stamped with the
    group's coordinates; exactly as large as its chunks (a closed segment never grows), not
    yet in the group. `gen`: its rewrite's generation (default: the old segment's next)."""
    old = group.segments[si]
    gen = generation(old) + 1 if gen is None else gen
    assert gen <= GENERATION_MAX, "the caller skips segments at their last generation"
    chunks = piece_chunks(pieces, group.stream_id, group.streamlet, gen)
    new = Segment(group, old.number, max(1, sum(map(len, chunks))))
    for p, c in zip(pieces, chunks):
        new.append(c, len(c), group.id, p.first - group.number_base, p.span, p.first)
    return new


def swap(group, si: int, new: Segment) -> Segment:
    """Put `new` in place of segment `si` of a finished group; returns the old one, for the
    caller to release once nothing needs it (its readers' views keep its memory alive)."""
    assert group.finished, "only a finished group's segments are rewritten"
    old = group.segments[si]
    start = group.seg_bases[si]
    end = group.seg_bases[si + 1] if si + 1 < len(group.segments) else group.head
    assert len(new) and new.bases[0] == start and new.end_offset(len(new) - 1) == end, \
        "a rewrite covers exactly its segment's offsets"
    assert new.number == old.number
    group.segments[si] = new
    group.time_index = None   # indexed per chunk: the chunks changed
    return old


def closed_segments(group) -> list:
    """A finished group's segments as a pass sees them (kera.broker.compaction.Segment)."""
    assert group.finished and group.number_base is not None
    out = []
    for si, seg in enumerate(group.segments):
        start = group.seg_bases[si]
        end = group.seg_bases[si + 1] if si + 1 < len(group.segments) else group.head
        out.append(PassSegment(group.number_base + start, group.number_base + end,
                               segment_records(seg, group.number_base)))
    return out
