"""Recovery of a dead broker's streamlets on their new owner: find the replicas, read them,
rebuild, re-replicate, report. Sans-IO: the server sends the requests this object hands out
(`take_requests`) and feeds back their outcome (`on_reply`); the clock is passed in.

The coordinator marks a streamlet it moved off a dead broker as *recovering*, with its sources
(the dead incarnations `[broker id, epoch]` whose replicas hold its data; see
kera.coordinator.recovery). When such a streamlet appears in this broker's metadata a *job*
starts for it (one job per metadata update, for every streamlet that update brought):

1. Wait for a list of live backups fetched after the job began (never recover from a stale
   view), then ask each of them `list_replicas` for every source broker, fencing the dead
   epochs there (the backup refuses further writes from them: a broker declared dead while
   merely slow cannot get anything acknowledged behind the recovery's back).
2. For each virtual segment of a source epoch, pick the longest replica (an acknowledged chunk is
   on every replica, so the longest holds everything anyone acknowledged) and read it with
   `read_replica` in pages, filtered to this job's streamlets, several reads in flight spread
   over the backups. A failed read (checksum error on the backup's disk, timeout, anything)
   moves to another replica of the same segment at the same byte offset (replicas of a segment
   are byte-identical prefixes of one another).
3. Every chunk is verified again and placed by kera.broker.rebuild at its recorded position.
4. Once every segment is read, each streamlet is installed: readable (not_ready is over), its
   chunks referenced by this broker's virtual logs and so replicated again to R-1 backups.
5. Once those references are durable the streamlet is reported `recovered` to the coordinator,
   which clears the marker (the dead incarnation's replicas may then be freed).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kera import config
from kera.broker.rebuild import StreamletRebuild, install
from kera.codec.chunk import HEADER_SIZE, chunk_size, verify
from kera.errors import CorruptChunk, KeraError, Throttled
from kera.codec.vseg import epoch_of, sequence_of

log = logging.getLogger(__name__)

# Read errors that say nothing about the copy itself: retried (READ_ERRORS_MAX).
PASSING_ERRORS = frozenset({"timeout", "not_ready", "storage_error", "internal"})
READ_BYTES = 8 * config.MiB            # one read_replica page
READS_IN_FLIGHT_MAX = 8                # read_replica requests out at once, all jobs together
READS_PER_BACKUP_MAX = 3               # ... and per backup
READ_TIMEOUT_S = 15.0
LIST_TIMEOUT_S = 5.0
LIST_ATTEMPTS_MAX = 12                 # per backup (a minute), before recovering without it
# Backups the coordinator reports dead are asked too (it may only be cut off from them), once
# and briefly, so that a dead one delays the recovery by this much at most.
UNREACHABLE_LIST_TIMEOUT_S = 2.0
# A copy that fails reads this often for passing reasons (timeouts) is abandoned; a damaged one
# (corrupt_chunk, bad_request, ...) at once.
READ_ERRORS_MAX = 4
RETRY_PAUSE_S = 0.2                    # after `throttled`, and between list attempts
# Chunks held while waiting for earlier ones of their group; above this, only each virtual
# log's first unread segment is read, which lets the waiting ones be placed.
PENDING_BYTES_MAX = 256 * config.MiB
FILTER_STREAMLETS_MAX = 4096           # streamlets named in a read's filter (else: no filter)


@dataclass(eq=False)
class Request:
    """A request for the server to send; its outcome goes back to `Recovery.on_reply`."""
    address: str
    op: str
    fields: dict
    timeout_s: float
    job: "Job"
    task: object = None       # the VsegTask of a read, or the (backup id, broker id) of a list


@dataclass(eq=False)
class Candidate:
    backup_id: int
    address: str
    length: int
    failed: bool = False        # abandoned: damaged, or failing too often
    errors: int = 0             # passing failures (timeouts) so far
    # Bytes the backup has flushed to its disk (list_replicas' `disk_length`): only those are
    # a copy of a "disk" stream's chunks, which a backup acknowledges once flushed.
    disk_length: int = 0


@dataclass(eq=False)
class VsegTask:
    """Reading one virtual segment of a source incarnation."""
    broker_id: int
    epoch: int
    vlog: int
    vseg: int
    candidates: list            # [Candidate], longest first
    filter: list | None         # [[sid, sl], ...] for the backup, or None
    offset: int = 0
    in_flight: bool = False
    done: bool = False
    retry_at: float = 0.0

    @property
    def chain(self) -> tuple[int, int, int]:
        return (self.broker_id, self.epoch, self.vlog)

    def candidate(self) -> Candidate | None:
        """The copy to read next: among those not abandoned that hold more than `offset`,
        the one that failed least (the longest, then the planned order, on ties)."""
        best = None
        for c in self.candidates:
            if not c.failed and c.length > self.offset and (best is None or c.errors < best.errors):
                best = c
        return best

    def copies(self, end: int, on_disk: bool = False) -> int:
        """Live, unfailed replicas holding the bytes below `end` (`on_disk`: flushed)."""
        return sum(1 for c in self.candidates
                   if not c.failed and (c.disk_length if on_disk else c.length) >= end)


class Phase(str, Enum):
    """Where a recovery job is; `Job.enter` allows only the moves in TRANSITIONS."""
    BACKUPS = "backups"            # waiting for a view of the live backups
    LISTING = "listing"            # asking every backup which replicas it holds (and fencing)
    READING = "reading"            # reading the chosen replicas' chunks
    INSTALLING = "installing"      # replaying them into streamlets, one per loop turn
    REPLICATING = "replicating"    # installed; waiting for R-1 copies, then reporting
    DONE = "done"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.BACKUPS: frozenset({Phase.LISTING}),
    # No backup answered: start over with a fresh view; else plan and read (or, with nothing
    # to read, install at once).
    Phase.LISTING: frozenset({Phase.BACKUPS, Phase.READING}),
    Phase.READING: frozenset({Phase.INSTALLING}),
    Phase.INSTALLING: frozenset({Phase.REPLICATING, Phase.DONE}),
    Phase.REPLICATING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class ListState(str, Enum):
    """One `list_replicas` request of a job (a backup, a dead broker)."""
    TODO = "todo"
    SENT = "sent"
    FAILED = "failed"      # gave up after its attempts: recover without that backup's copies
    DONE = "done"


@dataclass
class Listing:
    max_attempts: int
    timeout_s: float
    attempts: int = 0
    state: ListState = ListState.TODO
    at: float = 0.0        # not before (a retry's pause)


@dataclass(eq=False)
class Job:
    id: int
    created_at: float
    rebuilds: dict                    # (sid, sl) -> StreamletRebuild
    sources: dict                     # (sid, sl) -> set[(broker, epoch)]
    copies_needed: dict               # (sid, sl) -> R - 1
    # (sid, sl) -> True for a "disk" stream: only flushed bytes count as its copies.
    on_disk: dict = field(default_factory=dict)
    phase: Phase = Phase.BACKUPS
    lists: dict = field(default_factory=dict)     # (backup id, broker id) -> Listing
    backups: dict = field(default_factory=dict)   # backup id -> address (the view used)
    replicas: dict = field(default_factory=dict)  # (broker, epoch, vlog, vseg) -> [Candidate]
    answered: set = field(default_factory=set)    # backups that answered every list request
    tasks: list = field(default_factory=list)
    installed: dict = field(default_factory=dict)  # (sid, sl) -> Installed, until reported
    due: set = field(default_factory=set)          # installed and re-replicated: to report
    started_s: float = 0.0
    listed_s: float = 0.0
    read_s: float = 0.0
    installed_s: float = 0.0
    bytes_read: int = 0
    lost_bytes: int = 0

    def enter(self, phase: Phase) -> None:
        assert phase in TRANSITIONS[self.phase], f"recovery job {self.id}: {self.phase.value} -> {phase.value}"
        self.phase = phase

    @property
    def epochs(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for srcs in self.sources.values():
            for b, e in srcs:
                out.setdefault(b, set()).add(e)
        return out


class RecoveryHost(Protocol):
    """What recovery needs of the broker core (kera.broker.core.Broker): its identity, its
    streams and which streamlets it is recovering, its counters, and what
    kera.broker.rebuild.install writes into (producers, group hooks)."""
    broker_id: int | None
    epoch: int
    streams: dict          # sid -> Stream
    recovering: dict       # (sid, sl) -> the Job rebuilding it
    counters: object       # kera.daemon.metrics.Counters
    producers: object      # kera.broker.producers table (exactly-once state of rebuilt chunks)


class Recovery:
    def __init__(self, core: RecoveryHost, *, read_bytes: int = READ_BYTES,
                 reads_in_flight_max: int = READS_IN_FLIGHT_MAX):
        self.core = core
        self.read_bytes = read_bytes
        self.reads_in_flight_max = reads_in_flight_max
        self.jobs: list[Job] = []
        self._ids = itertools.count(1)
        self.backups: dict[int, str] = {}      # live backups, as of `backups_at`
        self.unreachable: dict[int, str] = {}  # registered backups the coordinator calls dead
        self.backups_at: float | None = None   # (only views the coordinator calls settled)
        self.reads_in_flight = 0
        self.per_backup: dict[int, int] = {}
        self.history: list[dict] = []           # timings of finished jobs (last few)
        # Every streamlet this incarnation recovered: a stale metadata reply that still marks
        # one recovering must not start it again.
        self.done_keys: set[tuple[int, int]] = set()
        self.counters = core.counters
        # (broker, epoch) -> the coordinator's token for fencing it (kera.net.fence), sent
        # with the fence so a secure backup accepts it.
        self.fence_tokens: dict[tuple[int, int], str] = {}

    # ------------------------------------------------------------------ inputs
    def take_fence_tokens(self, tokens) -> None:
        """A `broker_streams` reply's `fence_tokens`: [[broker, epoch, token], ...]. Each reply
        lists every incarnation this broker still recovers from, so it replaces the last."""
        self.fence_tokens = {
            (entry[0], entry[1]): entry[2] for entry in (tokens if isinstance(tokens, list) else ())
            if isinstance(entry, list) and len(entry) == 3 and _u64(entry[0])
            and _u64(entry[1]) and isinstance(entry[2], str)}

    def apply(self, descriptors, now: float) -> bool:
        """The metadata the broker just applied: start recovering streamlets newly marked
        recovering here; forget deleted ones. Returns True when a job started (the caller then
        fetches a fresh list of backups)."""
        core = self.core
        wanted: dict[tuple[int, int], set] = {}
        me = (core.broker_id, core.epoch)
        for d in descriptors if isinstance(descriptors, list) else ():
            for key, sources in _recovering_here(d, core.broker_id):
                # This very incarnation as a source: a marker the coordinator set while this
                # broker was cut off, and clears as it is back (it holds that data itself).
                sources.discard(me)
                if key[0] in core.streams and sources:
                    wanted[key] = sources
        for job in self.jobs:
            for key in [k for k in job.rebuilds if k[0] not in core.streams]:
                self._forget(job, key)
        known = {k for job in self.jobs for k in (*job.rebuilds, *job.installed)}
        new = {k: v for k, v in wanted.items()
               if k not in known and k not in core.recovering and k not in self.done_keys}
        if not new:
            return False
        job = Job(next(self._ids), now, {}, {}, {}, started_s=now)
        for key, sources in sorted(new.items()):
            info = core.streams[key[0]].info
            job.rebuilds[key] = StreamletRebuild(key[0], key[1], info.active_groups,
                                                 info.group_segments, info.segment_size_bytes)
            job.sources[key] = sources
            job.copies_needed[key] = info.replication - 1
            job.on_disk[key] = info.durability == "disk"
            core.recovering[key] = job
        self.jobs.append(job)
        self.counters.add("recovery_jobs")
        self.counters.add("recovery_streamlets", len(new))
        log.warning("recovering %d streamlets from the replicas of %s", len(new),
                    sorted({s for v in new.values() for s in v}))
        return True

    def set_backups(self, entries, now: float, settled: bool = True) -> None:
        """The coordinator's backup list (`cluster` reply). A view taken soon after the
        coordinator started (`settled` false) may miss live backups that have not heartbeated
        yet: recovery does not start from one."""
        if not settled:
            return
        live, dead = {}, {}
        for e in entries if isinstance(entries, list) else ():
            if isinstance(e, dict) and isinstance(e.get("id"), int) \
                    and isinstance(e.get("address"), str):
                (live if e.get("alive") is True else dead)[e["id"]] = e["address"]
        self.backups, self.unreachable = live, dead
        self.backups_at = now

    @property
    def active(self) -> bool:
        return bool(self.jobs)

    # ------------------------------------------------------------------ requests
    def take_requests(self, now: float) -> list[Request]:
        out: list[Request] = []
        for job in list(self.jobs):
            if job.phase is Phase.BACKUPS:
                if self.backups_at is not None and self.backups_at >= job.created_at:
                    if self.backups or not any(n > 0 for n in job.copies_needed.values()):
                        self._start_listing(job, now)
                    else:
                        # No live backup: nothing to recover from yet; never install empty.
                        self.counters.add("recovery_waits_for_backups")
                        job.created_at = now
            if job.phase is Phase.LISTING:
                out.extend(self._list_requests(job, now))
            if job.phase is Phase.READING:
                out.extend(self._read_requests(job, now))
                if all(t.done for t in job.tasks) and not any(t.in_flight for t in job.tasks):
                    job.read_s = now
                    job.tasks = []
                    job.enter(Phase.INSTALLING)
            if job.phase is Phase.INSTALLING:
                self._install_one(job, now)   # one per turn: the loop answers in between
            if job.phase is Phase.REPLICATING:
                for key, inst in job.installed.items():
                    if key not in job.due and inst.replicated():
                        job.due.add(key)
        return out

    def reports_due(self) -> list[list[int]]:
        """[[sid, sl], ...] re-replicated and not yet acknowledged by the coordinator."""
        return [[sid, sl] for job in self.jobs if job.phase is Phase.REPLICATING
                for (sid, sl) in sorted(job.due)]

    def reported(self, entries: list, now: float) -> None:
        """The coordinator took a `recovered` report of these streamlets."""
        done = {tuple(e) for e in entries}
        for job in list(self.jobs):
            if job.phase is not Phase.REPLICATING:
                continue
            for key in done & job.due:
                job.due.discard(key)
                job.installed.pop(key, None)
            # Streamlets whose stream was deleted meanwhile need no report.
            for key in [k for k in job.installed if k[0] not in self.core.streams]:
                job.due.discard(key)
                del job.installed[key]
            if not job.installed:
                job.enter(Phase.DONE)
                self.jobs.remove(job)
                self._record(job, now)

    # ------------------------------------------------------------------ listing
    def _start_listing(self, job: Job, now: float) -> None:
        job.enter(Phase.LISTING)
        job.backups = {**self.unreachable, **self.backups}
        job.lists = {(bid, b): Listing(LIST_ATTEMPTS_MAX if bid in self.backups else 1,
                                       LIST_TIMEOUT_S if bid in self.backups
                                       else UNREACHABLE_LIST_TIMEOUT_S)
                     for bid in job.backups for b in job.epochs}
        job.answered = set()
        job.replicas = {}
        if not job.lists:
            self._plan(job, now)

    def _list_requests(self, job: Job, now: float) -> list[Request]:
        out = []
        epochs = job.epochs
        for (bid, b), st in job.lists.items():
            if st.state is not ListState.TODO or st.at > now:
                continue
            st.state = ListState.SENT
            st.attempts += 1
            fence = sorted(epochs[b])
            out.append(Request(job.backups[bid], "list_replicas",
                               {"broker_id": b, "fence": fence, "fence_tokens":
                                [self.fence_tokens.get((b, e), "") for e in fence]},
                               st.timeout_s, job, (bid, b)))
        return out

    def _on_list(self, job: Job, key, header, error, now: float) -> None:
        st = job.lists.get(key)
        if st is None or st.state is not ListState.SENT:
            return
        bid, b = key
        if error is None:
            replicas = header.get("replicas") if isinstance(header, dict) else None
            if not isinstance(replicas, list):
                error = KeraError("list_replicas reply without a replica list", retriable=True)
        if error is not None:
            self.counters.add("recovery_list_failures")
            if st.attempts >= st.max_attempts:
                st.state = ListState.FAILED
                log.log(logging.WARNING if st.max_attempts > 1 else logging.INFO,"recovery: backup %d did not list its replicas of broker %d "
                            "(%s: %s); recovering without them", bid, b, error.code, error.message)
            else:
                st.state = ListState.TODO
                st.at = now + RETRY_PAUSE_S
            self._maybe_plan(job, now)
            return
        st.state = ListState.DONE
        epochs = job.epochs.get(b, set())
        address = job.backups[bid]
        for r in replicas:
            parsed = _parse_replica(r)
            if parsed is None or parsed[0] != b:
                continue
            _, vlog, vseg, length = parsed
            epoch = epoch_of(vseg)
            if epoch in epochs and length > 0:
                job.replicas.setdefault((b, epoch, vlog, vseg), []).append(
                    Candidate(bid, address, length, disk_length=_disk_length(r, length)))
        self._maybe_plan(job, now)

    def _maybe_plan(self, job: Job, now: float) -> None:
        if any(st.state in (ListState.TODO, ListState.SENT) for st in job.lists.values()):
            return
        for bid in job.backups:
            if all(st.state is ListState.DONE for (b_id, _), st in job.lists.items()
                   if b_id == bid):
                job.answered.add(bid)
        if not job.answered and any(n > 0 for n in job.copies_needed.values()):
            # No backup answered at all: recovering now would install nothing. Start over
            # with a fresh view of the backups.
            self.counters.add("recovery_list_restarts")
            log.warning("recovery job %d: no backup answered; trying again", job.id)
            job.enter(Phase.BACKUPS)
            job.created_at = now
            return
        self._plan(job, now)

    def _plan(self, job: Job, now: float) -> None:
        job.listed_s = now
        by_source: dict[tuple[int, int], list] = {}
        for key, srcs in job.sources.items():
            for s in srcs:
                by_source.setdefault(s, []).append(list(key))
        tasks = []
        for (b, epoch, vlog, vseg), cands in sorted(job.replicas.items()):
            wanted = by_source.get((b, epoch), [])
            if not wanted:
                continue
            cands.sort(key=lambda c: (-c.length, c.backup_id))
            # Among the longest copies, start at one spread by segment number, so reads of
            # consecutive segments go to different backups.
            top = [c for c in cands if c.length == cands[0].length]
            k = vseg % len(top)
            cands[:len(top)] = top[k:] + top[:k]
            filt = wanted if len(wanted) <= FILTER_STREAMLETS_MAX else None
            tasks.append(VsegTask(b, epoch, vlog, vseg, cands, filt))
        job.tasks = tasks
        job.enter(Phase.READING)
        self._check_chains(job)
        log.info("recovery job %d: %d virtual segments to read (%d bytes) from %d backups",
                 job.id, len(tasks), sum(t.candidates[0].length for t in tasks),
                 len(job.answered))

    def _check_chains(self, job: Job) -> None:
        """Segment numbers are dense per virtual log: a missing one is a segment no live
        backup holds (more failures than the replication factor covers)."""
        by_chain: dict[tuple, list[int]] = {}
        for t in job.tasks:
            by_chain.setdefault(t.chain, []).append(sequence_of(t.vseg))
        for chain, numbers in by_chain.items():
            # From the lowest found: retention may have dropped the oldest ones.
            missing = sorted(set(range(min(numbers), max(numbers) + 1)) - set(numbers))
            if missing:
                self.counters.add("recovery_vsegs_missing", len(missing))
                log.error("recovery: broker %d epoch %d vlog %d: no live backup holds virtual "
                          "segments %s (of %d..%d): data they held may be lost", *chain,
                          missing[:10], min(numbers), max(numbers))

    # ------------------------------------------------------------------ reading
    def _read_requests(self, job: Job, now: float) -> list[Request]:
        out = []
        pending = sum(r.pending_bytes for r in job.rebuilds.values())
        first_open: set = set()
        if pending > PENDING_BYTES_MAX:
            seen = set()
            for t in job.tasks:
                if not t.done and t.chain not in seen:
                    seen.add(t.chain)
                    first_open.add(id(t))
        for t in job.tasks:
            if self.reads_in_flight >= self.reads_in_flight_max:
                break
            if t.done or t.in_flight or t.retry_at > now:
                continue
            if first_open and id(t) not in first_open:
                continue
            c = t.candidate()
            if c is None:
                self._task_exhausted(job, t)
                continue
            if self.per_backup.get(c.backup_id, 0) >= READS_PER_BACKUP_MAX:
                continue
            fields = {"broker_id": t.broker_id, "vlog": t.vlog, "vseg": t.vseg,
                      "offset": t.offset, "max_bytes": self.read_bytes}
            if t.filter is not None:
                fields["streamlets"] = t.filter
            t.in_flight = True
            self.reads_in_flight += 1
            self.per_backup[c.backup_id] = self.per_backup.get(c.backup_id, 0) + 1
            out.append(Request(c.address, "read_replica", fields, READ_TIMEOUT_S, job, (t, c)))
        return out

    def _task_exhausted(self, job: Job, t: VsegTask) -> None:
        t.done = True
        target = t.candidates[0].length if t.candidates else 0
        if t.offset < target:
            lost = target - t.offset
            job.lost_bytes += lost
            self.counters.add("recovery_bytes_unreadable", lost)
            log.error("recovery: broker %d epoch %d vlog %d vseg %d: bytes %d..%d readable from "
                      "no replica", t.broker_id, t.epoch, t.vlog, t.vseg & 0xFFFFFFFF, t.offset,
                      target)

    def _on_read(self, job: Job, t: VsegTask, c: Candidate, header, frames, error,
                 now: float) -> None:
        t.in_flight = False
        self.reads_in_flight -= 1
        self.per_backup[c.backup_id] -= 1
        chunks = None
        if error is None:
            try:
                end, chunks = parse_read_reply(header, frames, t.offset)
            except CorruptChunk as err:
                error = err
        if error is not None:
            if isinstance(error, Throttled):
                t.retry_at = now + RETRY_PAUSE_S
                return
            c.errors += 1
            if error.code not in PASSING_ERRORS or c.errors >= READ_ERRORS_MAX:
                c.failed = True
            if t.candidate() is c:   # the only copy left: give it a moment
                t.retry_at = now + RETRY_PAUSE_S * min(c.errors, 5)
            self.counters.add("recovery_read_failures")
            log.warning("recovery: reading broker %d vlog %d vseg %d at %d from backup %d "
                        "failed (%s: %s); trying another copy", t.broker_id, t.vlog,
                        t.vseg & 0xFFFFFFFF, t.offset, c.backup_id, error.code, error.message)
            if t.candidate() is None:
                self._task_exhausted(job, t)
            return
        size = end - t.offset
        job.bytes_read += size
        self.counters.add("recovery_bytes_read", size)
        # Readable at once only where R-1 replicas hold the chunks as their backups would have
        # acknowledged them: a "disk" stream's unflushed tail is re-replicated first.
        durable_ok = {key: t.copies(end, job.on_disk.get(key, False)) >= need
                      for key, need in job.copies_needed.items()}
        source = (t.broker_id, t.epoch)
        for buf, h in chunks:
            key = (h.stream_id, h.streamlet)
            rebuild = job.rebuilds.get(key)
            if rebuild is None or source not in job.sources[key]:
                continue
            rebuild.add(buf, h, durable_ok[key])
        t.offset = end
        if t.candidate() is None:
            t.done = True
            if t.offset < t.candidates[0].length:
                self._task_exhausted(job, t)

    # ------------------------------------------------------------------ installing
    def _install_one(self, job: Job, now: float) -> None:
        core = self.core
        for key in sorted(job.rebuilds)[:1]:
            rebuild = job.rebuilds.pop(key)
            if core.recovering.get(key) is job:
                del core.recovering[key]
            inst = install(core, rebuild)
            c = self.counters
            c.add("recovery_chunks", rebuild.chunks)
            c.add("recovery_bytes", rebuild.bytes)
            c.add("recovery_duplicate_chunks", rebuild.duplicates)
            c.add("recovery_dropped_chunks", rebuild.dropped)
            if rebuild.superseded:   # chunks a whole compaction rewrite replaced
                c.add("recovery_superseded_chunks", rebuild.superseded)
            c.add("recovery_rejected_chunks", rebuild.rejected)
            if inst is None:
                continue
            job.installed[key] = inst
            self.done_keys.add(key)
            log.info("stream %d streamlet %d recovered: %d groups, %d chunks, %d bytes "
                     "(%d dropped after gaps); re-replicating", key[0], key[1], inst.groups,
                     inst.chunks, inst.bytes, rebuild.dropped)
        if job.rebuilds:
            return
        job.installed_s = now
        if job.installed:
            job.enter(Phase.REPLICATING)
        else:
            job.enter(Phase.DONE)
            self.jobs.remove(job)
            self._record(job, now)

    def _forget(self, job: Job, key) -> None:
        rebuild = job.rebuilds.pop(key, None)
        if rebuild is not None:
            rebuild.release()
        job.sources.pop(key, None)
        job.copies_needed.pop(key, None)
        if self.core.recovering.get(key) is job:
            del self.core.recovering[key]

    def _record(self, job: Job, now: float) -> None:
        entry = {"job": job.id, "started_s": job.started_s, "listed_s": job.listed_s,
                 "read_s": job.read_s, "installed_s": job.installed_s, "reported_s": now,
                 "bytes_read": job.bytes_read, "lost_bytes": job.lost_bytes}
        self.history = (self.history + [entry])[-16:]
        log.info("recovery job %d done: listing %.3f s, reading and replaying %.3f s, "
                 "re-replication %.3f s, %d bytes read", job.id, job.listed_s - job.started_s,
                 job.read_s - job.listed_s, now - job.installed_s, job.bytes_read)

    # ------------------------------------------------------------------ replies
    def on_reply(self, req: Request, header, frames, error: KeraError | None, now: float) -> None:
        job = req.job
        if job not in self.jobs:
            if req.op == "read_replica":   # an abandoned job's read: only the accounting
                t, c = req.task
                self.reads_in_flight -= 1
                self.per_backup[c.backup_id] -= 1
            return
        if req.op == "list_replicas":
            self._on_list(job, req.task, header, error, now)
        elif req.op == "read_replica":
            t, c = req.task
            self._on_read(job, t, c, header, frames, error, now)

    def stats(self) -> dict:
        out = {"recovery_jobs_active": len(self.jobs),
               "recovery_streamlets_active": len(self.core.recovering),
               "recovery_reads_in_flight": self.reads_in_flight}
        if self.history:
            last = self.history[-1]
            out.update({f"recovery_last_{k}": v for k, v in last.items()})
        if self.jobs:
            job = self.jobs[0]
            out.update(recovery_phase=job.phase.value, recovery_started_s=job.started_s,
                       recovery_listed_s=job.listed_s, recovery_read_s=job.read_s,
                       recovery_installed_s=job.installed_s)
        return out


# ---------------------------------------------------------------------- parsing

def _recovering_here(d, broker_id):
    """((sid, sl), {(broker, epoch)}) for each streamlet of descriptor `d` placed on
    `broker_id` and marked recovering."""
    if not isinstance(d, dict) or broker_id is None:
        return
    entries = d.get("recovering")
    placement = d.get("placement")
    sid = d.get("id")
    if not isinstance(entries, list) or not isinstance(placement, list) or not _u64(sid):
        return
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 2 or not _u64(entry[0]) \
                or not isinstance(entry[1], list):
            log.warning("ignoring a malformed recovering entry %r", entry)
            continue
        sl, raw = entry
        if sl >= len(placement) or placement[sl] != broker_id:
            continue
        sources = set()
        for s in raw:
            if isinstance(s, list) and len(s) == 2 and _u64(s[0]) and _u64(s[1]):
                sources.add((s[0], s[1]))
        if sources:
            yield (sid, sl), sources


def _u64(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64


def _parse_replica(r):
    if not isinstance(r, dict):
        return None
    vals = (r.get("broker_id"), r.get("vlog"), r.get("vseg"), r.get("length"))
    if not all(_u64(v) for v in vals):
        return None
    return vals


def _disk_length(r: dict, length: int) -> int:
    """A listed replica's flushed bytes; 0 (nothing counted on disk) when the backup did not
    say or said something impossible."""
    disk = r.get("disk_length")
    return disk if _u64(disk) and disk <= length else 0


def parse_read_reply(header, frames, offset: int):
    """(end, [(chunk view, header)]) of a read_replica reply, every chunk verified."""
    end = header.get("end") if isinstance(header, dict) else None
    if not _u64(end) or end < offset:
        raise CorruptChunk(f"read_replica reply with a bad end {end!r}")
    out = []
    for frame in frames or ():
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        at = 0
        while at < len(buf):
            if len(buf) - at < HEADER_SIZE:
                raise CorruptChunk(f"{len(buf) - at} stray bytes after the chunks of a frame")
            size = chunk_size(buf, at)
            if at + size > len(buf):
                raise CorruptChunk("a chunk runs past the end of its frame")
            view = buf[at:at + size]
            out.append((view, verify(view)))
            at += size
    if end == offset and out:
        raise CorruptChunk("read_replica reply carries chunks but does not advance")
    if end == offset:
        raise CorruptChunk(f"read_replica reply does not advance past {offset}")
    return end, out



# ---------------------------------------------------------------------- a new incarnation

def reset_incarnation(core) -> None:
    """The broker's previous incarnation was failed over (declared dead): its replicated
    streams (R >= 2) were fenced, moved and are recovered from their replicas (here too, if
    still placed here), so it forgets them and their virtual logs. Its R=1 streams were not
    failed over (no replica holds them; they stay placed on it, kera.coordinator.recovery): it
    keeps them whole, with their producers. Produce requests still waiting are told
    `not_owner` (retriable: the client asks the coordinator where the streamlet is now)."""
    from kera.errors import NotOwner

    err = NotOwner("this broker's streamlets moved while it was unreachable; ask the "
                   "coordinator again")
    replicated = [sid for sid, s in core.streams.items() if s.info.replication > 1]
    for sid in replicated:
        for streamlet in core.streams[sid].streamlets.values():
            for waiter in streamlet.release():
                core.fail_waiter(waiter, err)
    for sid in replicated:
        core.drop_stream(sid)
    core.fail_in_flight(err)
    core.vlogs.clear()
    core.vlog_list.clear()
    core.recovering.clear()
    core.metadata_version = 0
    core.counters.add("incarnation_resets")
    log.warning("this broker's previous incarnation was failed over: %d replicated streams "
                "dropped (recovered from their replicas), %d unreplicated kept",
                len(replicated), len(core.streams))
