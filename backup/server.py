"""The backup daemon: a kera.net.server loop around the ReplicaStore, a flusher and a reader thread.

Ops (docs/PROTOCOL.md, backup table): `replicate`, `list_replicas`, `read_replica`, `stats`.
The loop never touches a file: flush jobs go to the flusher thread, reads of bytes that left
memory to the reader thread; both report back through kera.backup.worker, whose wake-up pipe
sits in the loop's poller.

Standalone: `python -m kera.backup --coordinator HOST:PORT --dir DIR [--port N]`, or from
Python: `from kera.backup import server; server.main([...])`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from pathlib import Path

import zmq

from kera import config
from kera.net import security as daemon_security
from kera.config import MiB
from kera.errors import (BadRequest, CorruptChunk, KeraError, NotAuthorized, NotReady,
                         StorageError, Throttled)

from kera.daemon.metrics import serve_metrics
from kera.daemon.env import DaemonEnv, real_if_none
from kera.daemon.flags import add_common_arguments, setup_logging, size_bytes
from kera.net.server import DEFERRED, Request

from kera.backup.broker_keys import BrokerKeys
from kera.backup.incarnations import Incarnations, keep, parse_fence, parse_filter
from kera.daemon.coordinator_link import CoordinatorLink, LinkHooks
from kera.daemon.coordinator_session import CoordinatorSession
from kera.daemon.identity import Identity
from kera.backup.store import DiskRead, FlushJob, ReplicaStore, StoreConfig
from kera.backup.worker import expected
from kera.codec.vseg import epoch_of

log = logging.getLogger(__name__)

U32_MAX = 2**32 - 1
READS_IN_FLIGHT_MAX = 16           # disk reads queued on the reader thread
READ_MAX_BYTES = 64 * MiB          # one read_replica reply, at most (plus one chunk)
SHUTDOWN_FLUSH_TIMEOUT_S = 30.0    # at SIGTERM, how long to keep flushing what is buffered
FLUSH_POLL_INTERVAL_S = 0.05       # retry flushes that failed / were over the job bound
# The daemon's group-commit window for "memory" writes (StoreConfig.flush_delay_s): with 1 KiB
# chunks each backup's flusher spent 15% of a core on a flush per write; memory durability
# acknowledges before the disk anyway, so the disk copy may lag this much (plus a poll).
FLUSH_DELAY_MS = 50
# The counters the metrics thread serves: a scrape every few seconds needs no fresher copy,
# and an idle backup should not compute them ten times a second.
METRICS_SNAPSHOT_INTERVAL_S = 1.0


class BackupDaemon:
    """The backup's handlers and background work, on the shell it holds (`self.server`)."""

    def __init__(self, root: Path, store_config: StoreConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, security: daemon_security.Security | None = None,
                 env: DaemonEnv | None = None):
        self.env = env = real_if_none(env)
        self.clock = env.clock
        self.server = server = env.server("backup", host, port, security)
        self.broker_keys = BrokerKeys()   # which principal each broker id is (secure clusters)
        self.root = root
        self.store = ReplicaStore(store_config)
        # Fencing and freeing the replicas of dead broker incarnations (failover).
        self.incarnations = Incarnations(self.store)
        self.draining = False
        self._reads_in_flight = 0
        self._snapshot: dict = {}
        # While metrics are served: the flush latency histogram, and when each flush job in
        # the flusher's hands (at most flush_jobs_max) was handed over, by id(job).
        self.flush_latency = None
        self._flush_started: dict[int, float] = {}
        disk = env.backup_disk
        for record in disk.scan(root):
            self.store.load(record)
        if self.store.replicas:
            log.info("found %d replicas on disk under %s", len(self.store.replicas), root)
        self.flusher = env.worker("backup-flusher", lambda job: disk.run(root, job),
                                  self.store.config.flush_jobs_max)
        self.reader = env.worker("backup-reader", lambda job: disk.read_chunks(root, job[0]),
                                 READS_IN_FLIGHT_MAX)
        for worker in (self.flusher, self.reader):
            server.poller.register(worker.wake_fd, zmq.POLLIN)
        server.on("replicate", self.handle_replicate)
        server.on("list_replicas", self.handle_list_replicas)
        server.on("read_replica", self.handle_read_replica)
        server.on("drop_replica", self.handle_drop_replica)
        server.on("stats", lambda req: {"stats": self.stats()})
        server.after_batch.append(self.schedule_flushes)
        # The workers' completions, after every turn (their wake-up pipes end the loop's wait).
        server.after_turn.append(self.collect)
        server.every(FLUSH_POLL_INTERVAL_S, self.schedule_flushes)
        server.every(METRICS_SNAPSHOT_INTERVAL_S, self._refresh_snapshot)
        self.link: CoordinatorLink | None = None    # set by connect_coordinator

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop()

    # ------------------------------------------------------------------ handlers
    def handle_replicate(self, req: Request):
        f = req.fields
        key = (f.int("broker_id"), f.int("vlog", hi=U32_MAX), f.int("vseg"))
        self.broker_keys.check(req.principal, key[0], "write")
        offset = f.int("offset")
        durability = f.str("durability", config.DEFAULT_DURABILITY, hi=16)
        close = f.bool("close", False)
        reset = f.bool("reset", False)
        if self.draining:
            raise NotReady("backup is shutting down")
        if self.incarnations.blocked(key):
            raise NotReady(f"broker {key[0]} epoch {epoch_of(key[2])} was failed over: "
                           f"its writes are refused")
        frames = [frame.buffer for frame in req.frames]
        if reset:   # the broker restarts the replica from 0: what is stored of it goes first
            for token, err in self.store.reset(key, offset, frames):
                self.server.fail(token, err)
        length = self.store.replicate(key, offset, frames, durability, close, req, self.clock.monotonic())
        if length is None:
            return DEFERRED
        return {"length": length}

    def handle_drop_replica(self, req: Request):
        """The broker references no chunk of the replica any more (retention, stream deleted):
        free its memory and files. Idempotent: `dropped` is false for an unknown replica."""
        f = req.fields
        key = (f.int("broker_id"), f.int("vlog", hi=U32_MAX), f.int("vseg"))
        self.broker_keys.check(req.principal, key[0], "drop")
        known, replies = self.store.drop(key)
        for token, err in replies:
            self.server.fail(token, err)
        self.schedule_flushes()
        return {"dropped": known}

    def handle_list_replicas(self, req: Request):
        broker_id = req.fields.int("broker_id")
        # A recovery lists with `fence`: those incarnations may write no more.
        fence = parse_fence(req.fields)
        if fence and req.principal is not None and req.principal.role != "broker":
            raise NotAuthorized(f"principal {req.principal} may list replicas but not fence "
                                f"broker {broker_id}: fencing is a recovering broker's")
        self.broker_keys.check_fence(req.principal, broker_id, fence,
                                     req.fields.list("fence_tokens", None,
                                                     max_len=len(fence) or 1))
        self.incarnations.fence(broker_id, fence)
        return {"replicas": self.store.list_replicas(broker_id)}

    def handle_read_replica(self, req: Request):
        f = req.fields
        key = (f.int("broker_id"), f.int("vlog", hi=U32_MAX), f.int("vseg"))
        offset = f.int("offset")
        max_bytes = f.int("max_bytes", lo=1, hi=READ_MAX_BYTES)
        wanted = parse_filter(f)   # only these streamlets' chunks (a recovery's read)
        result = self.store.read(key, offset, max_bytes)
        replica = self.store.replicas[key]
        if isinstance(result, DiskRead):
            if self._reads_in_flight >= READS_IN_FLIGHT_MAX:
                raise Throttled(f"{READS_IN_FLIGHT_MAX} disk reads already in flight")
            self._reads_in_flight += 1
            self.reader.submit((result, req, wanted))
            return DEFERRED
        end = offset + sum(map(len, result))
        return {"length": replica.length, "closed": replica.closed, "end": end}, keep(result, wanted)

    # ------------------------------------------------------------------ background work
    def schedule_flushes(self) -> None:
        now = self.clock.monotonic()
        for job in self.store.take_flush_jobs(now):
            if self.flush_latency is not None and isinstance(job, FlushJob):
                self._flush_started[id(job)] = now
            self.flusher.submit(job)

    def collect(self) -> None:
        """Answer what the flusher and reader threads finished."""
        now = self.clock.monotonic()
        for job, _, error in self.flusher.completions():
            self._flushed(job, error, now)
        for (read, req, wanted), chunks, error in self.reader.completions():
            self._reads_in_flight -= 1
            self._answer_read(read, req, chunks, error, wanted)

    def _flushed(self, job: FlushJob, error: Exception | None, now: float) -> None:
        error = expected(error, OSError)   # anything else is a bug: the daemon stops
        started_s = self._flush_started.pop(id(job), None)
        if started_s is not None and error is None:
            self.flush_latency.observe(now - started_s)
        for req, outcome in self.store.flush_done(job, error, now):
            if isinstance(outcome, KeraError):
                self.server.fail(req, outcome)
            else:
                self.server.reply(req, {"length": outcome})
        self.schedule_flushes()

    def _answer_read(self, read: DiskRead, req: Request, chunks, error: Exception | None,
                     wanted: set | None = None) -> None:
        if error is not None and not isinstance(error, (CorruptChunk, OSError)):
            # A bug: its client hears why, then the daemon stops (kera.net.server).
            self.server.fail(req, KeraError(f"internal error in {self.server.name}, which is "
                                            f"stopping: {error!r}"))
            expected(error)
        if error is not None:
            if isinstance(error, CorruptChunk):
                log.error("replica %s on disk failed verification: %s", read.key, error)
                self.store.counters.add("disk_chunks_corrupt")
                self.server.fail(req, error)
            else:
                self.store.counters.add("storage_errors")
                self.server.fail(req, StorageError(f"reading {read.key} failed: {error}"))
            return
        size = sum(map(len, chunks))
        self.store.counters.add("read_bytes", size)
        self.store.counters.add("disk_read_bytes", size)
        replica = self.store.replicas.get(read.key)
        if replica is None:   # dropped while it was read
            self.server.fail(req, BadRequest(f"replica {read.key} was dropped"))
            return

        self.server.reply(req, {"length": replica.length, "closed": replica.closed, "end": read.offset + size},
                   keep(chunks, wanted))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        out = self.store.stats()
        out["reads_in_flight"] = self._reads_in_flight
        if self.link is not None:
            session = self.link.session
            out["registered"] = session.registered
            out["backup_id"] = session.wanted_id if session.wanted_id is not None else -1
        return out

    def heartbeat_stats(self) -> dict:
        """The few figures sent with each heartbeat (the coordinator may use them for placement)."""
        store = self.store
        return {"unflushed_bytes": store.unflushed_bytes, "memory_bytes": store.memory_bytes,
                "replicas": len(store.replicas)}

    def heartbeat_fields(self) -> dict:
        """`held`: the broker incarnations this backup holds replicas of (see
        kera.backup.incarnations); the coordinator answers with those it may free."""
        # A backup applies no stream metadata: version 0.
        return {"metadata_version": 0, "stats": self.heartbeat_stats(),
                "held": self.incarnations.held()}

    def connect_coordinator(self, bootstrap: str, address: str, node: str,
                            daemon_id: int | None, identity: Identity) -> None:
        """Register with the coordinator at `bootstrap` and heartbeat (kera.daemon.coordinator_link);
        a refusal of this backup's identity stops it."""
        session = CoordinatorSession("backup", address, node, identity, daemon_id)
        self.link = CoordinatorLink(self.server, bootstrap, session, LinkHooks(
            heartbeat_fields=self.heartbeat_fields, on_registered=lambda daemon_id: None,
            on_heartbeat=self.heartbeat_reply, on_fatal=lambda err: self.stop()))
        self.link.start()

    def heartbeat_reply(self, header: dict, sent: dict | None = None) -> None:
        if "broker_principals" in header:
            self.broker_keys.update(header["broker_principals"])
        self.broker_keys.update_fence_key(header.get("fence_key"))
        free = header.get("free")
        if free:
            for token, err in self.incarnations.free(free):
                self.server.fail(token, err)
            self.schedule_flushes()

    def _refresh_snapshot(self) -> None:
        self._snapshot = self.stats()  # replaced whole: the metrics thread reads it lock-free

    def metrics_snapshot(self) -> dict:
        return self._snapshot

    # ------------------------------------------------------------------ lifecycle
    def serve(self, shutdown_timeout_s: float = SHUTDOWN_FLUSH_TIMEOUT_S) -> None:
        """Run until stop(); then stop taking writes, flush what is buffered (answering the
        writes that wait for it) for at most `shutdown_timeout_s`, and close."""
        log.info("backup serving on %s, data in %s", self.address, self.root)
        try:
            while not self.server.stopping:
                self.server.run_once()
            self.draining = True
            deadline = self.clock.monotonic() + shutdown_timeout_s
            self.schedule_flushes()
            # (A bug stopped the loop: nothing more runs, so there is nothing to wait for.)
            while not self.store.idle() and not self.store.stuck() and \
                    self.server.failure is None and self.clock.monotonic() < deadline:
                self.server.run_once(0.01)
            if not self.store.idle():
                log.warning("stopping with %d bytes not flushed", self.store.unflushed_bytes)
            for req, err in self.store.abandon_waiters("backup stopped"):
                self.server.fail(req, err)
        finally:
            self.flusher.close()
            self.reader.close()
            self.server.close()
        log.info("backup stopped")


# ---------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = StoreConfig()
    add_common_arguments(parser)
    parser.add_argument("--dir", required=True, type=Path, help="data directory for replica files")
    parser.add_argument("--node", default=socket.gethostname(),
                        help="host identity for placement (default: the hostname)")
    parser.add_argument("--id", type=int, default=None, help="register again under this backup id")
    parser.add_argument("--max-unflushed-bytes", type=size_bytes, default=defaults.max_unflushed_bytes,
                        help="bytes received and not yet on disk before writes are throttled "
                             "(default: %(default)s)")
    parser.add_argument("--max-memory-bytes", type=size_bytes, default=defaults.max_memory_bytes,
                        help="bytes of replicas held in memory before writes are throttled "
                             "(at least --max-unflushed-bytes; default: %(default)s)")
    parser.add_argument("--max-replica-bytes", type=size_bytes, default=defaults.max_replica_bytes,
                        help="largest replica (virtual segment) accepted (default: %(default)s)")
    parser.add_argument("--flush-delay-ms", type=float, default=FLUSH_DELAY_MS,
                        help="how long bytes written with durability 'memory' may wait to be "
                             "flushed to disk together with later ones (one fdatasync for "
                             "many small writes); 'disk' writes are flushed at once; 0 flushes "
                             "every write at once (default: %(default)s)")
    parser.add_argument("--disk-limit", type=size_bytes, default=0, metavar="BYTES",
                        help="replica bytes this backup keeps on disk (e.g. 100GiB); a write "
                             "past it is refused with storage_error and the broker places the "
                             "virtual segment elsewhere (default: 0, as much as the disk holds)")
    parser.add_argument("--max-replicas-per-broker", type=int,
                        default=defaults.replicas_per_broker_max,
                        help="replicas of one broker held at once (at most %(default)s)")
    parser.add_argument("--max-replicas", type=int, default=defaults.replicas_max,
                        help="replicas held at once, all brokers (default: %(default)s)")
    daemon_security.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    setup_logging(args)
    try:
        store_config = StoreConfig(max_replica_bytes=args.max_replica_bytes,
                                   max_unflushed_bytes=args.max_unflushed_bytes,
                                   max_memory_bytes=max(args.max_memory_bytes,
                                                        args.max_unflushed_bytes),
                                   disk_limit_bytes=args.disk_limit,
                                   flush_delay_s=args.flush_delay_ms / 1000.0,
                                   replicas_per_broker_max=args.max_replicas_per_broker,
                                   replicas_max=args.max_replicas)
        store_config.check()
        args.dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load(args.dir)
        identity.expect_cluster(args.cluster_id)
        daemon = BackupDaemon(args.dir, store_config, args.host, args.port,
                              daemon_security.from_args(args, "backup"))
    except KeraError as err:   # a key file refused
        log.error("cannot start the backup: %s", err.message)
        return 2
    except (ValueError, OSError, zmq.ZMQError) as err:
        log.error("cannot start the backup: %s", err)
        return 1
    daemon.connect_coordinator(args.coordinator, args.advertise or daemon.address, args.node,
                               args.id, identity)
    metrics = None
    if args.metrics_port:
        metrics = serve_metrics(args.metrics_port, "kera_backup", daemon.metrics_snapshot,
                                {"address": daemon.address}, host=args.metrics_host)
        daemon.flush_latency = metrics.histogram(
            "flush_latency_seconds", "a flush job (write and fsync of a replica's buffered "
            "bytes) from its hand-off to the flusher thread to its completion")
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: daemon.stop())
    print(f"kera backup listening on {daemon.address}", flush=True)
    try:
        daemon.serve()
    finally:
        if metrics is not None:
            metrics.shutdown()
    # A bug stopped it (logged with its stack), or its identity was refused.
    return 1 if daemon.server.failure is not None or daemon.link.session.fatal else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kera-backup", description="kera backup daemon")
    add_arguments(parser)
    return run(parser.parse_args(argv))
