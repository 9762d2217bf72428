"""The backup's sans-IO core: replicas of virtual segments, keyed by (broker_id, vlog, vseg).

`replicate` verifies a write's chunks, appends them at exactly the offset the broker says, and
answers `offset` + the write's bytes (every byte below is stored): at once for durability
"memory", or once the flusher reports the bytes fsynced for "disk" (the reply is deferred and
comes back from `flush_done`). Retries are idempotent (kera.backup.replica). The store never
touches a file:
it hands out FlushJobs (the flusher thread writes them) and DiskReads (a reader thread serves
them), and is told their outcome. The clock is passed in.

Bounds: a replica holds at most `max_replica_bytes`; at most `max_unflushed_bytes` may wait for
the flusher and at most `max_memory_bytes` stay in memory (flushed bytes of open replicas are
let go, oldest written first, to make room; a closed replica leaves memory once it is on disk);
beyond those a write is answered `throttled`. A write with no chunks for a replica the
store does not hold creates nothing (acknowledged at length 0). New replicas are refused with
`storage_error` beyond `replicas_per_broker_max` of one broker id or `replicas_max` in all, and
any write whose bytes would take the replicas past `disk_limit_bytes` (chunk bytes plus
REPLICA_OVERHEAD_BYTES each) likewise: the broker then places the virtual segment on another
backup. A refused write stores nothing. At most `flush_jobs_max` flush jobs are out at
once, one per replica, so the flusher's queue never grows past that.

A flush that fails (full disk, I/O error) answers the replica's waiting "disk" writes with
`storage_error`, refuses further writes to that replica with `storage_error` until a retried
flush (after `flush_retry_s`, doubling up to `flush_retry_max_s`) succeeds, and keeps its bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable, NamedTuple

from kera.config import DURABILITY_DISK, DURABILITY_MEMORY, KiB, MiB
from kera.errors import BadRequest, KeraError, NotReady, OffsetOutOfRange, StorageError, Throttled
from kera.daemon.metrics import Counters

from kera.backup.frames import split_chunks
from kera.backup.meta import Meta
from kera.backup.replica import Key, Replica, describe

log = logging.getLogger(__name__)

DURABILITIES = (DURABILITY_MEMORY, DURABILITY_DISK)
# Replicas of one broker id held here: `list_replicas` answers all of them in one reply, which
# must stay under wire.MAX_HEADER_BYTES (4 MiB): an entry packs to ~110 bytes at most, so
# 16,384 of them take under 2 MiB (tests/unit/test_backup_bounds.py measures it).
REPLICAS_PER_BROKER_MAX = 16_384
# Replicas held in all: each costs a Replica object, two files and, at a restart, one metadata
# record read before serving; 65,536 of them hold 4 TiB at the default 64 MiB replica bound.
REPLICAS_TOTAL_MAX = 65_536
# Disk bytes a replica costs beyond its chunks under --disk-limit: its `.meta` record and the
# partial last block of each of its two files (4 KiB blocks).
REPLICA_OVERHEAD_BYTES = 8 * KiB


@dataclass(slots=True)
class StoreConfig:
    max_replica_bytes: int = 64 * MiB       # a virtual segment's replica, at most
    max_unflushed_bytes: int = 256 * MiB    # received but not yet on disk, all replicas
    max_memory_bytes: int = 512 * MiB       # held in memory, all replicas (>= unflushed bound)
    flush_job_max_bytes: int = 16 * MiB     # one flush job writes at most this (plus one chunk)
    flush_jobs_max: int = 16                # flush jobs handed out and not yet done
    flush_retry_s: float = 0.5              # first back-off after a failed flush
    flush_retry_max_s: float = 30.0
    disk_limit_bytes: int = 0               # replica bytes on disk, all replicas; 0: no limit
    # Group commit of "memory" writes: bytes no one waits for on disk wait up to this long
    # for more of their replica to be flushed with them, unless `flush_batch_bytes` are
    # already waiting. 0: flush at once (the store's default, for embedding and tests; the
    # daemon's is FLUSH_DELAY_S). Writes with durability "disk" are always flushed at once.
    flush_delay_s: float = 0.0
    flush_batch_bytes: int = 1 * MiB
    replicas_per_broker_max: int = REPLICAS_PER_BROKER_MAX
    replicas_max: int = REPLICAS_TOTAL_MAX

    def check(self) -> None:
        if min(self.max_replica_bytes, self.max_unflushed_bytes, self.flush_job_max_bytes,
               self.flush_jobs_max, self.replicas_per_broker_max, self.replicas_max) <= 0:
            raise ValueError("store bounds must be positive")
        if self.disk_limit_bytes < 0:
            raise ValueError("disk_limit_bytes must not be negative")
        if self.flush_delay_s < 0 or self.flush_batch_bytes <= 0:
            raise ValueError("flush_delay_s must not be negative, flush_batch_bytes must be "
                             "positive")
        if self.replicas_per_broker_max > REPLICAS_PER_BROKER_MAX:
            raise ValueError(f"replicas_per_broker_max may be at most {REPLICAS_PER_BROKER_MAX} "
                             f"(list_replicas answers them in one reply)")
        if self.max_memory_bytes < self.max_unflushed_bytes:
            raise ValueError("max_memory_bytes must be at least max_unflushed_bytes")


class FlushJob(NamedTuple):
    """Write `buffers` at byte `offset` of the replica file, fsync, then record `meta`."""
    key: Key
    offset: int
    buffers: tuple[memoryview, ...]
    meta: Meta

    @property
    def size(self) -> int:
        return self.meta.length - self.offset


class DropJob(NamedTuple):
    """Remove a dropped replica's files (metadata record first)."""
    key: Key


class DiskRead(NamedTuple):
    """Read whole chunks of a replica file from `offset`, not past `limit`, up to `max_bytes`
    (at least one chunk), verifying each."""
    key: Key
    offset: int
    limit: int
    max_bytes: int


class Waiter(NamedTuple):
    end: int
    closed: bool
    token: Hashable


Reply = tuple[object, "int | KeraError"]  # (token, length acknowledged or the error)


class ReplicaStore:
    def __init__(self, config: StoreConfig | None = None):
        self.config = config or StoreConfig()
        self.config.check()
        self.replicas: dict[Key, Replica] = {}
        self.counters = Counters()
        self.unflushed_bytes = 0
        self.memory_bytes = 0
        self.flush_jobs_out = 0
        self.replicas_open = 0
        self.replicas_on_disk = 0
        self.replicas_failed = 0
        self.replicas_per_broker: dict[int, int] = {}   # broker id -> replicas held of it
        self.disk_bytes = 0      # what the replicas take on disk (once flushed): --disk-limit
        self._dirty: dict[Key, None] = {}      # replicas needing a flush and not flushing (FIFO)
        # When each replica's oldest unflushed bytes arrived (for flush_delay_s).
        self._dirty_since: dict[Key, float] = {}
        self._resident: dict[Key, None] = {}   # replicas holding memory, least recently written first
        self._waiters: dict[Key, list[Waiter]] = {}
        # drop_replica: replicas to remove once their flush in flight is done, and removals
        # of files for the flusher thread (see `drop`).
        self._drop_pending: set[Key] = set()
        self._drop_jobs: list[DropJob] = []
        # Replicas discarded (reset) while a flush of theirs was in flight: their files are
        # removed once it is done, and the new content's flushes wait until then (see `reset`).
        self._discarding: set[Key] = set()

    # ------------------------------------------------------------------ writes
    def replicate(self, key: Key, offset: int, frames, durability: str, close: bool,
                  token: Hashable, now: float) -> int | None:
        """Store one write. Returns the length to acknowledge now, or None when the reply is
        deferred until `flush_done` returns it. Raises KeraError to refuse the whole write."""
        if durability not in DURABILITIES:
            raise BadRequest(f"durability '{durability}' is not one of {DURABILITIES}")
        replica = self.replicas.get(key)
        chunks, repeated = self._check(key, replica, offset, frames, close)
        if replica is None and not chunks:
            # Nothing to keep: a replica, its directory and files would only cost (without
            # bound, for fresh keys). The empty write is acknowledged: 0 bytes are stored.
            self.counters.add("empty_writes")
            return 0
        new = chunks[repeated:]
        added = sum(map(len, new))
        self._admit(key, replica, added, bool(new))
        replica = self._append(key, replica, new, offset, close)
        if added:
            self._dirty_since.setdefault(key, now)
        end = offset + sum(map(len, chunks))
        self.counters.add("replicate_writes")
        self.counters.add("chunks_received", len(chunks))
        self.counters.add("bytes_received", end - offset)
        self.counters.add("repeated_chunks", repeated)
        if durability == DURABILITY_MEMORY or replica.durable(end, close):
            return end
        self._waiters.setdefault(key, []).append(Waiter(end, close, token))
        return None

    def _check(self, key: Key, replica: Replica | None, offset: int, frames,
               close: bool) -> tuple[list[memoryview], int]:
        """The write's verified chunks and how many of them repeat stored ones (a retry)."""
        length = replica.length if replica is not None else 0
        if replica is None and offset:
            raise BadRequest(f"unknown {describe(key)} at offset {offset} > 0")
        if offset > length:
            raise BadRequest(f"offset mismatch: {describe(key)} holds {length} bytes, not {offset}")
        try:
            chunks = split_chunks(frames)
        except KeraError:
            self.counters.add("chunks_rejected", len(frames))
            raise
        if offset == length:
            return chunks, 0
        if not chunks:
            raise BadRequest(f"offset mismatch: {describe(key)} holds {length} bytes, not {offset}")
        repeated = replica.repeated(offset, chunks)
        if close and offset + sum(map(len, chunks)) < length:
            raise BadRequest(f"offset mismatch: cannot close {describe(key)} before its end {length}")
        return chunks, repeated

    def _append(self, key: Key, replica: Replica | None, new: list[memoryview], offset: int,
                close: bool) -> Replica:
        if replica is None:
            replica = self._new_replica(key)
            self.replicas_open += 1
        added = replica.append(new, offset)
        if added:
            self.unflushed_bytes += added
            self.memory_bytes += added
            self.disk_bytes += added
            self._resident.pop(key, None)  # most recently written last
            self._resident[key] = None
        if close and not replica.closed:
            replica.closed = True
            self.replicas_open -= 1
        self._mark(replica)
        return replica

    def _new_replica(self, key: Key) -> Replica:
        replica = self.replicas[key] = Replica(key)
        self.replicas_per_broker[key[0]] = self.replicas_per_broker.get(key[0], 0) + 1
        self.disk_bytes += REPLICA_OVERHEAD_BYTES
        return replica

    def _admit(self, key: Key, replica: Replica | None, added: int, appends: bool) -> None:
        """Refuse a write the replica's state or the store's bounds cannot take."""
        length = replica.length if replica is not None else 0
        if replica is None:
            self._admit_new(key)
        self._admit_disk(key, added + (REPLICA_OVERHEAD_BYTES if replica is None else 0))
        if replica is not None and replica.closed and appends:
            raise BadRequest(f"{describe(key)} is closed at {length} bytes")
        if replica is not None and replica.failed:
            raise StorageError(f"{describe(key)} cannot be written to disk: {replica.failed}")
        if length + added > self.config.max_replica_bytes:
            raise BadRequest(f"{describe(key)} would hold {length + added} bytes, more than "
                             f"{self.config.max_replica_bytes}")
        # An empty flusher always takes one write, however large, so progress is guaranteed.
        if added and self.unflushed_bytes and self.unflushed_bytes + added > self.config.max_unflushed_bytes:
            self.counters.add("throttled")
            raise Throttled(f"{self.unflushed_bytes} bytes wait for the disk "
                            f"(max_unflushed_bytes {self.config.max_unflushed_bytes})")
        if added and self.memory_bytes + added > self.config.max_memory_bytes:
            self._release_memory(self.memory_bytes + added - self.config.max_memory_bytes)
            if self.memory_bytes and self.memory_bytes + added > self.config.max_memory_bytes:
                self.counters.add("throttled")
                raise Throttled(f"{self.memory_bytes} bytes held in memory "
                                f"(max_memory_bytes {self.config.max_memory_bytes})")

    def _admit_new(self, key: Key) -> None:
        held = self.replicas_per_broker.get(key[0], 0)
        if held >= self.config.replicas_per_broker_max:
            self.counters.add("replicas_refused")
            raise StorageError(f"this backup holds {held} replicas of broker {key[0]}, the most "
                               f"it may (replicas_per_broker_max): place {describe(key)} elsewhere")
        if len(self.replicas) >= self.config.replicas_max:
            self.counters.add("replicas_refused")
            raise StorageError(f"this backup holds {len(self.replicas)} replicas, the most it may "
                               f"(replicas_max): place {describe(key)} elsewhere")

    def _admit_disk(self, key: Key, added: int) -> None:
        limit = self.config.disk_limit_bytes
        if added and limit and self.disk_bytes + added > limit:
            self.counters.add("disk_full")
            raise StorageError(f"{describe(key)}: {added} more bytes would take this backup past "
                               f"its --disk-limit ({self.disk_bytes} of {limit} bytes used); "
                               f"place it elsewhere, or raise the limit")

    def _release_memory(self, wanted: int) -> None:
        released = 0
        for key in list(self._resident):
            released += self._drop_flushed(self.replicas[key])
            if released >= wanted:
                return

    def _drop_flushed(self, replica: Replica) -> int:
        released = replica.drop_flushed()
        self.memory_bytes -= released
        if not replica.memory_bytes:
            self._resident.pop(replica.key, None)
        return released

    def _mark(self, replica: Replica) -> None:
        if replica.needs_flush() and not replica.flushing:
            self._dirty[replica.key] = None

    # ------------------------------------------------------------------ flushing
    def take_flush_jobs(self, now: float) -> list[FlushJob]:
        """Flush jobs to hand to the flusher now (at most one per replica in flight), and
        removals of dropped replicas' files (DropJob) ahead of them."""
        jobs: list = []
        while self._drop_jobs and self.flush_jobs_out < self.config.flush_jobs_max:
            jobs.append(self._drop_jobs.pop(0))
            self.flush_jobs_out += 1
        for key in list(self._dirty):
            if self.flush_jobs_out >= self.config.flush_jobs_max:
                break
            replica = self.replicas[key]
            if replica.retry_at > now or key in self._discarding or self._held(replica, now):
                continue
            del self._dirty[key]
            jobs.append(self._flush_job(replica))
        return jobs

    def _held(self, replica: Replica, now: float) -> bool:
        """Whether the replica's flush waits for more bytes (flush_delay_s): its unflushed bytes
        are few, recent, and no write waits for them on disk. One fdatasync (and one metadata
        record, and its fdatasync) per flush made a backup's flusher thread cost as much as its
        main loop for small writes (issue 15: 15% of a core each with 1 KiB chunks)."""
        since = self._dirty_since.get(replica.key)
        cfg = self.config
        return (cfg.flush_delay_s > 0 and since is not None and now - since < cfg.flush_delay_s
                and replica.length - replica.flushed_length < cfg.flush_batch_bytes
                and replica.key not in self._waiters)

    def _flush_job(self, replica: Replica) -> FlushJob:
        buffers = replica.slice(replica.flushed_length, self.config.flush_job_max_bytes)
        end = replica.flushed_length + sum(map(len, buffers))
        closed = replica.closed and end == replica.length
        replica.flushing = True
        self.flush_jobs_out += 1
        key = replica.key
        self._dirty_since.pop(key, None)
        return FlushJob(key, replica.flushed_length, tuple(buffers),
                        Meta(key[0], key[1], key[2], end, closed))

    def flush_done(self, job, error: Exception | None, now: float) -> list[Reply]:
        """Record a flush (or DropJob) outcome; returns the deferred replies it settles."""
        if isinstance(job, DropJob):
            self.flush_jobs_out -= 1
            if error is not None:
                self.counters.add("drop_errors")
                log.error("removing the files of dropped %s failed: %s", describe(job.key), error)
            return []
        if job.key in self._discarding:
            # A flush of content reset while it ran: now its files can go, ahead of any flush
            # of the new content (DropJobs are handed out first, and the flusher keeps order).
            self._discarding.discard(job.key)
            self.flush_jobs_out -= 1
            self._drop_jobs.append(DropJob(job.key))
            return []
        replies = self._flush_done(job, error, now)
        if job.key in self._drop_pending:
            self._drop_pending.discard(job.key)
            replies += self._remove(self.replicas[job.key])
        return replies

    def _flush_done(self, job: FlushJob, error: Exception | None, now: float) -> list[Reply]:
        replica = self.replicas[job.key]
        assert replica.flushing and job.offset == replica.flushed_length
        replica.flushing = False
        self.flush_jobs_out -= 1
        if error is not None:
            return self._flush_failed(replica, error, now)
        replica.flushed_length = job.meta.length
        replica.disk_closed = job.meta.closed
        if not replica.on_disk:
            replica.on_disk = True
            self.replicas_on_disk += 1
        if replica.failed:
            replica.failed = None
            self.replicas_failed -= 1
        replica.failures = 0
        replica.retry_at = 0.0
        self.unflushed_bytes -= job.size
        self.counters.add("flushes")
        self.counters.add("flush_bytes", job.size)
        if replica.closed and replica.disk_closed:
            self._drop_flushed(replica)  # closed and on disk: its memory is no longer needed
        self._mark(replica)
        return self._settle(replica)

    def _flush_failed(self, replica: Replica, error: Exception, now: float) -> list[Reply]:
        replica.failures += 1
        if not replica.failed:
            self.replicas_failed += 1
        replica.failed = f"{error.__class__.__name__}: {error}"
        delay = min(self.config.flush_retry_s * 2 ** (replica.failures - 1), self.config.flush_retry_max_s)
        replica.retry_at = now + delay
        self.counters.add("storage_errors")
        log.error("flushing %s failed (retry in %.1f s): %s", describe(replica.key), delay, replica.failed)
        self._mark(replica)
        err = StorageError(f"{describe(replica.key)} could not be written to disk: {replica.failed}")
        return [(w.token, err) for w in self._waiters.pop(replica.key, [])]

    def _settle(self, replica: Replica) -> list[Reply]:
        waiters = self._waiters.get(replica.key)
        if not waiters:
            return []
        done = [w for w in waiters if replica.durable(w.end, w.closed)]
        if done:
            waiting = [w for w in waiters if not replica.durable(w.end, w.closed)]
            if waiting:
                self._waiters[replica.key] = waiting
            else:
                del self._waiters[replica.key]
        return [(w.token, w.end) for w in done]

    def idle(self) -> bool:
        """Nothing waits for the disk and no flush is out (pending retries after a failure
        still count as work)."""
        return not self._dirty and not self.flush_jobs_out and not self._drop_jobs

    def stuck(self) -> bool:
        """No flush is out and everything left to flush belongs to replicas whose disk fails:
        waiting longer at shutdown would not help."""
        return not self.flush_jobs_out and all(self.replicas[k].failed for k in self._dirty)

    def abandon_waiters(self, reason: str) -> list[Reply]:
        """Every deferred reply, answered with NotReady (at shutdown)."""
        replies = [(w.token, NotReady(reason)) for ws in self._waiters.values() for w in ws]
        self._waiters.clear()
        return replies

    # ------------------------------------------------------------------ dropping
    def drop(self, key: Key) -> tuple[bool, list[Reply]]:
        """`drop_replica`: the broker no longer references any chunk of the replica. Frees its
        memory and queues the removal of its files (after a flush in flight, if any). Returns
        (whether the replica was known, replies to fail: writes waiting for the disk)."""
        replica = self.replicas.get(key)
        if replica is None:
            return False, []
        if replica.flushing:
            self._drop_pending.add(key)
            return True, []
        return True, self._remove(replica)

    def _remove(self, replica: Replica, why: str = "dropped") -> list[Reply]:
        key = replica.key
        del self.replicas[key]
        self._forget_count(key)
        self.disk_bytes -= replica.length + REPLICA_OVERHEAD_BYTES
        self.memory_bytes -= replica.memory_bytes
        self.unflushed_bytes -= replica.unflushed_bytes
        self._dirty.pop(key, None)
        self._dirty_since.pop(key, None)
        self._resident.pop(key, None)
        self.replicas_open -= not replica.closed
        self.replicas_on_disk -= replica.on_disk
        self.replicas_failed -= bool(replica.failed)
        if replica.flushing:
            self._discarding.add(key)   # the files go once that flush is done (flush_done)
        elif key not in self._discarding:
            self._drop_jobs.append(DropJob(key))
        self.counters.add(f"replicas_{why}")
        err = BadRequest(f"{describe(key)} was {why}")
        return [(w.token, err) for w in self._waiters.pop(key, [])]

    def _forget_count(self, key: Key) -> None:
        held = self.replicas_per_broker[key[0]] - 1
        if held:
            self.replicas_per_broker[key[0]] = held
        else:
            del self.replicas_per_broker[key[0]]

    # ------------------------------------------------------------------ resetting
    def reset(self, key: Key, offset: int, frames) -> list[Reply]:
        """`replicate` with `reset`: the broker, the replica's only writer, (re)starts it from
        offset 0, so whatever is stored of it is discarded before the write (`replicate`, called
        next) becomes its content. Memory goes at once; the files are removed by the flusher
        (metadata record first) after a flush of the old content in flight, if any, and before
        any flush of the new one, so a crash leaves the old replica, none, or a prefix of the
        new one. The write's chunks are verified first: a corrupt write changes nothing.
        Returns the replies to fail: writes of the discarded content waiting for the disk."""
        if offset:
            raise BadRequest(f"a reset write starts at offset 0, not {offset} ({describe(key)})")
        replica = self.replicas.get(key)
        if replica is None:
            return []
        try:
            split_chunks(frames)
        except KeraError:
            self.counters.add("chunks_rejected", len(frames))
            raise
        self._drop_pending.discard(key)   # a drop asked for during a flush: this removal does it
        log.info("%s reset by its broker: %d bytes discarded", describe(key), replica.length)
        return self._remove(replica, "reset")

    # ------------------------------------------------------------------ reading back

    def read(self, key: Key, offset: int, max_bytes: int) -> list[memoryview] | DiskRead:
        """Whole chunks from `offset` (a chunk boundary) up to `max_bytes`, at least one when
        any is stored: the chunks themselves when in memory, else the DiskRead to run."""
        replica = self.replicas.get(key)
        if replica is None:
            raise BadRequest(f"unknown {describe(key)}")
        if offset > replica.length:
            raise OffsetOutOfRange(f"{describe(key)} holds {replica.length} bytes, not {offset}")
        self.counters.add("reads")
        if offset < replica.memory_from:
            return DiskRead(key, offset, replica.memory_from, max_bytes)
        chunks = replica.slice(offset, max_bytes)
        self.counters.add("read_bytes", sum(map(len, chunks)))
        return chunks

    def list_replicas(self, broker_id: int) -> list[dict]:
        return [{"broker_id": r.key[0], "vlog": r.key[1], "vseg": r.key[2], "length": r.length,
                 "closed": r.closed, "memory_from": r.memory_from, "disk_length": r.flushed_length,
                 "in_memory": r.memory_bytes > 0, "on_disk": r.on_disk}
                for key, r in sorted(self.replicas.items()) if key[0] == broker_id]

    def load(self, meta: Meta) -> None:
        """Adopt a replica found on disk at startup: all of its bytes are on disk only."""
        key = (meta.broker_id, meta.vlog, meta.vseg)
        assert key not in self.replicas, key
        replica = self._new_replica(key)
        self.disk_bytes += meta.length
        replica.length = replica.flushed_length = replica.memory_from = meta.length
        replica.closed = replica.disk_closed = meta.closed
        replica.on_disk = True
        self.replicas_on_disk += 1
        self.replicas_open += not meta.closed

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        out = dict.fromkeys(("replicate_writes", "chunks_received", "bytes_received",
                             "chunks_rejected", "flushes", "flush_bytes", "throttled",
                             "storage_errors", "repeated_chunks", "reads", "read_bytes"), 0)
        out.update(self.counters)
        writes = out["replicate_writes"]
        out["chunks_per_replicate_write"] = out["chunks_received"] / writes if writes else 0.0
        out["unflushed_bytes"] = self.unflushed_bytes   # the backup's durable-head lag
        out["memory_bytes"] = self.memory_bytes
        out["flush_jobs_out"] = self.flush_jobs_out
        out["replicas"] = len(self.replicas)
        out["replicas_open"] = self.replicas_open
        out["replicas_on_disk"] = self.replicas_on_disk
        out["replicas_failed"] = self.replicas_failed
        out["disk_bytes"] = self.disk_bytes
        out["disk_limit_bytes"] = self.config.disk_limit_bytes
        return out
