"""The backup daemon: a kera.server loop around the ReplicaStore, a flusher and a reader thread.

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
import sys
import threading
import time
from pathlib import Path

import zmq

from kera import config
from kera import security as daemon_security
from kera.config import MiB
from kera.errors import (BadRequest, CorruptChunk, KeraError, NotAuthorized, NotReady,
                         StorageError, Throttled)

from kera.broker.memory import parse_size
from kera.metrics import serve_metrics
from kera.server import DEFERRED, Request, Server

from kera.backup import disk
from kera.backup.broker_keys import BrokerKeys
from kera.backup.incarnations import Incarnations, keep, parse_fence, parse_filter
from kera.backup.registration import Registration
from kera.identity import Identity
from kera.backup.store import DiskRead, FlushJob, ReplicaStore, StoreConfig
from kera.backup.worker import Worker

log = logging.getLogger(__name__)

U32_MAX = 2**32 - 1
READS_IN_FLIGHT_MAX = 16           # disk reads queued on the reader thread
READ_MAX_BYTES = 64 * MiB          # one read_replica reply, at most (plus one chunk)
SHUTDOWN_FLUSH_TIMEOUT_S = 30.0    # at SIGTERM, how long to keep flushing what is buffered
FLUSH_POLL_INTERVAL_S = 0.05       # retry flushes that failed / were over the job bound
# The counters the metrics thread serves: a scrape every few seconds needs no fresher copy,
# and an idle backup should not compute them ten times a second.
METRICS_SNAPSHOT_INTERVAL_S = 1.0


class BackupServer(Server):
    def __init__(self, root: Path, store_config: StoreConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, security: daemon_security.Security | None = None):
        super().__init__("backup", host, port, security)
        self.broker_keys = BrokerKeys()   # which principal each broker id is (secure clusters)
        self.root = root
        self.store = ReplicaStore(store_config)
        # Fencing and freeing the replicas of dead broker incarnations (failover).
        self.incarnations = Incarnations(self.store)
        self.draining = False
        self._reads_in_flight = 0
        self._snapshot: dict = {}
        for record in disk.scan(root):
            self.store.load(record)
        if self.store.replicas:
            log.info("found %d replicas on disk under %s", len(self.store.replicas), root)
        self.flusher = Worker("backup-flusher", lambda job: disk.run(root, job),
                              self.store.config.flush_jobs_max)
        self.reader = Worker("backup-reader", lambda job: disk.read_chunks(root, job[0]),
                             READS_IN_FLIGHT_MAX)
        for worker in (self.flusher, self.reader):
            self.poller.register(worker.wake_fd, zmq.POLLIN)
        self.on("replicate", self.handle_replicate)
        self.on("list_replicas", self.handle_list_replicas)
        self.on("read_replica", self.handle_read_replica)
        self.on("drop_replica", self.handle_drop_replica)
        self.on("stats", lambda req: {"stats": self.stats()})
        self.after_batch.append(self.schedule_flushes)
        self.every(FLUSH_POLL_INTERVAL_S, self.schedule_flushes)
        self.every(METRICS_SNAPSHOT_INTERVAL_S, self._refresh_snapshot)
        self.registration: Registration | None = None

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
            raise NotReady(f"broker {key[0]} epoch {key[2] >> 32} was failed over: "
                           f"its writes are refused")
        frames = [frame.buffer for frame in req.frames]
        if reset:   # the broker restarts the replica from 0: what is stored of it goes first
            for token, err in self.store.reset(key, offset, frames):
                self.fail(token, err)
        length = self.store.replicate(key, offset, frames, durability, close, req, time.monotonic())
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
            self.fail(token, err)
        self.schedule_flushes()
        return {"dropped": known}

    def handle_list_replicas(self, req: Request):
        broker_id = req.fields.int("broker_id")
        # A recovery lists with `fence`: those incarnations may write no more.
        fence = parse_fence(req.fields)
        if fence and req.principal is not None and req.principal.role != "broker":
            raise NotAuthorized(f"principal {req.principal} may list replicas but not fence "
                                f"broker {broker_id}: fencing is a recovering broker's")
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
        for job in self.store.take_flush_jobs(time.monotonic()):
            self.flusher.submit(job)

    def run_once(self, max_wait_s: float = 0.05) -> None:
        super().run_once(max_wait_s)
        self._collect()

    def _collect(self) -> None:
        now = time.monotonic()
        for job, _, error in self.flusher.completions():
            self._flushed(job, error, now)
        for (read, req, wanted), chunks, error in self.reader.completions():
            self._reads_in_flight -= 1
            self._answer_read(read, req, chunks, error, wanted)

    def _flushed(self, job: FlushJob, error: Exception | None, now: float) -> None:
        if error is not None and not isinstance(error, OSError):
            log.error("flush job failed unexpectedly", exc_info=error)
        for req, outcome in self.store.flush_done(job, error, now):
            if isinstance(outcome, KeraError):
                self.fail(req, outcome)
            else:
                self.reply(req, {"length": outcome})
        self.schedule_flushes()

    def _answer_read(self, read: DiskRead, req: Request, chunks, error: Exception | None,
                     wanted: set | None = None) -> None:
        if error is not None:
            if isinstance(error, CorruptChunk):
                log.error("replica %s on disk failed verification: %s", read.key, error)
                self.store.counters.add("disk_chunks_corrupt")
                self.fail(req, error)
            elif isinstance(error, OSError):
                self.store.counters.add("storage_errors")
                self.fail(req, StorageError(f"reading {read.key} failed: {error}"))
            else:
                log.error("disk read failed unexpectedly", exc_info=error)
                self.fail(req, StorageError(f"reading {read.key} failed: {error!r}", retriable=False))
            return
        size = sum(map(len, chunks))
        self.store.counters.add("read_bytes", size)
        self.store.counters.add("disk_read_bytes", size)
        replica = self.store.replicas.get(read.key)
        if replica is None:   # dropped while it was read
            self.fail(req, BadRequest(f"replica {read.key} was dropped"))
            return

        self.reply(req, {"length": replica.length, "closed": replica.closed, "end": read.offset + size},
                   keep(chunks, wanted))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        out = self.store.stats()
        out["reads_in_flight"] = self._reads_in_flight
        if self.registration is not None:
            out["registered"] = self.registration.registered
            out["backup_id"] = self.registration.id if self.registration.id is not None else -1
        return out

    def heartbeat_stats(self) -> dict:
        """The few figures sent with each heartbeat (the coordinator may use them for placement)."""
        store = self.store
        return {"unflushed_bytes": store.unflushed_bytes, "memory_bytes": store.memory_bytes,
                "replicas": len(store.replicas)}

    def heartbeat_fields(self) -> dict:
        """`held`: the broker incarnations this backup holds replicas of (see
        kera.backup.incarnations); the coordinator answers with those it may free."""
        return {"held": self.incarnations.held()}

    def heartbeat_reply(self, header: dict) -> None:
        if "broker_principals" in header:
            self.broker_keys.update(header["broker_principals"])
        free = header.get("free")
        if free:
            for token, err in self.incarnations.free(free):
                self.fail(token, err)
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
            while not self._stopping:
                self.run_once()
            self.draining = True
            deadline = time.monotonic() + shutdown_timeout_s
            self.schedule_flushes()
            while not self.store.idle() and not self.store.stuck() and time.monotonic() < deadline:
                self.run_once(0.01)
            if not self.store.idle():
                log.warning("stopping with %d bytes not flushed", self.store.unflushed_bytes)
            for req, err in self.store.abandon_waiters("backup stopped"):
                self.fail(req, err)
        finally:
            self.flusher.close()
            self.reader.close()
            self.close()
        log.info("backup stopped")


# ---------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = StoreConfig()
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                        help="coordinator address to register with")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any free port)")
    parser.add_argument("--advertise", default=None, metavar="HOST:PORT",
                        help="address given to the coordinator (default: HOST:bound port)")
    parser.add_argument("--dir", required=True, type=Path, help="data directory for replica files")
    parser.add_argument("--node", default=socket.gethostname(),
                        help="host identity for placement (default: the hostname)")
    parser.add_argument("--id", type=int, default=None, help="register again under this backup id")
    parser.add_argument("--max-unflushed-bytes", type=parse_size, default=defaults.max_unflushed_bytes,
                        help="bytes received and not yet on disk before writes are throttled "
                             "(default: %(default)s)")
    parser.add_argument("--max-memory-bytes", type=parse_size, default=defaults.max_memory_bytes,
                        help="bytes of replicas held in memory before writes are throttled "
                             "(at least --max-unflushed-bytes; default: %(default)s)")
    parser.add_argument("--max-replica-bytes", type=parse_size, default=defaults.max_replica_bytes,
                        help="largest replica (virtual segment) accepted (default: %(default)s)")
    parser.add_argument("--disk-limit", default="0", metavar="BYTES",
                        help="replica bytes this backup keeps on disk (e.g. 100GiB); a write "
                             "past it is refused with storage_error and the broker places the "
                             "virtual segment elsewhere (default: 0, as much as the disk holds)")
    parser.add_argument("--max-replicas-per-broker", type=int,
                        default=defaults.replicas_per_broker_max,
                        help="replicas of one broker held at once (at most %(default)s)")
    parser.add_argument("--max-replicas", type=int, default=defaults.replicas_max,
                        help="replicas held at once, all brokers (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on this port (default: off)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        type=str.upper, help="log level (default: %(default)s)")
    daemon_security.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        store_config = StoreConfig(max_replica_bytes=args.max_replica_bytes,
                                   max_unflushed_bytes=args.max_unflushed_bytes,
                                   max_memory_bytes=max(args.max_memory_bytes,
                                                        args.max_unflushed_bytes),
                                   disk_limit_bytes=parse_size(args.disk_limit),
                                   replicas_per_broker_max=args.max_replicas_per_broker,
                                   replicas_max=args.max_replicas)
        store_config.check()
        args.dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load(args.dir)
        server = BackupServer(args.dir, store_config, args.host, args.port,
                              daemon_security.from_args(args, "backup"))
    except KeraError as err:   # a key file refused
        log.error("cannot start the backup: %s", err.message)
        return 2
    except (ValueError, OSError, zmq.ZMQError) as err:
        log.error("cannot start the backup: %s", err)
        return 1
    server.registration = Registration(server, args.coordinator, "backup",
                                       args.advertise or server.address, args.node, args.id,
                                       stats=server.heartbeat_stats,
                                       fields=server.heartbeat_fields,
                                       on_heartbeat=server.heartbeat_reply,
                                       identity=identity, on_fatal=lambda err: server.stop())
    httpd = None
    if args.metrics_port:
        httpd = serve_metrics(args.metrics_port, "kera_backup", server.metrics_snapshot,
                              {"address": server.address}, host=args.host)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: server.stop())
    print(f"kera backup listening on {server.address}", flush=True)
    try:
        server.serve()
    finally:
        if httpd is not None:
            httpd.shutdown()
    # A bug stopped it (logged with its stack), or its identity was refused.
    return 1 if server.failure is not None or server.registration.fatal else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kera-backup", description="kera backup daemon")
    add_arguments(parser)
    return run(parser.parse_args(argv))
