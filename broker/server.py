"""The broker daemon: a thin loop around the sans-IO core (kera.broker.core.Broker).

It answers `produce` (deferred until durable), `fetch`, `offsets` and `stats`; sends the
core's replication writes to backups through Peers; keeps its coordinator session
(kera.daemon.coordinator_link: register, heartbeat, follow the leader) and applies stream metadata and the live-backup list as they change. Every wait on another
daemon is a Peer request with a deadline, so a dead coordinator or backup never blocks the loop.
Its identity (cluster id, incarnation token, stream-id mark: kera.daemon.identity) is presented at every
register; a refusal of that identity (`id_in_use`, `wrong_cluster`) stops the daemon with exit
status 1 and nothing deleted.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
import signal
import socket
from pathlib import Path

import zmq


from kera import config


from kera.codec import schema
from kera.net import security as daemon_security
from kera.net.security import is_loopback
from kera.daemon.coordinator_link import CoordinatorLink, LinkHooks
from kera.daemon.coordinator_session import CoordinatorSession
from kera.broker import history_epoch, replica_report
from kera.broker.core import MARKERS_PER_REQUEST_MAX, Broker, BrokerConfig
from kera.broker.reads import parse_cursor
from kera.broker.txn_writes import READ_COMMITTED
from kera.broker.memory import default_memory_limit_bytes
from kera.broker.recovery_service import RecoveryService
from kera.broker.segment_pool import SEGMENT_POOL_BYTES
from kera.broker.tier import TierConfig
from kera.broker.tier_service import TierService
from kera.broker.compaction_service import CompactionService
from kera.broker.virtual_log import ReplicationWrite
from kera.net.acl import Acl
from kera.errors import BadRequest, KeraError, Throttled
from kera.daemon.identity import Identity
from kera.daemon.metrics import Labelled, add_stream_labels_argument, serve_metrics
from kera.broker.latency import BrokerLatency, ProduceReply
from kera.daemon.env import DaemonEnv, real_if_none
from kera.daemon.flags import add_common_arguments, setup_logging, size_bytes
from kera.net.server import DEFERRED, Request
from kera.broker.kafka import slots as kafka_slots
from kera.broker.kafka.catalog import Catalog, CoordinatorCalls
from kera.broker.kafka.context import Advertised, Context, Deferred, Settings
from kera.broker.kafka import groups as kafka_groups
from kera.broker.kafka import group_admin
from kera.broker.kafka.listener import KafkaListener
from kera.broker.kafka.sasl import KafkaSecurity, server_context
from kera.net import certs
from kera.net.kafka_users import Users
from kera.net.keys import KeyFileError

log = logging.getLogger(__name__)

# Refresh the live-backup list every this many heartbeats.
CLUSTER_EVERY_HEARTBEATS = 2
SID_MAX = 2**64 - 1
SL_MAX = 2**32 - 1
# Live backups connected to ahead of their first write. Beyond it connections open on first
# use: pre-connecting to more than kera.net.server.PEERS_MAX would evict and reopen peers on every
# refresh (each a socket and a connection attempt) for backups most of which get no write.
PRECONNECT_BACKUPS_MAX = 64
# Descriptors a paged `broker_streams` listing may add up to before it is refused and asked
# again: the coordinator holds at most validate.STREAMS_MAX (10,000) streams.
STREAMS_LISTED_MAX = 10_000


# A txn_verify waits at most this for the coordinator (a persisted change: one fsync or etcd
# transaction); past it the held chunks are refused timeout and their producer retries.
TXN_VERIFY_TIMEOUT_S = 5.0


class _MarkerReply(Deferred):
    """A txn_markers request the core answers once its markers are durable."""
    __slots__ = ("server", "req")

    def __init__(self, server, req: Request):
        self.server, self.req = server, req

    def done(self, result) -> None:
        if isinstance(result, KeraError):
            self.server.fail(self.req, result)
        else:
            self.server.reply(self.req, result)


class BrokerDaemon:
    def __init__(self, coordinator: str, *, host: str = "127.0.0.1", port: int = 0,
                 node: str | None = None, broker_id: int | None = None,
                 cfg: BrokerConfig | None = None,
                 heartbeat_interval_s: float = config.HEARTBEAT_INTERVAL_S,
                 advertise: str | None = None, identity: Identity | None = None,
                 security: daemon_security.Security | None = None,
                 env: DaemonEnv | None = None, kafka: KafkaOptions | None = None):
        self.env = env = real_if_none(env)
        self.clock = env.clock
        self.node = node or socket.gethostname()
        self.core = Broker(self.node, cfg)
        self.server = env.server("broker", host, port, security)
        # ACLs as the coordinator last sent them (-1: none yet; heartbeats ask for them).
        self.acl_version = -1
        # Replication acks arrive through peer callbacks, after the request batch's hook has
        # run, and must be acted on promptly: the pump runs after every turn too.
        self.server.after_turn.append(self.pump)
        self.server.after_batch.append(self.pump)
        self.server.on("produce", self._on_produce)
        self.server.on("fetch", self._on_fetch)
        self.server.on("offsets", self._on_offsets)
        self.server.on("offsets_for_time", self._on_offsets_for_time)
        self.server.on("offsets_for_number", self._on_offsets_for_number)
        self.server.on("numbers", self._on_numbers)
        self.server.on("stats", self._on_stats)
        self.server.on("txn_markers", self._on_txn_markers)
        if advertise is None:
            advertise = self.server.address
            if host in ("0.0.0.0", "*", "::", ""):
                advertise = f"{socket.gethostname()}:{self.server.port}"
        self.advertise = advertise
        self.identity = identity = identity or Identity()
        self.exit_code = 0                # 1 once the coordinator refused this identity
        self.snapshot: dict = {}          # replaced whole, read by the metrics thread
        self.traffic_snapshot: dict = {}  # per stream, likewise, while metrics are served
        self.export_traffic = False
        self.latency: BrokerLatency | None = None   # histograms, while metrics are served
        self._pages: list = []            # (version, descriptors) of a paged broker_streams
        self._beats = 0
        # Register, heartbeat, follow the leader (kera.daemon.coordinator_link).
        self.kafka = None if kafka is None else self._start_kafka(kafka)
        extra = {} if self.kafka is None else {"kafka_address": self.kafka_advertise}
        session = CoordinatorSession("broker", advertise, self.node, identity, broker_id,
                                     heartbeat_interval_s, register_extra=extra)
        self.link = CoordinatorLink(self.server, coordinator, session, LinkHooks(
            heartbeat_fields=self._heartbeat_fields, on_registered=self._registered,
            on_heartbeat=self._heartbeat_reply, on_fatal=self._on_fatal,
            on_refused=self._on_refused))
        # Data dir: reload of segment files, tiering thread, retention (kera.broker.tier_service).
        self.tiering = TierService(self.core, self.server, env)
        # Passes over compacted streams on a thread, replicated and swapped (kera.broker.compactor).
        self.compaction = CompactionService(self.core, self.server, env)
        # Incarnation epochs and recovery of dead brokers' streamlets (kera.broker.recovery).
        self.recovery = RecoveryService(self.core, self.clock, self.server, self.link, self.pump,
                                        self._refresh_cluster)
        self.link.start()

    @property
    def address(self) -> str:
        return self.server.address

    def _start_kafka(self, opts: KafkaOptions) -> KafkaListener:
        """The Kafka listener on this broker's loop (kera.broker.kafka)."""
        catalog = Catalog(CoordinatorCalls(self.server, lambda: self.link.address), self.clock)
        if self.server.security is not None:   # SASL_SSL only, never plaintext
            opts.settings.security = _kafka_security(self.server, opts)
        ctx = Context(self.core, catalog, self.clock, self.server.wake_at, opts.settings)
        listener = KafkaListener(self.server, ctx, opts.host, opts.port)
        host, port = listener.host, listener.port
        if opts.advertise:
            host, _, port = opts.advertise.rpartition(":")
            port = int(port)
        elif host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        opts.settings.advertise = Advertised(host, port)
        self.kafka_advertise = f"{host}:{port}"
        self.kafka_catalog = catalog
        group_admin.register(self.server, ctx)   # kera's own tools on Kafka groups
        log.info("kafka listener on %s, advertised as %s", listener.address, self.kafka_advertise)
        return listener

    # ------------------------------------------------------------------ handlers
    def _on_produce(self, req: Request):
        acks = req.fields.bool("acks", True)
        frames = [f.buffer for f in req.frames]
        nbytes = sum(map(len, frames))
        quota = self._quota(req, "produce", nbytes)
        if quota is not None:
            quota.charge(req.principal.name, "produce", nbytes, self.clock.monotonic())
        # The chunks are copied into segments now: a deferred request must not keep the
        # received frames alive until it is answered.
        req.frames = []
        now, latency = self.clock.monotonic(), self.latency
        token = req if latency is None else ProduceReply(self.server, req, self.clock, now,
                                                         latency.produce)
        results = self.core.produce(token, frames, now, acks, self._checker(req, "write"))
        del frames
        self._record_histories()
        self.tiering.write_live()
        if results is None:
            return DEFERRED
        if latency is not None:
            latency.produce.observe(self.clock.monotonic() - now)
        return {"results": results}

    def _record_histories(self) -> None:
        """Epochs of R=1 histories begun by this produce, on disk before any ack of it."""
        root = self.core.tier.root
        for sid, sl, epoch in self.core.take_new_histories():
            if root is not None and epoch != history_epoch.REPLICATED_EPOCH:
                history_epoch.write(root, sid, sl, epoch)

    def _on_fetch(self, req: Request):
        reads = req.fields.list("reads")
        wait_ms = req.fields.int("wait_ms", 0, hi=config.FETCH_WAIT_MAX_MS)
        quota = self._quota(req, "fetch")
        started_s = self.clock.monotonic()
        results, epochs, frames = self._fetch(req, reads)
        if wait_ms and not frames and all(r[0] is None for r in results):
            deadline = self.clock.monotonic() + wait_ms / 1000
            if self.core.reads.park_fetch((req, reads, quota, started_s), reads, deadline):
                self.server.wake_at(deadline)
                return DEFERRED   # answered by _answer_held_fetches
        if self.latency is not None:
            self.latency.fetch.observe(self.clock.monotonic() - started_s)
        return self._fetch_reply(req, quota, results, epochs, frames)

    def _fetch(self, req: Request, reads: list, again: bool = False) -> tuple[list, list, list]:
        epochs: list = []
        isolation = req.fields.str("isolation", READ_COMMITTED, hi=32)
        results, frames = self.core.reads.fetch(reads, epochs, self._checker(req, "read"), again,
                                          isolation)
        return results, epochs, frames

    def _fetch_reply(self, req: Request, quota, results: list, epochs: list, frames: list,
                     **more) -> tuple[dict, list]:
        if quota is not None:
            quota.charge(req.principal.name, "fetch", sum(map(len, frames)), self.clock.monotonic())
        return {"results": results, "epochs": epochs, **more}, frames

    def _answer_held_fetches(self) -> None:
        """Fetch again, and answer, the held fetches that new records or their deadline
        released. `held` tells the consumer this broker holds fetches that find nothing."""
        for token in self.core.reads.take_ready_fetches(self.clock.monotonic()):
            if isinstance(token, Deferred):
                token.done(None)
                continue
            req, reads, quota, started_s = token
            try:
                results, epochs, frames = self._fetch(req, reads, again=True)
            except KeraError as err:   # e.g. not_ready: this broker lost its registration
                self.server.fail(req, err)
                continue
            fields, frames = self._fetch_reply(req, quota, results, epochs, frames, held=True)
            self.server.reply(req, fields, frames)
            if self.latency is not None:
                self.latency.fetch_held.observe(self.clock.monotonic() - started_s)

    def _on_offsets(self, req: Request):
        f = req.fields
        sid, sl = f.int("sid", hi=SID_MAX), f.int("sl", hi=SL_MAX)
        check = self._checker(req, "describe")
        if check is not None:
            self.core.reads.check_stream(sid, check)
        reads = self.core.reads
        isolation = f.str("isolation", None, hi=32)
        reply = {"groups": reads.offsets(sid, sl, isolation),
                 "first_group": reads.first_group(sid, sl),
                 "epoch": reads.history_epoch(sid, sl)}
        at = f.dict("at", None)
        if at is not None:   # a reader's cursor: also its lag in bytes
            low, offsets, _earliest, _epoch = parse_cursor(at)
            reply["behind_bytes"] = reads.bytes_behind(sid, sl, low, offsets)
        return reply

    def _on_offsets_for_time(self, req: Request):
        q = schema.offsets_for_time(req.fields)
        return self._cursor_reply(req, q.sid, q.sl, self.core.reads.cursor_at_time, q.target)

    def _on_offsets_for_number(self, req: Request):
        q = schema.offsets_for_number(req.fields)
        return self._cursor_reply(req, q.sid, q.sl, self.core.reads.cursor_at_number, q.target)

    def _on_numbers(self, req: Request):
        """Record numbers of one slot of a streamlet (a Kafka partition's offsets): `start`
        (the first retained), `end` (the durable end) and, given `timestamp_us`, `at_time`, the
        first durable record at or after it (None: none is). For `kera group` on Kafka groups."""
        f = req.fields
        sid, sl = f.int("sid", hi=SID_MAX), f.int("sl", hi=SL_MAX)
        check = self._checker(req, "describe")
        if check is not None:
            self.core.reads.check_stream(sid, check)
        return kafka_slots.numbers(self.core, sid, sl, f.int("slot", 0, hi=255),
                                   f.int("timestamp_us", None, hi=schema.TIMESTAMP_US_MAX))

    def _cursor_reply(self, req: Request, sid: int, sl: int, cursor_at, target: int) -> dict:
        """A reader's cursor at `target` (a time or a record number), once the caller may
        describe the stream: `low`, `offsets`, `first_group`, `epoch`."""
        check = self._checker(req, "describe")
        if check is not None:
            self.core.reads.check_stream(sid, check)
        low, offsets = cursor_at(sid, sl, target)
        reads = self.core.reads
        return {"low": low, "offsets": offsets, "first_group": reads.first_group(sid, sl),
                "epoch": reads.history_epoch(sid, sl)}

    def _quota(self, req: Request, kind: str, nbytes: int = 0):
        """The quotas to charge `req` (of `nbytes`) to, after refusing it (`throttled`) while
        its principal is over its rate, or larger than its rate allows at once; None in
        plaintext."""
        guard = self.server.guard
        if guard is None or req.principal is None:
            return None
        try:
            guard.quotas.admit(req.principal.name, kind, self.clock.monotonic(), nbytes)
        except Throttled:
            self.core.counters.add(f"quota_throttled_{kind}")
            raise
        return guard.quotas

    def _checker(self, req: Request, operation: str):
        guard = self.server.guard
        return None if guard is None else guard.checker(req.principal, operation, req.op)

    def _on_txn_markers(self, req: Request):
        """The coordinator's markers (kera.broker.core.Broker.txn_markers): answered once every
        one reported written is durable."""
        reply = self.core.txn_markers(_MarkerReply(self.server, req),
                                      req.fields.list("markers", max_len=MARKERS_PER_REQUEST_MAX),
                                      self.clock.monotonic())
        return DEFERRED if reply is None else reply

    def _send_txn_verifies(self) -> None:
        """Ask the leading coordinator txn_verify for the transactional chunks that wait."""
        core = self.core
        for key, fields in core.take_txn_verifies():
            def done(header, frames, error, key=key):
                core.txn_verified(key, header, error)
                self.server.wake_at(self.clock.monotonic())   # answer in this loop's turn
            self.server.peer(self.link.address).request("txn_verify", fields, [],
                                                        TXN_VERIFY_TIMEOUT_S, done)
        for key, fields in core.take_txn_resolves(self.clock.monotonic()):
            def resolved(header, frames, error, key=key):
                core.txn_resolved(key, header, error, self.clock.monotonic())
            self.server.peer(self.link.address).request("txn_resolve", fields, [],
                                                        TXN_VERIFY_TIMEOUT_S, resolved)

    def _on_stats(self, req: Request):
        # acl_version: which ACLs and quotas this broker enforces (-1: none received yet).
        return {"stats": {**self.core.stats(), **self.recovery.stats(),
                          **self.compaction.stats(), "acl_version": self.acl_version},
                "streams": self.core.reads.stream_traffic()}

    # ------------------------------------------------------------------ replication
    def pump(self) -> None:
        """Expire, send the replication writes due, answer produce requests now durable."""
        now = self.clock.monotonic()
        core = self.core
        self.tiering.pump()
        self.recovery.pump()
        self.compaction.pump()   # a pass's new chunks go out with this turn's writes
        core.tick(now)
        self._send_txn_verifies()
        writes = core.sync(now)
        # The replicas of a segment that are level get the same payload list (VirtualLog._write).
        for w, frames in zip(writes, self.server.share([w.frames for w in writes])):
            self._send_write(w, frames)
        for token, result in core.take_replies():
            if isinstance(token, Deferred):
                token.done(result)
            elif isinstance(result, KeraError):
                self.server.fail(token, result)
            else:
                self.server.reply(token, {"results": result})
        self._answer_held_fetches()
        if self.kafka is not None:
            kafka_groups.pump(self.kafka.ctx)

    def _send_write(self, w: ReplicationWrite, frames: list) -> None:
        core = self.core   # a write of a previous incarnation is accounted by that core
        latency, sent_s = self.latency, self.clock.monotonic()

        def done(header, frames, error, w=w):
            now = self.clock.monotonic()
            if latency is not None and error is None:
                latency.replication.observe(now - sent_s)
            core.write_done(w, header, error, now)

        # The core times writes out itself (tick); the peer's deadline, the same, also drops a
        # write still waiting for its connection, so no stale write reaches a replaced backup.
        timeout_s = self.core.cfg.replication_timeout_s
        self.server.peer(w.address).request("replicate", w.fields, frames, timeout_s, done)

    # ------------------------------------------------------------------ coordinator
    def _on_refused(self, op: str, error: KeraError) -> None:
        if op == "heartbeat" and isinstance(error, BadRequest):
            # Typically a metadata version the coordinator says it never issued (it was
            # restored from an older state): take its metadata as it is now.
            log.warning("the coordinator refused a heartbeat: %s; refetching metadata",
                        error.message)
            self._refresh_streams()
        else:
            log.warning("coordinator %s %s failed: %s: %s", self.link.address, op,
                        error.code, error.message)

    def _on_fatal(self, error: KeraError) -> None:
        self.exit_code = 1
        self.server.stop()

    def _registered(self, bid: int) -> None:
        self.core.set_identity(bid)
        # The coordinator forgets a broker's replica map when it registers: report it all again.
        replica_report.report_all(self.core.vlog_list)
        self._refresh_streams()
        self._refresh_cluster()

    def _heartbeat_fields(self) -> dict:
        self.snapshot = {**self.core.stats(), **self.recovery.stats()}
        if self.export_traffic:
            self.traffic_snapshot = self.core.reads.stream_traffic()   # replaced whole: metrics thread
        self._beats += 1
        if self._beats % CLUSTER_EVERY_HEARTBEATS == 0:
            self._refresh_cluster()
        fields = {"stream_id_mark": self.identity.stream_id_mark,
                  "metadata_version": self.core.metadata_version, "stats": self.snapshot}
        fields.update(self.recovery.heartbeat_fields())   # `epoch`: which incarnation beats
        if self.server.guard is not None:
            fields["acl_version"] = self.acl_version
        fields["consumed_at"] = self.core.retention.consumed_at
        report = replica_report.pending(self.core.vlog_list)
        if report:
            fields["vsegs"] = report   # where new virtual segments are replicated
        floors = self.core.retention.floors_to_send()
        if floors:
            fields["floors"] = floors  # streamlets retention emptied (kera.codec.schema.number_floor)
        return fields

    def _heartbeat_reply(self, header: dict, sent: dict) -> None:
        replica_report.acknowledged(self.core.vlog_list, sent.get("vsegs", ()))
        self.core.retention.floors_acknowledged(sent.get("floors", ()))
        if "acls" in header and self.server.guard is not None:
            self._apply_acls(header)
        if "consumed" in header:
            self.core.retention.set_consumed(header["consumed"], header.get("consumed_at"))
        if schema.metadata_version(header) > self.core.metadata_version:
            self._refresh_streams()

    def _apply_acls(self, header: dict) -> None:
        entries = header["acls"]
        if not isinstance(entries, list) or not isinstance(header.get("acl_version"), int):
            raise BadRequest("heartbeat reply with malformed 'acls'")
        self.server.guard.acls.replace(Acl.parse(e) for e in entries)
        self.server.guard.quotas.replace(header.get("quotas", {}))
        self.acl_version = header["acl_version"]
        log.info("ACLs at version %d: %d entries", self.acl_version, len(entries))

    def _refresh_streams(self, after: str | None = None) -> None:
        """Ask for this broker's streams: page after page (`next`), applied once whole."""
        if self.core.broker_id is None or "broker_streams" in self.link.session.in_flight:
            return
        fields = {"broker_id": self.core.broker_id}
        if after is None:
            self._pages = []          # descriptors of the listing's earlier pages
        else:
            fields["after"] = after
        self.link.call("broker_streams", fields, self._streams_reply)

    def _streams_reply(self, header: dict) -> None:
        version = schema.metadata_version(header)   # a bad reply: logged by the link
        streams, after = header.get("streams"), header.get("next")
        if after is not None:
            if not isinstance(streams, list) or not isinstance(after, str) or \
                    len(self._pages) + len(streams) > STREAMS_LISTED_MAX:
                log.warning("a broker_streams page is malformed or the listing too long: "
                            "asking again from the first page")
                self._refresh_streams()
                return
            self._pages.append((version, streams))
            self._refresh_streams(after)
            return
        if any(v != version for v, _ in self._pages):
            self._refresh_streams()   # the metadata changed while it was listed: list again
            return
        header = {**header, "streams": [d for _, page in self._pages for d in page]
                  + (streams if isinstance(streams, list) else [])}
        self._pages = []

        def apply() -> None:
            highest = self.core.apply_metadata(header.get("streams"), version,
                                               header.get("deleted", []))
            self.identity.saw_stream(highest)   # never to be reused (kera.daemon.identity)

        self.recovery.streams_reply(header, apply)

    def _refresh_cluster(self) -> None:
        self.link.call("cluster", {}, self._cluster_reply)

    def _cluster_reply(self, header: dict) -> None:
        self.core.placement.set_backups(header.get("backups"), self.clock.monotonic(),
                              header.get("settled", True) is not False)
        if self.kafka is not None:
            self.kafka_catalog.update_brokers(header.get("brokers"))
        self.recovery.cluster_reply(header)
        live = {b.address for b in self.core.pool.backups.values() if b.alive}
        # Departed backups' connections are freed (one still needed opens again on next use).
        self.server.close_idle_peers(keep=live | {self.link.address})
        if len(live) <= PRECONNECT_BACKUPS_MAX:
            for address in live:
                self.server.peer(address)   # connect before the first write

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        try:
            self.server.run()
        finally:
            if self.kafka is not None:
                self.kafka.close()
            self.tiering.shutdown()
            self.compaction.shutdown()

    def stop(self) -> None:
        self.server.stop()


@dataclass
class KafkaOptions:
    """The broker's Kafka listener: where it binds, what it advertises, how it behaves."""
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    settings: Settings = field(default_factory=Settings)
    tls_cert: Path | None = None   # a secure broker's certificate (default: from its keys dir)
    tls_key: Path | None = None


def _kafka_security(server, opts: KafkaOptions) -> KafkaSecurity:
    """A secure broker's SASL_SSL listener: its certificate (KEYS/kafka/NAME.crt unless
    given), the keys directory's Kafka users, the broker's ACLs and quotas."""
    keys_dir, name = server.security.keys_dir, server.security.identity.name
    cert, key = certs.cert_paths(keys_dir, name)
    cert, key = opts.tls_cert or cert, opts.tls_key or key
    for path in (cert, key):
        if not Path(path).exists():
            raise KeyFileError(f"the Kafka listener of a secure broker serves TLS only, and "
                               f"{path} is missing: create it with `kera keys kafka-cert {name} "
                               f"--dir {keys_dir} --host HOST` (HOST: what clients dial), or "
                               f"pass --kafka-tls-cert/--kafka-tls-key")
    return KafkaSecurity(server_context(str(cert), str(key)), Users(keys_dir), server.guard)


# ====================================================================== command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_stream_labels_argument(parser, "per-stream traffic and compaction gauges")
    parser.add_argument("--node", default=None, help="host identity for placement (default: hostname)")
    parser.add_argument("--id", type=int, default=None, help="broker id to re-register with")
    parser.add_argument("--virtual-logs", type=int, default=config.DEFAULT_VIRTUAL_LOGS,
                        help="shared virtual logs (replication capacity) per replication factor")
    parser.add_argument("--virtual-segment-bytes", type=size_bytes, default=config.DEFAULT_VIRTUAL_SEGMENT_BYTES,
                        help="chunk bytes referenced by one virtual segment")
    parser.add_argument("--replication-in-flight", type=int,
                        default=config.REPLICATION_IN_FLIGHT_MAX,
                        help="replication writes in flight to each backup of a virtual segment "
                             "(default: %(default)s)")
    parser.add_argument("--dir", default=None, type=Path,
                        help="data directory: segments beyond the memory limit are written "
                             "here, and a restart with the same --id reloads them (default: "
                             "none, everything stays in memory)")
    parser.add_argument("--memory-limit", type=size_bytes, default=None, metavar="BYTES",
                        help="chunk bytes held in memory, e.g. 512MiB (default: 25%% of RAM); "
                             "beyond it segments go to --dir, or producers are throttled")
    parser.add_argument("--disk-limit", type=size_bytes, default=0, metavar="BYTES",
                        help="segment bytes kept in --dir, e.g. 100GiB (default 0: what the "
                             "disk holds)")
    parser.add_argument("--segment-pool", type=size_bytes, default=SEGMENT_POOL_BYTES,
                        metavar="BYTES",
                        help="memory of segments that left memory (deleted by retention, "
                             "written to --dir) kept to hold new ones, so appends do not fault "
                             "fresh pages; resident on top of --memory-limit (default: 128MiB; "
                             "0 gives it all back)")
    daemon_security.add_arguments(parser)
    add_kafka_arguments(parser)


def add_kafka_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Kafka listener (Kafka clients, tools and connectors)")
    g.add_argument("--kafka-port", type=int, default=None, metavar="PORT",
                   help="serve Kafka's wire protocol on this port (0: any free port; "
                        "default: no Kafka listener)")
    g.add_argument("--kafka-host", default=None, metavar="HOST",
                   help="address the Kafka listener binds (default: --host)")
    g.add_argument("--kafka-advertise", default=None, metavar="HOST:PORT",
                   help="address Kafka clients are told to use for this broker (default: "
                        "the bound address)")
    g.add_argument("--kafka-auto-create-topics", action="store_true",
                   help="create a topic a Kafka client names that does not exist (Kafka's "
                        "auto.create.topics.enable; default: off)")
    g.add_argument("--kafka-default-partitions", type=int, default=1, metavar="N",
                   help="partitions of a topic created without a count (default: 1)")
    g.add_argument("--kafka-default-replication", type=int, default=1, metavar="R",
                   help="replication factor of a topic created without one (default: 1)")
    g.add_argument("--kafka-tls-cert", type=Path, default=None, metavar="FILE",
                   help="with keys (--keys-dir): the listener's TLS certificate, PEM (default: "
                        "KEYS/kafka/NAME.crt, NAME the broker's key; kera keys kafka-cert)")
    g.add_argument("--kafka-tls-key", type=Path, default=None, metavar="FILE",
                   help="its private key, PEM (default: KEYS/kafka/NAME.key)")


def kafka_options(args: argparse.Namespace) -> KafkaOptions | None:
    if args.kafka_port is None:
        return None
    settings = Settings(auto_create_topics=args.kafka_auto_create_topics,
                        default_partitions=args.kafka_default_partitions,
                        default_replication=args.kafka_default_replication)
    return KafkaOptions(host=args.kafka_host or args.host, port=args.kafka_port,
                        advertise=args.kafka_advertise, settings=settings,
                        tls_cert=args.kafka_tls_cert, tls_key=args.kafka_tls_key)


def _kafka_refused(args: argparse.Namespace) -> bool:
    """A Kafka listener that would be open to anyone: refused with what to do instead. With
    keys the listener is SASL_SSL (kera.broker.kafka.sasl), authenticated wherever it binds."""
    if args.kafka_port is None:
        return False
    if args.keys_dir or args.key_file:
        return False
    if args.kafka_tls_cert or args.kafka_tls_key:
        log.error("--kafka-tls-cert/--kafka-tls-key need keys (--keys-dir, --key-file): TLS "
                  "comes with SASL logins, on a secure cluster's Kafka listener only")
        return True
    kafka_host = args.kafka_host or args.host
    if not is_loopback(kafka_host) and not args.insecure:
        log.error("--kafka-host %s would serve Kafka's protocol without authentication to "
                  "anyone who reaches it: bind 127.0.0.1, or pass --insecure", kafka_host)
        return True
    return False


def run(args: argparse.Namespace) -> int:
    setup_logging(args)
    if args.virtual_logs < 1 or args.virtual_segment_bytes < 1 or args.replication_in_flight < 1:
        log.error("--virtual-logs, --virtual-segment-bytes and --replication-in-flight must be "
                  "positive")
        return 2
    try:
        memory_limit = (args.memory_limit if args.memory_limit is not None
                        else default_memory_limit_bytes())
        tier = TierConfig(root=args.dir, memory_limit_bytes=memory_limit,
                          disk_limit_bytes=args.disk_limit)
        tier.check()
    except ValueError as exc:
        log.error("bad --memory-limit / --disk-limit: %s", exc)
        return 2
    if args.dir is None:
        log.warning("no --dir: segments stay in memory; producers are throttled once %d bytes "
                    "are held", memory_limit)
    cfg = BrokerConfig(virtual_logs=args.virtual_logs, virtual_segment_bytes=args.virtual_segment_bytes,
                       replication_in_flight_max=args.replication_in_flight, tier=tier,
                       segment_pool_bytes=args.segment_pool)

    if _kafka_refused(args):
        return 2
    try:
        identity = Identity.load(args.dir)
        identity.expect_cluster(args.cluster_id)
        daemon = BrokerDaemon(args.coordinator, host=args.host, port=args.port, node=args.node,
                              broker_id=args.id, cfg=cfg, advertise=args.advertise,
                              identity=identity,
                              security=daemon_security.from_args(args, "broker"),
                              kafka=kafka_options(args))
    except KeraError as exc:                 # a key file refused
        log.error("cannot start: %s", exc.message)
        return 2
    except ValueError as exc:                # a damaged identity file, another cluster's data
        log.error("cannot start: %s", exc)
        return 1
    except (OSError, zmq.ZMQError) as exc:   # port in use, bad interface
        log.error("cannot start: %s", exc)
        return 1
    metrics = _serve_metrics(daemon, args) if args.metrics_port else None

    def stop(signum, frame):
        log.info("signal %d: stopping", signum)
        daemon.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"kera broker listening on {daemon.address}", flush=True)
    try:
        daemon.run()
    finally:
        if metrics is not None:
            metrics.shutdown()
    log.info("broker stopped")
    # A bug stopped it (logged with its stack), or its identity was refused.
    return 1 if daemon.server.failure is not None else daemon.exit_code


def _serve_metrics(daemon: BrokerDaemon, args: argparse.Namespace):
    """The broker's counters and latency histograms on --metrics-host:--metrics-port; with
    --metrics-stream-labels also its per-stream traffic and compaction gauges."""
    labelled = ()
    if args.metrics_stream_labels:
        daemon.export_traffic = True
        labelled = (Labelled("kera_broker_stream", "stream", lambda: daemon.traffic_snapshot),
                    Labelled("kera_broker_compaction", "stream",
                             lambda: daemon.compaction.metric_rows))
    metrics = serve_metrics(args.metrics_port, "kera_broker", lambda: daemon.snapshot,
                            labels={"address": daemon.address}, host=args.metrics_host,
                            labelled=labelled)
    daemon.latency = BrokerLatency(metrics)
    return metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kera broker", description="Run a kera broker.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
