"""The coordinator daemon: the sans-IO core behind a kera.net.server.Server, persisted on change.

Group commit: the requests of one loop turn are handled, their changes appended to the metadata
log (kera.coordinator.store) with one fsync, and only then are their replies sent, so nothing
acknowledged is lost by a crash. If the metadata cannot be written the coordinator answers
`storage_error` and stops (fail-stop): serving on with memory ahead of disk would acknowledge
changes a restart forgets. The metadata lives in the data directory, or on etcd with
`--metadata etcd://...` (kera.coordinator.etcd_store); there a coordinator whose writes another
coordinator fenced off answers `fenced` and stands by again (kera.coordinator.leadership).
If the core halts (its state is brand new while a daemon holds data of a cluster:
kera.coordinator.core) the coordinator logs why at CRITICAL and stops with a non-zero exit.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import time

import zmq

from kera import config
from kera.net import quota
from kera.net import security as daemon_security
from kera.coordinator.core import Coordinator
from kera.coordinator.markers import MARKER_REQUEST_TIMEOUT_S, MarkerChannel
from kera.coordinator.transactions import MARKER_RETRY_S
from kera.coordinator.metadata import DEFAULT_LEADER_LEASE_TTL_S, DEFAULT_PREFIX_NAME
from kera.coordinator import etcd_access
from kera.codec import wire
from kera.errors import Fenced, KeraError, StorageError
from kera.coordinator.group_lag import GroupLagExporter
from kera.daemon.metrics import Counters, add_stream_labels_argument, serve_metrics
from kera.daemon.env import DaemonEnv, real_if_none
from kera.daemon.flags import add_common_arguments, count, setup_logging
from kera.net.server import DEFERRED, FAILURE_REPLY_LINGER_MS, Request

log = logging.getLogger(__name__)

DEFAULT_PORT = 7000
# The largest frame the coordinator takes: its requests are headers only (no chunk payloads),
# so a peer sending more (a 64 MiB frame, or many) is cut off by zmq before it is buffered
# whole, instead of raising the coordinator's memory by a broker's frame bound per frame.
COORDINATOR_FRAME_BYTES_MAX = wire.MAX_HEADER_BYTES
# How often a leader checks that its lease still holds (kera.coordinator.leadership): well
# inside the margin the lease leaves (a fifth of 3 s).
LEADERSHIP_CHECK_S = 0.1
# A port just closed by a standby (or a deposed leader) is taken again by the other role;
# zmq releases it in its I/O thread, within milliseconds.
REBIND_WAIT_S = 5.0
REBIND_POLL_S = 0.05   # between tries while that port is still held


class CoordinatorServer:
    def __init__(self, data_dir: str | None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 heartbeat_interval_s: float = config.HEARTBEAT_INTERVAL_S,
                 heartbeat_missed_max: int = config.HEARTBEAT_MISSED_MAX,
                 security: daemon_security.Security | None = None,
                 env: DaemonEnv | None = None, store=None, leadership=None,
                 auto_rebalance: bool = True, client_ops_per_s: int = quota.CLIENT_OPS_PER_S):
        self.env = env = real_if_none(env)
        # kera.coordinator.leadership.Leadership when elected among several coordinators: the
        # store's commits are guarded by the leader key, and serving ends with the lease.
        self.leadership = leadership
        self.stepped_down = False
        if leadership is not None:
            store.use_fence(leadership.key, leadership.revision)
        self.clock = env.clock
        self.data_dir = data_dir
        if store is None or data_dir is not None:   # a store of its own needs no directory
            env.makedirs(data_dir)
        # `store`: a metadata store other than the directory's (kera.coordinator.etcd_store).
        self.store = store if store is not None else env.metadata_store.MetadataStore(data_dir)
        self.where = data_dir if store is None else store.describe()
        state = self.store.load()
        self.core = Coordinator(self.clock.monotonic(), heartbeat_interval_s=heartbeat_interval_s,
                                heartbeat_missed_max=heartbeat_missed_max, state=state,
                                token_source=env.new_token, auto_rebalance=auto_rebalance,
                                client_ops_per_s=client_ops_per_s)
        if state is not None:
            log.info("loaded %d streams, %d brokers, %d backups from %s", len(self.core.streams),
                     len(self.core.members["broker"]), len(self.core.members["backup"]), self.where)
        self.counters = Counters()
        self._saved_version: int | None = None    # the metadata version on disk
        # Replies of this loop turn, sent once its changes are committed (`_commit_turn`).
        self._outbox: list[tuple[Request, dict | KeraError]] = []
        self.exit_code = 0
        self._persist()
        self.server = env.server("coordinator", host, port, security,
                                 frame_bytes_max=COORDINATOR_FRAME_BYTES_MAX)
        if self.server.guard is not None:
            self.server.guard.acls = self.core.access.acls   # enforced where they are kept
        for op in Coordinator.OPS:
            self.server.on(op, self._handle)
        self.server.after_batch.append(self._commit_turn)
        # Transaction markers to the brokers (kera.coordinator.markers), after every turn.
        self.markers = MarkerChannel(self.core.transactions, self.core.marker_owner)
        self.server.after_turn.append(self._send_markers)
        self.server.on("stats", self._stats)
        self.server.every(heartbeat_interval_s, self._tick)
        if leadership is not None:
            self.server.every(LEADERSHIP_CHECK_S, self._check_leadership)
        self.snapshot: dict = {}
        # (committed positions by group, stream names) for the metrics thread's lag gauges;
        # taken only once something exports them (`export_group_lag`), replaced whole.
        self.export_group_lag = False
        self.group_view: tuple[dict, set] = ({}, set())
        self._refresh_snapshot()

    @property
    def address(self) -> str:
        return self.server.address

    def _handle(self, req: Request):
        self.counters.add(f"requests_{req.op}")
        if self.leadership is not None and not self._still_leading():
            raise self.leadership.not_leader()
        try:
            outcome = self.core.handle(req.op, req.fields, self.clock.monotonic(), req.principal)
            if req.op == "list_streams" and self.server.guard is not None:
                outcome = self._visible_streams(req, outcome)
        except KeraError as err:
            # Held back too: a heartbeat may have bumped the version before failing
            # validation of a later field.
            outcome = err
        self._outbox.append((req, outcome))
        if self.core.halted is not None and self.exit_code == 0:
            log.critical("%s", self.core.halted)
            self.exit_code = 1
            self.server.stop()
        return DEFERRED

    def _visible_streams(self, req: Request, reply: dict) -> dict:
        """A listing shows only the streams the caller may describe, as Kafka's does; a
        broker sees all (its Kafka listener filters per Kafka user: kera.broker.kafka.authorize)."""
        if req.principal is not None and req.principal.role == "broker":
            return reply
        acls = self.server.guard.acls
        reply["streams"] = [s for s in reply["streams"]
                            if acls.allowed(req.principal, "describe", "stream", s["name"])]
        return reply

    def _commit_turn(self) -> None:
        """After a turn's requests: one commit for all their changes, then their replies."""
        outbox, self._outbox = self._outbox, []
        try:
            self._persist()
        except (StorageError, Fenced) as err:
            outbox = [(req, err) for req, _ in outbox]
        for req, outcome in outbox:
            if isinstance(outcome, KeraError):
                self.server.fail(req, outcome)
            else:
                self.server.reply(req, outcome)

    def _send_markers(self) -> None:
        """Persist what marker acknowledgements (or an expiry) changed, then send the markers
        due: only decisions on disk are marked (kera.coordinator.markers)."""
        if self.stepped_down or self.exit_code:
            return
        if self.leadership is not None and not self._still_leading():
            return
        if self.core.transactions.dirty:
            self._persist()
        if not self.core.transactions.prepared:
            return
        for address, batch in self.markers.due(self.clock.monotonic()):
            self.server.peer(address).request(
                "txn_markers", MarkerChannel.request(batch), (), MARKER_REQUEST_TIMEOUT_S,
                lambda header, _frames, err, batch=batch: self._markers_replied(batch, header, err))

    def _markers_replied(self, batch, header: dict | None, err: KeraError | None) -> None:
        if err is not None:
            self.markers.failed(batch)
            log.debug("txn_markers: %s (resent in %.1f s)", err.message, MARKER_RETRY_S)
        else:
            self.markers.replied(batch, header, self.clock.monotonic())

    def _stats(self, req: Request) -> dict:
        self._refresh_snapshot()
        return {"stats": dict(self.snapshot)}

    def _tick(self) -> None:
        if self.leadership is not None and not self._still_leading():
            return   # resumed from a pause past its lease: nothing may be decided any more
        for member in self.core.tick(self.clock.monotonic()):
            log.warning("%s %d at %s missed %.1f s of heartbeats: declared dead", member.kind,
                        member.id, member.address, self.core.dead_after_s)
        self._persist()
        self._refresh_snapshot()

    def _persist(self) -> None:
        """Commit what changed since the last call: the base state when the version moved
        (every change of it bumps the version) and the replica map's journal. At startup (or
        if the journal overflowed) a snapshot is written at once; when the log is long, one is
        started on a thread (kera.coordinator.store)."""
        started = self.clock.monotonic()
        try:
            journal = self.core.replica_map.take_journal()
            if self._saved_version is None or journal is None:
                self.store.snapshot(self.core.to_state())
                self.counters.add("snapshots")
            else:
                # Group commits change persisted state without moving the metadata version
                # (daemons need not refetch metadata for them).
                moved = (self.core.groups.take_dirty() | self.core.kafka_offsets.take_dirty()
                         | self.core.transactions.take_dirty()
                         or self.core.version != self._saved_version)
                if not self.store.commit(self.core.base_state() if moved else None, journal):
                    return
                if self.store.wants_snapshot():
                    tables = {bid: dict(t) for bid, t in self.core.replica_map.tables.items()}
                    self.store.start_snapshot(self.core.base_state(), tables)
                    self.counters.add("snapshots")
        except (OSError, StorageError) as exc:
            self._fail_stop(f"cannot persist metadata to {self.where} ({exc})")
            raise StorageError(f"coordinator cannot persist its metadata: {exc}") from None
        except Fenced as exc:
            self._step_down(f"{exc}: standing by")
            raise
        self._saved_version = self.core.version
        self.counters.add("persists")
        self.counters.add("persist_ms_total", round((self.clock.monotonic() - started) * 1000, 3))

    def _fail_stop(self, why: str) -> None:
        log.critical("%s: stopping", why)
        self.counters.add("persist_errors")
        if hasattr(self, "server"):
            # The turn's error replies (storage_error, fenced) must reach their callers.
            self.server.close_linger_ms = FAILURE_REPLY_LINGER_MS
            self.server.stop()

    def _step_down(self, why: str) -> None:
        """Deposed (another coordinator leads): stop serving and let the caller stand by again
        (_run_elected), this leader's state discarded (a new leader loads it from etcd)."""
        log.warning("%s", why)
        self.stepped_down = True
        if hasattr(self, "server"):
            # The turn's `fenced` replies must reach their callers.
            self.server.close_linger_ms = FAILURE_REPLY_LINGER_MS
            self.server.stop()

    def _refresh_snapshot(self) -> None:
        # Replaced whole so the metrics thread never sees a dict being written.
        snap = dict(self.counters)
        snap.update(self.markers.counters)
        snap.update(transactional_ids=len(self.core.transactions.txns),
                    transactions_prepared=len(self.core.transactions.prepared))
        snap.update(metadata_version=self.core.version, streams=len(self.core.streams),
                    brokers=len(self.core.members["broker"]),
                    brokers_alive=len(self.core.live("broker")),
                    backups=len(self.core.members["backup"]),
                    backups_alive=len(self.core.live("backup")),
                    replica_entries=sum(map(len, self.core.replica_map.tables.values())),
                    metadata_log_bytes=self.store.log_bytes,
                    failovers=self.core.failover.failovers,
                    streamlets_recovering=sum(map(len, self.core.failover.recovering.values())))
        self.snapshot = snap
        if self.export_group_lag:
            self.group_view = ({g["name"]: g["committed"] for g in self.core.groups.to_state()},
                               set(self.core.streams))

    def _check_leadership(self) -> None:
        self._still_leading()

    def _still_leading(self) -> bool:
        """Checked by a timer and before every request: a leader paused or cut off past its
        lease must not answer even one request once another may lead."""
        if self.stepped_down:
            return False
        if self.leadership.valid(self.clock.monotonic()):
            return True
        self._step_down("leadership lost (lease not renewed in time): stepping down before "
                        "another coordinator may take over")
        return False

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            if self.leadership is not None and not self.stepped_down and self.exit_code == 0:
                self.leadership.resign()   # a clean stop: the next leader need not wait
            self.store.close()

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        self.store.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, default_port=DEFAULT_PORT, coordinator=False)
    add_stream_labels_argument(parser, "consumer-group lag gauges (kera_group_lag_*)")
    parser.add_argument("--dir",
                        help="data directory (required unless --metadata); metadata is kept in "
                             "DIR/coordinator.json (snapshot) "
                             "and DIR/coordinator-<g>.log (changes since), unless --metadata "
                             "names an etcd")
    parser.add_argument("--heartbeat-interval-ms", type=int,
                        default=round(config.HEARTBEAT_INTERVAL_S * 1000),
                        help="interval daemons are told to heartbeat at (default: %(default)s)")
    parser.add_argument("--heartbeat-missed-max", type=int, default=config.HEARTBEAT_MISSED_MAX,
                        help="missed heartbeat intervals before a daemon is declared dead "
                             "(default: %(default)s)")
    parser.add_argument("--metadata", metavar="URL",
                        help="keep the metadata on etcd instead of in --dir: "
                             "etcd://HOST:PORT[,HOST:PORT...] (the members' client URLs), "
                             "etcds://... for TLS (see the etcd access flags)")
    parser.add_argument("--leader-lease-s", type=int, default=DEFAULT_LEADER_LEASE_TTL_S, metavar="S",
                        help="with --metadata: run this command on two or three hosts; one leads "
                             "and the others stand by (answering not_leader). A dead leader is "
                             "replaced within about this many seconds (default: %(default)s)")
    parser.add_argument("--metadata-prefix", metavar="NAME", default=DEFAULT_PREFIX_NAME,
                        help="with --metadata: the cluster's keys are under /kera/NAME/ "
                             "(default: %(default)s)")
    parser.add_argument("--no-auto-rebalance", action="store_true",
                        help="never move streamlets to restarted or added brokers on its own "
                             "(by default, once brokers have been steady for 30 s and one owns "
                             "2 or more streamlets more than another, a loaded broker hands its "
                             "replicated streamlets over; `kera cluster rebalance` does it on "
                             "demand)")
    parser.add_argument("--client-ops-per-s", type=count, default=quota.CLIENT_OPS_PER_S,
                        metavar="N",
                        help="secure clusters: requests per second each client key may make of "
                             "the coordinator (group heartbeats and commits, stream and "
                             "transaction ops); over it a request is refused 'throttled' with "
                             "the wait, which clients retry. Brokers, backups and admins are not "
                             "limited. 0: no limit (default: %(default)s)")
    daemon_security.add_arguments(parser)
    etcd_access.add_arguments(parser)


def open_store(args: argparse.Namespace):
    """The store --metadata names, or None for the data directory's (the default)."""
    if not args.metadata:
        return None
    # Imported only then: the etcd client library is not needed for the file store.
    from kera.coordinator.etcd_store import EtcdStore, prefix_for
    return EtcdStore(etcd_access.open_client(args), prefix_for(args.metadata_prefix))


def run(args: argparse.Namespace) -> int:
    setup_logging(args)
    if not args.dir and not args.metadata:
        log.error("--dir is required (or --metadata etcd://... to keep the metadata on etcd)")
        return 2
    if args.heartbeat_interval_ms < 1 or args.heartbeat_missed_max < 1:
        log.error("--heartbeat-interval-ms and --heartbeat-missed-max must be at least 1")
        return 2
    stop = _StopOnSignal()
    if args.metadata:
        return _run_elected(args, stop)
    coord = _start(args)
    return coord if isinstance(coord, int) else _serve(coord, args, stop)


class _StopOnSignal:
    """SIGTERM / SIGINT stop whichever server runs now (a standby's or a leader's)."""

    def __init__(self):
        self.server = None
        self.requested = False
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame):
        log.info("signal %d: stopping", signum)
        self.requested = True
        if self.server is not None:
            self.server.stop()


def _start(args: argparse.Namespace, leadership=None):
    """A CoordinatorServer, the exit code when it cannot start (logged), or None when it was
    deposed while loading (another coordinator leads: stand by again)."""
    try:
        return _bind_retrying(lambda: CoordinatorServer(
            args.dir, args.host, args.port, store=open_store(args), leadership=leadership,
            heartbeat_interval_s=args.heartbeat_interval_ms / 1000,
            heartbeat_missed_max=args.heartbeat_missed_max,
            auto_rebalance=not args.no_auto_rebalance, client_ops_per_s=args.client_ops_per_s,
            security=daemon_security.from_args(args, "coordinator")))
    except Fenced as exc:
        log.warning("deposed while loading: %s: standing by", exc.message)
        return None
    except KeraError as exc:   # a key file refused; etcd unreachable
        log.error("cannot start: %s", exc.message)
        return 1 if isinstance(exc, StorageError) else 2
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 1
    except (OSError, zmq.ZMQError) as exc:  # data dir unwritable, port in use
        log.error("cannot start: %s", exc)
        return 1


def _bind_retrying(make):
    """make(), retried while its port is still held by the role this process just left."""
    deadline = time.monotonic() + REBIND_WAIT_S
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(REBIND_POLL_S)


def _serve(coord: CoordinatorServer, args: argparse.Namespace, stop: _StopOnSignal) -> int:
    metrics = None
    if args.metrics_port:
        lag = None
        if args.metrics_stream_labels:   # group lag names groups and streams
            coord.export_group_lag = True
            lag = GroupLagExporter(coord.address, lambda: coord.group_view[0],
                                   lambda: coord.group_view[1],
                                   str(args.key_file) if args.key_file else None).text
        metrics = serve_metrics(args.metrics_port, "kera_coordinator", lambda: coord.snapshot,
                                host=args.metrics_host, extra=lag)
    stop.server = coord.server
    if stop.requested:
        coord.stop()
    try:
        coord.run()
    finally:
        stop.server = None
        if metrics is not None:
            metrics.shutdown()
    persist_failed = coord.counters.get("persist_errors", 0) > 0
    log.info("coordinator %s", "stepped down" if coord.stepped_down else "stopped")
    # Non-zero when the metadata could not be written, the core halted, or a bug stopped it
    # (logged with its stack).
    return 1 if persist_failed or coord.exit_code or coord.server.failure is not None else 0


def _run_elected(args: argparse.Namespace, stop: _StopOnSignal) -> int:
    """Stand by until elected, lead until stopped or deposed, and stand by again."""
    from kera.coordinator.etcd_store import prefix_for
    from kera.coordinator.leadership import Leadership, serve_standby
    from kera.net.server import Server

    me = args.advertise or f"{args.host}:{args.port}"
    try:
        prefix = prefix_for(args.metadata_prefix)
        leadership = Leadership(etcd_access.open_client(args, check_prefix=prefix), prefix,
                                me, args.leader_lease_s)
        security = daemon_security.from_args(args, "coordinator")
    except (KeraError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    while not stop.requested:
        standby = _bind_retrying(lambda: Server("coordinator", args.host, args.port, security,
                                                frame_bytes_max=COORDINATOR_FRAME_BYTES_MAX))
        stop.server = standby
        serve_standby(standby, leadership, [*Coordinator.OPS, "stats"])
        stop.server = None
        if stop.requested or standby.failure is not None:
            return 1 if standby.failure is not None else 0
        code = _lead(args, stop, leadership)
        if code is not None:
            return code   # a failed write is fail-stop here too (a supervisor restarts it)
    return 0


def _lead(args: argparse.Namespace, stop: _StopOnSignal, leadership) -> int | None:
    """Lead after a won campaign: None once deposed (stand by again), else the exit code."""
    from kera.coordinator.leadership import LeaseKeeper
    # Renewing from the win on: loading the metadata may take longer than a lease.
    keeper = LeaseKeeper(leadership)
    keeper.start()
    try:
        coord = _start(args, leadership)
        if coord is None or isinstance(coord, int):
            return coord
        code = _serve(coord, args, stop)
        return None if code == 0 and coord.stepped_down else code
    finally:
        keeper.stop()
