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

Streams with R >= 2 are compacted in memory (a tiered segment's file has the new segment's
name: the pass stops at the first tiered one). R=1 streams of a broker without a data dir have
nothing to make durable: a pass is swapped as soon as it is built. R=1 streams of a broker with
--dir keep their segments in files, which a restart reloads (kera.broker.reload): a pass reads
them through maps taken on the loop (verifying each chunk, as a file is read), the tier
commits each rewrite beside its file (`.cleaned` then `.swap`, on the tier thread), the swap
waits for that commit, and the file is then replaced by rename (kera.broker.tier_files says
why a crash at any point leaves each segment wholly old or wholly rewritten).
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
    replicated: bool = True   # R >= 2: the rewrite goes through the virtual logs
    on_file: bool = False     # R=1 with a data dir: segments read from and rewritten in files
    map_bytes_max: int = compaction.OFFSET_MAP_BYTES_MAX


@dataclass
class Rewritten:
    group: object
    index: int
    old: object
    new: object
    bytes_before: int
    bytes_after: int
    replicated: bool = True   # through its group's virtual log (R >= 2)
    on_file: bool = False     # its file replaced (R=1 with a data dir)


@dataclass
class Built:
    """What `run_pass` made: the segments that change, the clean end after the pass, when the
    earliest tombstone it kept was first kept (None: it kept none), and how long it took on
    the thread (the shell times it)."""
    job: PassJob
    rewrites: list
    clean_end: int
    tombstone_ms: int | None = None
    seconds: float = 0.0


@dataclass
class StreamCounters:
    """A compacted stream's passes on this broker, over its streamlets (`kera stats`, metrics):
    passes swapped in, record bytes of the segments they rewrote before and after, and the
    seconds their builds took on the compaction thread."""
    passes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0


@dataclass
class Pending:
    """A pass's rewrites whose chunks are being replicated: per virtual log, the position just
    after the last of their references (the swap waits for the durable walk to reach it); and
    the new segments whose rewrite of their file is not committed yet (R=1 with a data dir)."""
    built: Built
    targets: dict = field(default_factory=dict)
    files: set = field(default_factory=set)

    def durable(self) -> bool:
        return not self.files and all((vlog.walk_seg, vlog.walk_idx) >= pos
                                      for vlog, pos in self.targets.items())


def pass_segment(group, si: int, seg, mv: memoryview, check: bool = False) -> PassSegment:
    """Segment `si` of a finished group as a pass reads it (numbers and records), from its
    memory `mv` taken on the loop (`check`: a file's map, each chunk verified)."""
    return PassSegment(group.number_base + group.seg_bases[si], segment_end(group, si),
                       segment_records(seg, group.number_base, mv, check))


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
        dirty_end, full = compaction.map_dirty(
            offsets, pass_segment(group, si, seg, mv, job.on_file), job.clean_end)
        if full:
            break
    out, tombstones = [], []
    for group, si, seg, mv in job.segments:
        pseg = pass_segment(group, si, seg, mv, job.on_file)
        if pseg.first >= dirty_end:
            break
        w = compaction.rewrite_segment(pseg, offsets.latest, dirty_end, job.now_ms,
                                       job.delete_retention_ms)
        gen = generation(seg, mv) + 1
        if w is not None and gen <= GENERATION_MAX:   # else left as it is, for good
            out.append(Rewritten(group, si, seg, build_segment(group, si, w.pieces, gen),
                                 w.bytes_before, w.bytes_after, job.replicated,
                                 job.on_file))
            tombstones += _tombstone_times(r for p in w.pieces for r in p.records)
        else:
            tombstones += _tombstone_times(r for r in pseg.records if r.number < dirty_end)
    return Built(job, out, max(job.clean_end, dirty_end), min(tombstones, default=None))


def _tombstone_times(records) -> list[int]:
    """When each kept tombstone among `records` was first kept."""
    return [r.cleaned_ms for r in records if r.value is None and r.cleaned_ms is not None]


def on_file(info, has_dir: bool) -> bool:
    """Whether a stream's segments are its files (R=1 on a broker with a data dir): a pass
    reads them mapped and replaces the files (module docstring)."""
    return info.replication == 1 and has_dir


class Compactor:
    """Per broker: clean ends, the pass out on the thread or waiting for durability."""

    def __init__(self, core):
        self.core = core
        core.tier.on_rewrite = self.file_done
        self.clean_ends: dict[tuple[int, int], int] = {}
        self.running: PassJob | None = None
        self.pending: Pending | None = None
        # When a streamlet's earliest kept tombstone may go (KIP-534): a pass is due then even
        # if nothing is dirty, or a quiet streamlet would keep its deletes for ever.
        self.tombstones_due_ms: dict[tuple[int, int], int] = {}
        self.streams: dict[int, StreamCounters] = {}
        self.passes = 0
        self.bytes_before = 0
        self.bytes_after = 0
        self.seconds = 0.0

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
            if not info.compacted:
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
        for group, si, seg, is_dirty in self._cleanable(info, sl, streamlet, now_ms):
            if not is_dirty:
                clean += seg.used_bytes   # rewritten too: the dirty records supersede some
            elif dirty_segs < PASS_SEGMENTS_MAX:
                dirty += seg.used_bytes
                dirty_segs += 1
                oldest = group.last_ms if oldest is None else oldest
            else:
                break
            segs.append((group, si, seg))
        tombstones_due = self.tombstones_due_ms.get((info.id, sl))
        if not (compaction.due(clean, dirty, oldest, now_ms, info.min_cleanable_dirty_ratio,
                               info.max_compaction_lag_ms)
                or (segs and tombstones_due is not None and now_ms >= tombstones_due)):
            return None
        held = _memory_of(segs)
        if held is None:
            return None
        return PassJob(info.id, sl, held, clean_end, now_ms, info.delete_retention_ms,
                       info.replication >= 2, self._on_file(info))

    def _on_file(self, info) -> bool:
        return on_file(info, self.core.tier.root is not None)

    def _cleanable(self, info, sl: int, streamlet, now_ms: int):
        """(group, index, segment, dirty?) of the segments a pass over the streamlet may reach,
        in number order: dirty ones hold records past its clean end."""
        clean_end = self.clean_ends.get((info.id, sl), 0)
        for group, si, seg in _finished_segments(streamlet, now_ms, info.min_compaction_lag_ms,
                                                 self._on_file(info)):
            yield group, si, seg, segment_end(group, si) > clean_end

    # ------------------------------------------------------------------ what is seen
    def stream_stats(self, now_ms: int) -> dict[str, dict]:
        """Per compacted stream on this broker: its counters and, over its streamlets, the
        clean and dirty bytes a pass may reach now and the dirty share of them (Kafka's
        cleanable ratio). Stream name -> fields; a deleted stream's counters go with it."""
        out = {}
        for sid in [sid for sid in self.streams if sid not in self.core.streams]:
            del self.streams[sid]
        for stream in list(self.core.streams.values()):
            if stream.info.compacted:
                out[stream.info.name] = self._stream_row(stream, now_ms)
        return out

    def _stream_row(self, stream, now_ms: int) -> dict:
        clean = dirty = 0
        for sl, streamlet in list(stream.streamlets.items()):
            for _g, _si, seg, is_dirty in self._cleanable(stream.info, sl, streamlet, now_ms):
                if is_dirty:
                    dirty += seg.used_bytes
                else:
                    clean += seg.used_bytes
        c = self.streams.get(stream.info.id, StreamCounters())
        return {"dirty_ratio": compaction.dirty_ratio(clean, dirty), "clean_bytes": clean,
                "dirty_bytes": dirty, "passes": c.passes, "bytes_before": c.bytes_before,
                "bytes_after": c.bytes_after, "seconds": c.seconds}

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
            if w.on_file:
                self.core.tier.write_rewrite(w.new)
                pending.files.add(w.new)
            vlog = w.group.vlog
            if vlog is None:
                continue   # R=1: no backup to replicate to
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
        job = p.built.job
        counters = self.streams.setdefault(job.stream_id, StreamCounters())
        for w in p.built.rewrites:
            if not _applies(w):
                self._drop(w)   # its group went meanwhile: nothing to swap it into
                continue
            swap(w.group, w.index, w.new)
            if w.on_file:
                tier.rewritten(w.old, w.new)   # the files keep their name: none deleted
            else:
                tier.opened(w.new)
                tier.segment_deleted(w.old)
            for c in (counters, self):
                c.bytes_before += w.bytes_before
                c.bytes_after += w.bytes_after
        self._swapped(p.built, counters)
        self.core.retention.scan_vsegs = True   # the old segments' replicas may go now

    def file_done(self, job, error: Exception | None) -> None:
        """A rewrite's file commit (kera.broker.tier's CleanJob) is done: the swap may go once
        all of its pass's are. A failed one abandons the pass (a later pass does it again)."""
        p = self.pending
        if p is None or job.segment not in p.files:
            return   # its pass was abandoned, and its files' removal queued then
        if error is not None:
            log.warning("compaction of stream %s streamlet %s abandoned: writing the rewrite "
                        "of segment %s failed: %s", p.built.job.stream_id,
                        p.built.job.streamlet, job.record.key, error)
            self.pending = None
            for w in p.built.rewrites:
                self._drop(w)
            return
        p.files.discard(job.segment)
        self.on_durable()

    def _drop(self, w: Rewritten) -> None:
        """A rewrite not swapped: its memory goes, and its committed files (R=1 with a data
        dir), which a restart would otherwise finish."""
        if w.on_file:
            self.core.tier.discard_rewrite(w.new)
        w.new.release()

    def _swapped(self, built: Built, counters: StreamCounters) -> None:
        """A pass is in: its streamlet's clean end, when its tombstones may go, the counters
        (the broker's since start; the stream's while this broker has it)."""
        job, key = built.job, (built.job.stream_id, built.job.streamlet)
        self.clean_ends[key] = built.clean_end
        if built.tombstone_ms is None:
            self.tombstones_due_ms.pop(key, None)
        else:
            self.tombstones_due_ms[key] = built.tombstone_ms + job.delete_retention_ms
        counters.passes += 1
        counters.seconds += built.seconds
        self.passes += 1
        self.seconds += built.seconds


def _finished_segments(streamlet, now_ms: int, min_lag_ms: int, files: bool = False):
    """(group, index, segment) of the streamlet's finished groups in number order, in memory
    (or, `files`, in their files too), up to the first group appended to less than
    min.compaction.lag.ms ago."""
    for group in streamlet.groups:
        if not group.finished or group.number_base is None or not group.head:
            return
        if now_ms - group.last_ms < min_lag_ms:
            return
        for si, seg in enumerate(group.segments):
            if seg.released:
                return
            if seg.tier is not None and (not files or seg.tier.bad):
                return   # tiered (module docstring), or a damaged chunk found in its file
            yield group, si, seg


def _memory_of(segs: list) -> list | None:
    """(group, index, segment, its memory) for a pass, the view held while it runs: a file's
    segment is mapped here, on the loop (the tier's maps are the loop's). None: a file cannot
    be mapped (the tier logged why), no pass now."""
    out = []
    for group, si, seg in segs:
        mv = seg.mv if seg.mv is not None else seg.mapped()
        if mv is None:
            return None
        out.append((group, si, seg, mv))
    return out


def _applies(w: Rewritten) -> bool:
    """Whether a rewrite still fits its group: the same segment, not released (its group or
    stream deleted, its streamlet moved), still replicated if it was. A segment tiered since is
    swapped all the same: its content is what the rewrite read, and its file's deletion
    (queued at the swap) runs on the tier thread before any later write of the new segment's
    file, in submission order."""
    g = w.group
    return (w.index < len(g.segments) and g.segments[w.index] is w.old and not w.old.released
            and (g.vlog is not None or not w.replicated))
