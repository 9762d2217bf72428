"""The broker's compaction passes (docs/COMPACTION.md, "Replication and the crash-safe swap"),
sans-IO: which streamlet is due, a pass over a snapshot of its finished groups (`run_pass`, the
part a background thread runs: per-record Python, writing no broker state), the new segments'
chunks replicated through their group's virtual log like appended chunks, the swap once every
one is durable on R copies, then the release of the old segment.

The decisions are kera.broker.compaction's and the segment work kera.broker.rewrite's; this
module holds the broker's side: per streamlet the clean end (records below it were compacted
by an earlier pass; kept in memory, so a new owner starts from 0 and only works more), one
pass at a time (COMPACTIONS_IN_FLIGHT_MAX), and the checks that a rewrite still applies when it
comes back from the thread and when it is swapped (its group not deleted, its segment not
swapped by another pass).

Scope of this slice: streams with R >= 2 (an R=1 stream needs the `.cleaned` rename protocol,
not built), segments in memory only (a tiered segment's file has the new segment's name).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kera.broker import compaction
from kera.broker.compaction import OffsetMap, Segment as PassSegment
from kera.broker.rewrite import build_segment, generation, segment_records, swap
from kera.codec.chunk import GENERATION_MAX

log = logging.getLogger(__name__)

# One pass's rewrites built or waiting to be durable at a time, per broker (docs/COMPACTION.md).
COMPACTIONS_IN_FLIGHT_MAX = 1
# Dirty segments one pass maps at most (besides the clean ones it rewrites: each is read
# twice, per-record Python on the background thread); the next pass goes on from its end.
PASS_SEGMENTS_MAX = 64


@dataclass
class PassJob:
    """A pass to run off the loop: the streamlet's finished segments in number order as
    (group, index, segment, its memory)."""
    stream_id: int
    streamlet: int
    segments: list
    clean_end: int
    now_ms: int
    delete_retention_ms: int
    map_bytes_max: int = compaction.OFFSET_MAP_BYTES_MAX


@dataclass
class Rewritten:
    group: object
    index: int
    old: object
    new: object
    bytes_before: int
    bytes_after: int


@dataclass
class Built:
    """What `run_pass` made: the segments that change and the clean end after the pass."""
    job: PassJob
    rewrites: list
    clean_end: int


@dataclass
class Pending:
    """A pass's rewrites whose chunks are being replicated: per virtual log, the position just
    after the last of their references (the swap waits for the durable walk to reach it)."""
    built: Built
    targets: dict = field(default_factory=dict)

    def durable(self) -> bool:
        return all((vlog.walk_seg, vlog.walk_idx) >= pos for vlog, pos in self.targets.items())


def pass_segment(group, si: int, seg, mv: memoryview) -> PassSegment:
    """Segment `si` of a finished group as a pass reads it (numbers and records), from its
    memory `mv` taken on the loop."""
    return PassSegment(group.number_base + group.seg_bases[si], segment_end(group, si),
                       segment_records(seg, group.number_base, mv))


def segment_end(group, si: int) -> int:
    """The record number just past segment `si` of a group with numbers."""
    end = group.seg_bases[si + 1] if si + 1 < len(group.segments) else group.head
    return group.number_base + end


def run_pass(job: PassJob) -> Built:
    """The pass itself (the background thread's part): map the dirty records segment by
    segment, then rewrite segment by segment, so one segment's records and the bounded map
    are all it holds. Reads only closed, finished segments, which nothing else writes."""
    offsets = OffsetMap(job.map_bytes_max)
    dirty_end = job.clean_end
    for group, si, seg, mv in job.segments:
        dirty_end, full = compaction.map_dirty(offsets, pass_segment(group, si, seg, mv),
                                               job.clean_end)
        if full:
            break
    out = []
    for group, si, seg, mv in job.segments:
        pseg = pass_segment(group, si, seg, mv)
        if pseg.first >= dirty_end:
            break
        w = compaction.rewrite_segment(pseg, offsets.latest, dirty_end, job.now_ms,
                                       job.delete_retention_ms)
        gen = generation(seg, mv) + 1
        if w is not None and gen <= GENERATION_MAX:   # else left as it is, for good
            out.append(Rewritten(group, si, seg, build_segment(group, si, w.pieces, gen),
                                 w.bytes_before, w.bytes_after))
    return Built(job, out, max(job.clean_end, dirty_end))


def compactable(info) -> bool:
    """Streams this slice compacts: compacted ones with R >= 2 (module docstring)."""
    return info.compacted and info.replication >= 2


class Compactor:
    """Per broker: clean ends, the pass out on the thread or waiting for durability."""

    def __init__(self, core):
        self.core = core
        self.clean_ends: dict[tuple[int, int], int] = {}
        self.running: PassJob | None = None
        self.pending: Pending | None = None
        self.passes = 0
        self.bytes_before = 0
        self.bytes_after = 0

    @property
    def busy(self) -> bool:
        return self.running is not None or self.pending is not None

    # ------------------------------------------------------------------ choosing
    def next_pass(self, now_ms: int) -> PassJob | None:
        """The pass to run now (the caller hands it to the thread), or None."""
        if self.busy:
            return None
        for stream in list(self.core.streams.values()):
            info = stream.info
            if not compactable(info):
                continue
            for sl, streamlet in list(stream.streamlets.items()):
                job = self._job(info, sl, streamlet, now_ms)
                if job is not None:
                    self.running = job
                    return job
        return None

    def _job(self, info, sl: int, streamlet, now_ms: int) -> PassJob | None:
        clean_end = self.clean_ends.get((info.id, sl), 0)
        segs, clean, dirty, dirty_segs, oldest = [], 0, 0, 0, None
        for group, si, seg in _finished_segments(streamlet, now_ms, info.min_compaction_lag_ms):
            if segment_end(group, si) <= clean_end:
                clean += seg.used_bytes   # rewritten too: the dirty records supersede some
            elif dirty_segs < PASS_SEGMENTS_MAX:
                dirty += seg.used_bytes
                dirty_segs += 1
                oldest = group.last_ms if oldest is None else oldest
            else:
                break
            segs.append((group, si, seg, seg.mv))   # its memory, held while the pass runs
        if not compaction.due(clean, dirty, oldest, now_ms, info.min_cleanable_dirty_ratio,
                              info.max_compaction_lag_ms):
            return None
        return PassJob(info.id, sl, segs, clean_end, now_ms, info.delete_retention_ms)

    # ------------------------------------------------------------------ back on the loop
    def built(self, result: Built | None, error: Exception | None) -> None:
        """The thread's outcome: replicate what still applies (a failed pass is retried by a
        later one: nothing changed)."""
        job, self.running = self.running, None
        if error is not None or result is None:
            log.warning("compaction of stream %s streamlet %s failed: %s",
                        job and job.stream_id, job and job.streamlet, error)
            return
        result.rewrites = [w for w in result.rewrites if _applies(w)]
        pending = Pending(result)
        for w in result.rewrites:
            vlog = w.group.vlog
            for i in range(len(w.new)):
                vlog.add(w.new, i, w.new.sizes[i])
            pending.targets[vlog] = (len(vlog.vsegs) - 1, len(vlog.vsegs[-1]))
        self.pending = pending
        self.on_durable()

    def on_durable(self) -> None:
        """After the durable walk moved: swap and release once the pass's chunks are durable."""
        p = self.pending
        if p is None or not p.durable():
            return
        tier = self.core.tier
        if any(w.old in tier.writing for w in p.built.rewrites):
            return   # its file being written: a deletion queued now could follow the new one's
        self.pending = None
        for w in p.built.rewrites:
            if not _applies(w):
                w.new.release()   # its group went meanwhile: nothing to swap it into
                continue
            swap(w.group, w.index, w.new)
            tier.opened(w.new)
            tier.segment_deleted(w.old)
            self.bytes_before += w.bytes_before
            self.bytes_after += w.bytes_after
        job = p.built.job
        self.clean_ends[(job.stream_id, job.streamlet)] = p.built.clean_end
        self.passes += 1
        self.core.retention.scan_vsegs = True   # the old segments' replicas may go now


def _finished_segments(streamlet, now_ms: int, min_lag_ms: int):
    """(group, index, segment) of the streamlet's finished groups in number order, in memory,
    up to the first group appended to less than min.compaction.lag.ms ago."""
    for group in streamlet.groups:
        if not group.finished or group.number_base is None or not group.head:
            return
        if now_ms - group.last_ms < min_lag_ms:
            return
        for si, seg in enumerate(group.segments):
            if seg.mv is None or seg.tier is not None:
                return   # tiered or released: this slice rewrites segments in memory only
            yield group, si, seg


def _applies(w: Rewritten) -> bool:
    """Whether a rewrite still fits its group: the same segment, not released (its group or
    stream deleted, its streamlet moved). A segment tiered since is swapped all the same: its
    content is what the rewrite read, and its file's deletion (queued at the swap) runs on the
    tier thread before any later write of the new segment's file, in submission order."""
    g = w.group
    return (w.index < len(g.segments) and g.segments[w.index] is w.old and not w.old.released
            and g.vlog is not None)
