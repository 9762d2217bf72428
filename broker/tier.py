"""Tiering: keeping the chunk bytes a broker holds in memory under its budget.

Segments are registered as they open (`opened`). Memory is counted as the *mapped capacity*
of the segments held in memory, not the chunk bytes in them: an open segment maps its whole
capacity (and costs at least a page of RSS and a kernel map area however little it holds), so
many tiny groups cannot take more memory than `--memory-limit` says. When that passes `tier_at`
(a share of `memory_limit_bytes`), the oldest *sealed, durable* segments — no more appends
(a later segment of its group exists, or the group closed) and every chunk acknowledged by
every copy the stream asks for — are handed out as WriteJobs (kera.broker.tier_files: the tier
thread writes the file and its checksummed record). Once a write is done the segment drops its
memory and keeps a TierFile: reads (consumers, re-replication) then map the file, read-only,
through a bounded set of maps (`maps_max`, least recently mapped unmapped first), so the
broker's readers never see the difference.

Sans-IO but for `map` (an mmap of a file, done in the loop: cheap, pages fault in as they are
read). Backpressure: `admit` refuses new segments that would take memory past the limit, or
the number of segments in memory past `SEGMENTS_RESIDENT_MAX`; producers are then answered
`throttled` (retriable). If memory is full of open segments nothing could
ever tier, so under that pressure the group of the largest durable open segment is closed
(its next chunk opens a new group), which makes the segment sealed.

R=1 segments need no write: their chunks reach their file before each ack. Once sealed with
all chunks there, a segment is *settled* (`_settle`): it leaves memory at once, whatever the
budget, and is read through its file as a tiered one is.

A compaction's rewrite of a segment whose file is what a restart reloads (an R=1 stream's)
replaces that file crash-safely (kera.broker.tier_files: `.cleaned`, `.swap`, rename):
`write_rewrite` commits the new bytes beside the file (CleanJob, its outcome to `on_rewrite`),
`rewritten` takes the new segment in at the swap and forgets the old one (no deletion: the
files keep their name), and once the file is replaced (SwapJob) the new segment settles.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kera.broker import tier_files
from kera.broker.tier_files import (CleanJob, DeleteJob, DeleteStreamJob, DiscardJob,
                                    FirstGroupJob, LiveWrite, SegmentRecord, SwapJob, WriteJob)
from kera.codec.chunk import crc32c, verify
from kera.errors import CorruptChunk, KeraError, NotReady
from kera.daemon.metrics import Counters

log = logging.getLogger(__name__)

SCAN_BACKOFF_S = 0.02   # after a scan found nothing to tier, wait this long before the next
# Segments held in memory at once, per broker. Each is one anonymous mapping (two once huge
# pages are advised for its tail), and Linux refuses mappings past vm.max_map_count (65,530 by
# default): 16,384 segments stay within half of it, leaving room for the tier's file maps
# (`maps_max`), libraries and zmq.
SEGMENTS_RESIDENT_MAX = 16_384


@dataclass(slots=True)
class TierConfig:
    root: Path | None = None          # the broker's data dir; None: nothing is tiered
    memory_limit_bytes: int = 0       # chunk bytes in memory; 0: unlimited
    disk_limit_bytes: int = 0         # tiered bytes on disk; 0: as much as the disk holds
    tier_at_fraction: float = 0.85    # tiering starts above this share of the memory limit
    jobs_max: int = 4                 # tier jobs out on the tier thread at once
    maps_max: int = 256               # tiered segments mapped at once (each holds a file descriptor)
    retry_s: float = 1.0              # pause after a failed write before tiering again

    def check(self) -> None:
        if self.memory_limit_bytes < 0 or self.disk_limit_bytes < 0:
            raise ValueError("memory and disk limits must not be negative")
        if not 0 < self.tier_at_fraction <= 1 or self.jobs_max < 1 or self.maps_max < 1:
            raise ValueError("tier_at_fraction must be in (0, 1], jobs_max and maps_max >= 1")


class TierFile:
    """What a tiered segment keeps of its file.

    Every chunk read from the file is verified (both checksums, the broker's stamps) the first
    time it is read after the file is mapped: a damaged chunk is never served. It is read back
    from a backup replica when one holds it (kera.broker.repair) and served from memory then."""
    __slots__ = ("store", "key", "length", "checked", "bad", "repairing", "repaired")

    def __init__(self, store: "TierStore", key: tuple, length: int):
        self.store = store
        self.key = key          # (stream id, streamlet, group, segment)
        self.length = length
        self.checked: bytearray | None = None   # per chunk: verified since the file was mapped
        self.bad: set[int] = set()              # chunks that failed verification
        self.repairing: set[int] = set()        # of those, being read from a replica
        self.repaired: dict[int, memoryview] = {}   # verified copies from a replica

    def map(self, seg):
        return self.store.map(seg)

    @property
    def path(self) -> Path | None:
        root = self.store.root
        return None if root is None else tier_files.seg_path(root, self.key)

    def good(self, seg, index: int, view) -> bool:
        """Is chunk `index` of the mapped file whole? Verified once per mapping."""
        checked = self.checked
        if checked is None:
            checked = self.checked = bytearray(len(seg))
        if checked[index]:
            return True
        if index in self.bad:
            return False
        g = seg.group
        try:
            h = verify(view)
            if (h.stream_id, h.streamlet, h.group, h.segment, h.base_offset) != (
                    g.stream_id, g.streamlet, g.id, seg.number, seg.bases[index]):
                raise CorruptChunk(f"stamped group {h.group} segment {h.segment} "
                                   f"offset {h.base_offset}")
        except CorruptChunk as err:
            self.store.corrupt(seg, index, err)
            return False
        checked[index] = 1
        return True

    def error(self, seg, index: int) -> KeraError | None:
        """Why chunk `index` cannot be served (None: it can, or it is not a damaged one)."""
        if index not in self.bad or index in self.repaired:
            return None
        where = f"chunk {index} (byte {seg.positions[index]}) of segment file {self.path}"
        if index in self.repairing:
            return NotReady(f"{where} failed its checksum; it is being read from a backup replica")
        return CorruptChunk(f"{where} failed its checksum and no replica holds it (R=1, or its "
                            f"replicas are gone): its records cannot be served; read past it by "
                            f"moving the position to the next chunk", retriable=False)


def segment_key(seg) -> tuple[int, int, int, int]:
    g = seg.group
    return g.stream_id, g.streamlet, g.id, seg.number


def segment_record(seg, n: int) -> SegmentRecord:
    """The commit record of the first `n` chunks of a segment in memory."""
    g = seg.group
    return SegmentRecord(
        stream_id=g.stream_id, streamlet=g.streamlet, group=g.id, segment=seg.number,
        slot=g.slot, length=seg.positions[n - 1] + seg.sizes[n - 1], chunks=n,
        base_offset=seg.bases[0], end_offset=seg.bases[n - 1] + seg.counts[n - 1],
        created_ms=g.created_ms, last_ms=g.last_ms, capacity_bytes=seg.capacity_bytes,
        chunks_crc=tier_files.chunks_crc(seg.mv, seg.positions, n), group_closed=g.closed)


def durable_chunks(seg) -> int:
    """How many leading chunks of `seg` are durable (durability moves over whole chunks)."""
    return bisect_left(seg.bases, seg.group.durable)


def sealed(seg) -> bool:
    g = seg.group
    return g.closed or g.segments[-1] is not seg


class TierStore:
    def __init__(self, cfg: TierConfig | None = None, counters: Counters | None = None,
                 close_group: Callable[[object], None] | None = None,
                 segments_max: int = SEGMENTS_RESIDENT_MAX):
        self.cfg = cfg or TierConfig()
        self.cfg.check()
        self.root = Path(self.cfg.root) if self.cfg.root is not None else None
        self.close_group = close_group        # closes a group (memory pressure, see module doc)
        # Starts reading a damaged chunk from a replica (kera.broker.repair); False: none can.
        self.repairer: Callable[[object, int], bool] | None = None
        self.counters = counters if counters is not None else Counters()
        self.resident: dict = {}              # segments holding memory, oldest opened first
        self.writing: dict = {}               # segment -> WriteJob out on the tier thread
        self.maps: OrderedDict = OrderedDict()  # tiered segments mapped now
        self.mapped_bytes = 0                 # capacity of the segments in `resident`
        # Capacity a refused chunk wanted: tiering makes that much room below `tier_at` too,
        # or a request refused below the threshold would wait forever.
        self.wanted_bytes = 0
        self.segments_max = segments_max

        # R=1 segments with chunks not yet in their file: written before the ack (LiveWrite);
        # and per live segment (bytes, chunks, chained crc) already there. Both hold only
        # resident segments: tiering or deletion forgets them.
        self.live_dirty: dict = {}
        self.live: dict = {}
        # Sealed R=1 segments, oldest first, whose memory goes as soon as all their chunks are
        # in their file (`_settle`).
        self.settling: deque = deque()
        # Rewritten segments whose file is being replaced (SwapJob): never written by a
        # WriteJob meanwhile, which would overwrite the old file in place.
        self.swapping: set = set()
        # Told a CleanJob's outcome (kera.broker.compactor: the swap waits for it).
        self.on_rewrite: Callable[[CleanJob, Exception | None], None] | None = None
        self.disk_bytes = 0                   # bytes of segment files on disk
        self.jobs_out = 0
        self._queue: deque = deque()          # deletions waiting for room on the tier thread
        self._retry_at = 0.0
        self._scan_at = 0.0
        lim = self.cfg.memory_limit_bytes
        self.tier_at_bytes = int(lim * self.cfg.tier_at_fraction) if lim else 0

    # ------------------------------------------------------------------ accounting
    @property
    def memory_bytes(self) -> int:
        return self.mapped_bytes

    def admit(self, segments: int, nbytes: int) -> bool:
        """May `segments` more segments of `nbytes` mapped capacity in all come into memory?"""
        if len(self.resident) + segments > self.segments_max:
            return False
        limit = self.cfg.memory_limit_bytes
        return not limit or self.mapped_bytes + nbytes <= limit

    def wanted(self, nbytes: int) -> None:
        """A chunk was refused for want of `nbytes` of room: tier that much more."""
        self.wanted_bytes = max(self.wanted_bytes, nbytes)

    def never_fits(self, capacity_bytes: int) -> bool:
        """A segment of this capacity is larger than the whole memory budget."""
        limit = self.cfg.memory_limit_bytes
        return bool(limit) and capacity_bytes > limit

    def opened(self, seg) -> None:
        """A segment now maps its capacity in memory."""
        if seg not in self.resident:
            self.resident[seg] = None
            self.mapped_bytes += seg.capacity_bytes
            self.wanted_bytes = 0
            self._seal_previous(seg)

    def _seal_previous(self, seg) -> None:
        """`seg` opened after the last segment of its group, which is sealed now."""
        segments = () if seg.group is None else seg.group.segments
        if len(segments) > 1 and segments[-1] is seg:
            self.segment_sealed(segments[-2])

    def segment_sealed(self, seg) -> None:
        """No chunk will be appended to `seg` any more (a later segment opened, or its group
        closed): an R=1 one (written to its file before its acks) goes to `settling`."""
        if seg in self.live or seg in self.live_dirty:
            self.settling.append(seg)

    def _left(self, seg) -> None:
        """A segment no longer holds memory (tiered, deleted, released)."""
        self.live.pop(seg, None)
        self.live_dirty.pop(seg, None)
        if self.resident.pop(seg, 0) is None:
            self.mapped_bytes -= seg.capacity_bytes

    # ------------------------------------------------------------------ planning
    def take_jobs(self, now: float) -> list:
        """Jobs for the tier thread: queued deletions, then writes while memory is above
        `tier_at` (oldest sealed durable segments first). Settles R=1 segments first."""
        jobs: list = []
        jobs_max = self.cfg.jobs_max
        while self._queue and self.jobs_out < jobs_max:
            jobs.append(self._queue.popleft())
            self.jobs_out += 1
        if self.root is None:
            return jobs
        self._settle()
        if not self.tier_at_bytes or self.jobs_out >= jobs_max:
            return jobs
        in_flight = sum(seg.capacity_bytes for seg in self.writing)
        excess = self.memory_bytes + self.wanted_bytes - in_flight - self.tier_at_bytes
        if excess <= 0 or now < self._retry_at or now < self._scan_at:
            return jobs
        found = False
        disk_limit = self.cfg.disk_limit_bytes
        stale = []
        for seg in self.resident:
            if excess <= 0 or self.jobs_out >= jobs_max:
                break
            if seg.released:     # released by a path that did not tell us (e.g. a rebuild)
                stale.append(seg)
                continue
            if seg in self.writing or seg in self.swapping or not len(seg) or not sealed(seg):
                continue
            n = len(seg)
            if durable_chunks(seg) < n:
                continue
            found = True
            if disk_limit and self.disk_bytes + in_flight + seg.used_bytes > disk_limit:
                self.counters.add("tier_disk_full")
                break
            job = self._write_job(seg, n)
            self.writing[seg] = job
            jobs.append(job)
            self.jobs_out += 1
            in_flight += seg.capacity_bytes
            excess -= seg.capacity_bytes
            self.wanted_bytes = max(0, self.wanted_bytes - seg.capacity_bytes)
        for seg in stale:
            self._left(seg)

        if not found:
            self._scan_at = now + SCAN_BACKOFF_S
            # Half way from tier_at to the limit with nothing to tier and no write to wait
            # for: producers are about to be throttled with no way out but a group closing.
            pressure = (self.tier_at_bytes + self.cfg.memory_limit_bytes) // 2
            if not self.writing and self.memory_bytes + self.wanted_bytes >= pressure \
                    and self._relieve():
                jobs += self.take_jobs(now)   # the segment just sealed goes now
        return jobs

    def _settle(self) -> None:
        """Let the memory of sealed R=1 segments whose chunks are all in their file (their live
        writes put them there before each ack) go to the pool at once, whatever memory holds:
        their reads map the file from then on, as a tiered segment's do. Nothing is written or
        synced: the `.seg` file and its `.live` record are what a kill -9 leaves of an R=1
        segment, which a restart reloads (kera.broker.reload), and R=1 promises no more.
        Holding them until memory filled made an R=1 broker keep every byte twice (its memory
        and the page cache) and fault fresh memory in for every new segment: 23% of its CPU at
        16 KiB chunks, half of that zeroing pages (perf, `make bench`'s send_batch). Syncing
        each one and committing its `.meta` instead cost more than the reused memory saved
        there (send_batch 0.86-1.07x against holding them)."""
        queue = self.settling
        disk_limit = self.cfg.disk_limit_bytes
        while queue:
            seg = queue[0]
            if seg.released or seg not in self.resident or seg in self.writing:
                queue.popleft()
                continue
            length, chunks, _crc = self.live.get(seg, (0, 0, 0))
            if chunks < len(seg) or durable_chunks(seg) < chunks:
                return    # a write of its last chunks failed or is to come: its retry does it
            if disk_limit and self.disk_bytes + length > disk_limit:
                return    # counted as tiered bytes, it would pass --disk-limit: memory keeps it
            queue.popleft()
            self.counters.add("tier_r1_settled")
            self._tiered(seg, segment_key(seg), length)

    def _relieve(self) -> bool:
        """Memory is full and nothing is sealed and durable: close the group of the largest
        durable open segment, so that it becomes sealed (see the module docstring)."""
        best = None
        for seg in self.resident:
            if seg in self.writing or sealed(seg) or not len(seg):
                continue
            if durable_chunks(seg) == len(seg) and (best is None or seg.used_bytes > best.used_bytes):
                best = seg
        if best is None or self.close_group is None:
            return False
        self.counters.add("groups_closed_for_memory")
        self.close_group(best.group)
        self._scan_at = 0.0
        return True


    def _write_job(self, seg, n: int) -> WriteJob:
        record = segment_record(seg, n)
        length = record.length
        # An R=1 segment's live writes put its bytes in its file already: rewriting them took 5%
        # of the broker's samples at its memory limit (R=1, 64 KiB chunks; py-spy).
        on_file = self.live.get(seg, (0,))[0]
        return WriteJob(seg, record, seg.mv[:length], min(on_file, length))

    # ------------------------------------------------------------------ compaction's rewrites
    def write_rewrite(self, new) -> None:
        """Commit a rewrite (`new`, in memory, not yet in its group) beside its segment's file
        (CleanJob; its outcome goes to `on_rewrite`)."""
        self._queue.append(CleanJob(new, segment_record(new, len(new)), new.mv))

    def rewritten(self, old, new) -> None:
        """At the swap: `new` (committed by `write_rewrite`) took `old`'s place in its group.
        The old segment's memory or map goes, not its files (the new ones take their name);
        the new one stays in memory until its file replaced the old one (SwapJob)."""
        if old in self.resident:
            self._left(old)
        elif old.tier is not None:
            self.maps.pop(old, None)
            self.disk_bytes -= old.tier.length
        old.release()
        self.opened(new)
        self.swapping.add(new)
        self._queue.append(SwapJob(new, segment_record(new, len(new))))

    def discard_rewrite(self, new) -> None:
        """A committed rewrite that will not be swapped: its files go."""
        if self.root is not None:
            self._queue.append(DiscardJob(segment_key(new)))

    def _swap_done(self, job: SwapJob, error: Exception | None) -> None:
        """The file is replaced: the new segment settles (read through its file) as an R=1
        segment does. On failure it stays in memory; a restart finishes the committed swap."""
        seg = job.segment
        self.swapping.discard(seg)
        if error is not None:
            self.counters.add("tier_write_errors")
            log.error("replacing segment file %s by its compaction's rewrite failed (finished "
                      "at the next start; served from memory until then): %s", job.record.key,
                      error)
        elif seg.released:   # deleted (retention, stream deleted) while it was replaced
            self._delete_files(job.record.key, 0)
        elif seg in self.resident:
            self._tiered(seg, job.record.key, job.record.length)

    # ------------------------------------------------------------------ R=1 before the ack
    def live_appended(self, seg) -> None:
        """A chunk of an R=1 stream went into `seg`: its bytes go to the file before the ack."""
        if self.root is not None:
            self.live_dirty[seg] = None

    def take_live_writes(self) -> list[LiveWrite]:
        """The writes to perform before the R=1 acks of this request go (see tier_files)."""
        writes = []
        for seg in self.live_dirty:
            at, n, crc = self.live.get(seg, (0, 0, 0))
            total = len(seg)
            if seg.released or total == n:
                continue
            for i in range(n, total):
                p = seg.positions[i]
                crc = crc32c(seg.mv[p + 4:p + 8], crc)
            g = seg.group
            length = seg.used_bytes
            record = SegmentRecord(
                stream_id=g.stream_id, streamlet=g.streamlet, group=g.id, segment=seg.number,
                slot=g.slot, length=length, chunks=total, base_offset=seg.bases[0],
                end_offset=seg.end_offset(total - 1), created_ms=g.created_ms, last_ms=g.last_ms,
                capacity_bytes=seg.capacity_bytes, chunks_crc=crc, group_closed=False)
            writes.append(LiveWrite(seg, record, at, seg.mv[at:length]))
        self.live_dirty.clear()
        return writes

    def live_written(self, w: LiveWrite, error: Exception | None) -> None:
        """Outcome of a LiveWrite: on failure the segment stays dirty (the next produce, or
        the client's retry, writes it again before any ack)."""
        seg = w.segment
        if error is not None:
            self.counters.add("r1_write_errors")
            self.live_dirty[seg] = None
        elif seg in self.resident and not seg.released:
            r = w.record
            self.live[seg] = (r.length, r.chunks, r.chunks_crc)
            self.counters.add("r1_write_bytes", len(w.data))

    # ------------------------------------------------------------------ outcomes
    def job_done(self, job, error: Exception | None, now: float) -> None:
        """The outcome of a job take_jobs handed to the tier thread (kera.broker.tier_files.run)."""
        self.jobs_out -= 1
        if isinstance(job, CleanJob):
            if self.on_rewrite is not None:
                self.on_rewrite(job, error)
            return
        if isinstance(job, SwapJob):
            self._swap_done(job, error)
            return
        if not isinstance(job, WriteJob):
            if error is not None:
                self.counters.add("tier_delete_errors")
                log.error("deleting segment files failed (%r): %s", job, error)
            else:
                self.counters.add("tier_deletes")
            return
        seg = job.segment
        self.writing.pop(seg, None)
        if error is not None:
            self.counters.add("tier_write_errors")
            self._retry_at = now + self.cfg.retry_s
            log.error("writing segment %s to %s failed (retry in %.1f s): %s", job.record.key,
                      self.root, self.cfg.retry_s, error)
            return
        if seg.released:     # deleted (retention, stream deleted) while it was written
            self._delete_files(job.record.key, 0)
            return
        self.counters.add("tier_writes")
        self.counters.add("tier_write_bytes", job.nbytes)
        self._tiered(seg, job.record.key, job.nbytes)

    def _tiered(self, seg, key, length: int) -> None:
        """The segment's bytes are on disk: let its memory go (once the last view is gone)."""
        self._left(seg)
        self.disk_bytes += length
        seg.tier = TierFile(self, key, length)
        seg.drop_memory()

    def adopt(self, seg, key, length: int) -> None:
        """A segment reloaded from disk at startup (kera.broker.reload)."""
        self.disk_bytes += length
        seg.tier = TierFile(self, key, length)

    # ------------------------------------------------------------------ deletion
    def segment_deleted(self, seg) -> None:
        """Retention deleted the segment's group: free its memory or its files."""
        if seg in self.resident:
            if seg in self.live:    # an R=1 segment's files written before its acks
                self._delete_files(segment_key(seg), 0)
            self._left(seg)
        elif seg.tier is not None:
            self.maps.pop(seg, None)
            self._delete_files(seg.tier.key, seg.tier.length)
        seg.release()

    def stream_deleted(self, streamlets) -> None:
        """A deleted stream's segments: forget them (the caller releases them and queues the
        removal of the stream's directory with `delete_stream`)."""
        for streamlet in streamlets:
            for group in streamlet.groups:
                for seg in group.segments:
                    if seg in self.resident:
                        self._left(seg)
                    elif seg.tier is not None:
                        self.maps.pop(seg, None)
                        self.disk_bytes -= seg.tier.length

    def delete_stream(self, stream_id: int) -> None:
        if self.root is not None:
            self._queue.append(DeleteStreamJob(stream_id))

    def record_first_group(self, stream_id: int, streamlet: int, first_group: int) -> None:
        if self.root is not None:
            self._queue.append(FirstGroupJob(stream_id, streamlet, first_group))


    def _delete_files(self, key, length: int) -> None:
        self.disk_bytes -= length
        if self.root is not None:
            self._queue.append(DeleteJob(key, length))

    # ------------------------------------------------------------------ reading
    def map(self, seg):
        """Map a tiered segment's file (read-only) and make it the segment's buffer."""
        tf = seg.tier
        try:
            mm, mv = tier_files.map_file(self.root, tf.key, tf.length)
        except (OSError, ValueError) as err:
            self.counters.add("tier_map_errors")
            log.error("cannot map segment file %s: %s", tf.key, err)
            return None
        seg.buf, seg.mv = mm, mv
        tf.checked = None                     # verify again what is read through this map
        self.maps[seg] = None
        self.counters.add("tier_maps")
        while len(self.maps) > self.cfg.maps_max:
            old, _ = self.maps.popitem(last=False)
            # Views handed out (frames being sent) keep the map alive until they are gone.
            old.mv = None
            old.buf = None
        return mv

    # ------------------------------------------------------------------ damaged chunks
    def corrupt(self, seg, index: int, err: CorruptChunk) -> None:
        tf = seg.tier
        tf.bad.add(index)
        self.counters.add("tier_corrupt_chunks")
        repairing = self.repairer is not None and self.repairer(seg, index)
        if repairing:
            tf.repairing.add(index)
        log.error("chunk %d (byte %d) of segment file %s failed verification (%s): not served; "
                  "%s", index, seg.positions[index], tf.path, err.message,
                  "reading it from a backup replica" if repairing else "no replica holds it")

    def repaired(self, seg, index: int, data: bytes) -> None:
        tf = seg.tier
        tf.repaired[index] = memoryview(data)
        tf.repairing.discard(index)
        self.counters.add("tier_chunks_repaired")
        log.warning("chunk %d of segment file %s read back from a backup replica: served from "
                    "memory from now on (the file is left as it is)", index, tf.path)

    def repair_failed(self, seg, index: int) -> None:
        seg.tier.repairing.discard(index)
        self.counters.add("tier_repairs_failed")
        log.error("chunk %d of segment file %s: no replica could give it back; readers get "
                  "corrupt_chunk", index, seg.tier.path)

    # ------------------------------------------------------------------ shutdown
    def shutdown_jobs(self) -> list[WriteJob]:
        """At an orderly stop: a write of the durable part of every segment still in memory
        (open ones included), so a restart from this directory finds every durable chunk."""
        jobs = []
        if self.root is None:
            return jobs
        for seg in self.resident:
            if seg in self.writing or seg in self.swapping or seg.released:
                continue   # a rewrite's committed swap is finished by the next start
            n = durable_chunks(seg) if len(seg) else 0
            if n:
                jobs.append(self._write_job(seg, n))
        return jobs

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        return {
            "memory_bytes": self.memory_bytes,
            "memory_limit_bytes": self.cfg.memory_limit_bytes,
            "tiered_bytes": self.disk_bytes,
            "tier_jobs_out": self.jobs_out,
            "segments_resident": len(self.resident),
            "segments_resident_max": self.segments_max,
            "segments_mapped": len(self.maps),
        }
