"""The broker daemon's side of tiering, retention and restart from disk (the I/O around the
sans-IO core's kera.broker.tier / retention / reload):

- at start: the segment files found in the data dir, verified (kera.broker.reload);
- every loop turn: `read_replica` requests for damaged tiered chunks (kera.broker.repair);
- every loop turn: the wall and monotonic clocks into the core (retention's clock), tier jobs to the tier thread, their outcomes
  back;
- every RETENTION_INTERVAL_S: retention, and `drop_replica` requests to backups (retried a few
  times: a backup that never hears of a drop keeps a useless replica, nothing worse);
- at an orderly stop: the tier thread drained, then every durable segment still in memory
  written, so a restart from this directory has every durable chunk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import zmq

from kera.backup.worker import Worker, expected
from kera.daemon import durable
from kera.daemon.env import DaemonEnv
from kera.broker import reload, tier_files
from kera.broker.repair import REPAIR_READ_TIMEOUT_S, RepairRead
from kera.broker.retention import ReplicaDrop
from kera.errors import StorageError


log = logging.getLogger(__name__)

RETENTION_INTERVAL_S = 0.5
DROP_TIMEOUT_S = 2.0
DROP_ATTEMPTS_MAX = 5
DROP_RETRY_S = 1.0
SHUTDOWN_DRAIN_TIMEOUT_S = 30.0
# How often the shutdown drain looks at the tier thread's completions: short next to the
# writes it waits for, long enough not to spin a core.
SHUTDOWN_POLL_S = 0.005
CLEAN_SHUTDOWN_FILE = "clean_shutdown"



class TierHost(Protocol):
    """What tiering, retention and restart need of the broker core (kera.broker.core.Broker)."""
    tier: object           # kera.broker.tier.Tier: the data dir and its segment files
    pool: object           # kera.broker.backups.BackupPool: is a backup alive
    counters: object       # kera.daemon.metrics.Counters
    clean_restart: bool
    reloaded: object

    def set_wall_clock(self, wall_ms: int, mono_ms: int | None = None) -> None: ...
    def enforce_retention(self, wall_ms: int | None = None, mono_ms: int | None = None) -> int: ...
    def take_tier_jobs(self, now: float) -> list: ...
    def tier_job_done(self, job, error: Exception | None, now: float) -> None: ...
    def take_live_writes(self) -> list: ...
    def live_written(self, write, error: Exception | None) -> None: ...
    def take_replica_drops(self) -> list: ...
    def take_repair_reads(self) -> list: ...
    def repair_read_done(self, req, header, frames, error) -> None: ...


class TierService:
    def __init__(self, core: TierHost, server, env: DaemonEnv):
        self.core = core
        self.server = server
        self.clock = env.clock
        self.root: Path | None = core.tier.root
        self.worker: Worker | None = None
        self.live_files: tier_files.LiveFiles | None = None
        self._drops: list[tuple[float, int, ReplicaDrop]] = []   # (due, attempt, drop)
        # An orderly stop wrote every durable segment and left this marker: the reload is then
        # complete (kept for whoever decides between the reload and recovery from backups).
        self.clean_restart = False
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            marker = self.root / CLEAN_SHUTDOWN_FILE
            self.clean_restart = tier_files.marker_ok(marker)
            durable.unlink_durable(marker)
            core.clean_restart = self.clean_restart
            loaded = reload.load_dir(self.root)
            if not loaded.empty:
                core.reloaded = loaded
            if loaded.corrupt:
                core.counters.add("reload_corrupt_segments", loaded.corrupt)
            root = self.root
            self.live_files = tier_files.LiveFiles(root)
            self.worker = env.worker("broker-tier", lambda job: tier_files.run(root, job),
                                 core.tier.cfg.jobs_max)
            server.poller.register(self.worker.wake_fd, zmq.POLLIN)
            log.info("data dir %s, memory limit %d bytes", root, core.tier.cfg.memory_limit_bytes)
        server.every(RETENTION_INTERVAL_S, self.retention)

    # ------------------------------------------------------------------ every turn
    def pump(self) -> None:
        core = self.core
        core.set_wall_clock(int(self.clock.time() * 1000), int(self.clock.monotonic() * 1000))
        if self.worker is None:
            return
        now = self.clock.monotonic()
        self.live_files.close_idle(now)
        for req in core.repairs.take_requests():
            self._send_repair(req)
        for job, _, error in self.worker.completions():
            # A write may fail with OSError; anything else is a bug, which stops the daemon.
            core.tier.job_done(job, expected(error, OSError), now)
        for job in core.tier.take_jobs(now):
            self.worker.submit(job)

    # ------------------------------------------------------------------ R=1 before the ack
    def write_live(self) -> None:
        """Write this produce's R=1 chunks to their segment files (page cache) before its
        reply goes; a failed write fails the request (retriable: its retry is a duplicate,
        acknowledged only once a later write succeeded)."""
        failed = None
        now = self.clock.monotonic()
        for w in self.core.tier.take_live_writes():
            try:
                self.live_files.write(w, now)
                self.core.tier.live_written(w, None)
            except OSError as err:
                self.core.tier.live_written(w, err)
                failed = err
        if failed is not None:
            log.error("could not write R=1 chunks to %s: %s", self.root, failed)
            raise StorageError(f"could not write to the broker's data dir ({failed}): retry; "
                               f"if it persists, free or repair {self.root}", retriable=True)

    # ------------------------------------------------------------------ retention
    def retention(self) -> None:
        core = self.core
        core.enforce_retention(int(self.clock.time() * 1000), int(self.clock.monotonic() * 1000))
        now = self.clock.monotonic()
        for drop in core.retention.take_drops():
            self._drops.append((now, 1, drop))
        due = [d for d in self._drops if d[0] <= now]
        if due:
            self._drops = [d for d in self._drops if d[0] > now]
            for _, attempt, drop in due:
                self._send_drop(drop, attempt)

    def _send_drop(self, drop: ReplicaDrop, attempt: int) -> None:
        if not self.core.pool.alive(drop.backup_id):
            return   # a dead backup's replicas are the coordinator's and its restart's business

        def done(header, frames, error, drop=drop, attempt=attempt):
            if error is None:
                self.core.counters.add("replica_drops_sent")
                return
            if attempt >= DROP_ATTEMPTS_MAX:
                log.warning("backup %d (%s) did not drop replica %s: %s: %s", drop.backup_id,
                            drop.address, drop.fields, error.code, error.message)
                return
            self._drops.append((self.clock.monotonic() + DROP_RETRY_S, attempt + 1, drop))

        self.server.peer(drop.address).request("drop_replica", drop.fields, [], DROP_TIMEOUT_S, done)

    def _send_repair(self, req: RepairRead) -> None:
        def done(header, frames, error, req=req):
            self.core.repairs.done(req, header, frames, error)

        self.server.peer(req.address).request("read_replica", req.fields, [],
                                              REPAIR_READ_TIMEOUT_S, done)

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Drain the tier thread, then write every durable segment still in memory."""
        if self.worker is None:
            return
        self.live_files.close()
        core = self.core
        deadline = self.clock.monotonic() + SHUTDOWN_DRAIN_TIMEOUT_S
        while core.tier.jobs_out and self.clock.monotonic() < deadline:
            for job, _, error in self.worker.completions():
                core.tier.job_done(job, error, self.clock.monotonic())
            if core.tier.jobs_out:
                self.clock.sleep(SHUTDOWN_POLL_S)
        self.worker.close()
        written = 0
        failed = bool(core.tier.jobs_out)
        started = self.clock.monotonic()
        for job in core.tier.shutdown_jobs():
            try:
                tier_files.run(self.root, job)
                written += job.nbytes
            except OSError as err:
                failed = True
                log.error("could not write segment %s at shutdown: %s", job.record.key, err)
        try:
            synced = tier_files.sync_live_segments(self.root)
        except OSError as err:
            failed, synced = True, 0
            log.error("could not sync the R=1 segment files in %s at shutdown: %s", self.root, err)
        log.info("wrote %d bytes of segments and synced %d R=1 segments to %s at shutdown in "
                 "%.2f s", written, synced, self.root, self.clock.monotonic() - started)
        if not failed:
            tier_files.write_marker(self.root / CLEAN_SHUTDOWN_FILE)
