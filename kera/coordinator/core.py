"""The coordinator's state machine: members, streams, placement and metadata versions. Sans-IO.

`handle(op, header, now)` takes a decoded request header and the clock (monotonic seconds) and
returns the reply fields, or raises the KeraError the reply carries; `tick(now)` declares
silent daemons dead. No sockets, no files, no clock of its own: `server.py` does the I/O and
persists `to_state()` whenever `version` moves.

Versions: `version` (the metadata version) grows on every change of persisted or visible state
(a stream created or deleted, a daemon registered, a daemon declared dead or back alive), so a
daemon that has applied version v knows it is current when v equals the version it is told.
A stream's descriptor records the version at which it was created, and is `ready` once every
broker owning one of its streamlets reports (by heartbeat) having applied at least that version.
Only this coordinator issues versions: a heartbeat claiming one it never issued is refused.

Identity: every `register` hands the daemon a secret incarnation *token*; its heartbeats,
re-registrations and `recovered` reports must present it, so a second process started with an
id that is live (heard from within the dead window) is refused (`id_in_use`) instead of taking
the identity over. Only a hash of each token is persisted, so identities survive a coordinator
restart. The cluster has an id (random, persisted); daemons remember it and present it when
they register, so a coordinator started on an empty directory next to daemons holding data
stops (`halted`) instead of handing out ids, versions and stream ids that collide with theirs.

Deletion is explicit: a deleted stream leaves a *tombstone* (its id and the version of the
deletion) that `broker_streams` replies carry; a broker drops exactly those streams, never one
merely missing from a reply. Stream ids are never reused: brokers report the highest id they
have seen when they register (`stream_id_mark`) and the next id moves above it.
"""

from __future__ import annotations

import difflib
import logging
from bisect import bisect_right
import os
import random
from dataclasses import dataclass, field, replace

from kera import config

from kera.codec import cleanup, schema

from kera.codec import wire
from kera.coordinator import acl_ops, groups, kafka_offsets, ops, transactions, validate
from kera.coordinator.identity import Identities, token_sha256
from kera.coordinator.liveness import DeathWatch
from kera.coordinator.ops import STREAMS_PAGE_MAX
from kera.coordinator.rebalance import Rebalancer
from kera.coordinator.replica_map import ReplicaMap
from kera.coordinator.recovery import Failover
from kera.coordinator.validate import KINDS, StreamSpec
from kera.errors import BadRequest, NotReady, StreamExists, UnknownStream, WrongCluster
from kera.net import quota
from kera.net.fence import FENCE_KEY_BYTES, fence_key_from, fence_token
from kera.codec.wire import Fields

log = logging.getLogger(__name__)

STATE_FORMAT = 1
FIRST_STREAM_ID = 1  # 0 is never a stream id, so a zeroed field is never mistaken for one
# Incarnation tokens and cluster ids: random bytes, sent as hex. 128 bits cannot be guessed
# or collide by accident.
TOKEN_BYTES = 16
# Deleted streams remembered (oldest forgotten first) and sent in every `broker_streams` reply:
# about 12 bytes each, so at most ~50 KB of a reply. A broker that missed more deletions than
# this keeps the forgotten streams' data (it never deletes without a tombstone).
TOMBSTONES_MAX = 4096
# Pages of `list_streams`: descriptors are added while the page stays under PAGE_BYTES_MAX
# (packed), at least one, so a reply stays well under wire.MAX_HEADER_BYTES (4 MiB) at every
# count validate admits; the largest single descriptor validate admits (4096 streamlets on
# 4096 brokers with 300-character addresses) packs to about 1.3 MiB.
PAGE_BYTES_MAX = 1024 * 1024
# A dead daemon that holds nothing (no streamlet placed on it, no replica map entry of or on it,
# no recovery reading from it) is forgotten once unheard of this long: ids are never reused, so
# the member table (DAEMONS_MAX per kind) would otherwise fill with daemons retired long ago.
# A week outlasts any outage an operator mends by hand; `deregister` forgets one at once.
MEMBER_EXPIRY_S = 7 * 24 * 3600.0
MEMBER_EXPIRY_CHECK_S = 60.0    # between expiry passes (a pass may scan the replica map)
# Between transaction expiry passes (Transactions.expire scans every id): a timeout is at least
# transactions.TIMEOUT_MS_MIN (1 s), so a pass a second ends a transaction at most a second late.
TXN_EXPIRY_CHECK_S = 1.0


@dataclass(slots=True)
class Member:
    """A registered broker or backup. Identity (kind, id) is kept across restarts of both
    the daemon and the coordinator; liveness is not persisted."""
    kind: str
    id: int
    address: str
    node: str
    alive: bool = False
    last_heartbeat_s: float | None = None  # None: not heard from since this coordinator started
    applied_version: int = 0               # metadata version the daemon last reported applied
    # Metadata version of its last register (persisted; 0: none, or loaded from a state file
    # written before it was kept). A broker compares it with the one it saw before to tell that
    # a backup restarted and lost its in-memory replicas, also when it was cut off from the
    # coordinator for the whole time between the backup's register and a coordinator restart:
    # kept in memory only, a restart turned it into 0 ("unknown") and the restart went unseen.
    registered_version: int = 0
    stats: dict = field(default_factory=dict)
    token_sha256: str | None = None        # hash of the current incarnation's token (persisted)
    token: str | None = None               # the token itself, in memory only (register reply)
    principal: str | None = None           # the key it registered with (secure clusters)
    kafka_address: str | None = None       # a broker's Kafka listener, when it runs one

    def summary(self) -> dict:
        # `registered_version` lets a caller that restarted a daemon tell its new registration
        # from the old one (versions only grow, also across coordinator restarts).
        out = {"id": self.id, "address": self.address, "node": self.node, "alive": self.alive,
               "registered_version": self.registered_version}
        if self.kafka_address is not None:
            out["kafka_address"] = self.kafka_address
        return out


@dataclass(slots=True)
class Stream:
    spec: StreamSpec
    id: int
    placement: list[int]   # owning broker id of each streamlet
    version: int           # metadata version at which it was created or last moved
    # {streamlet: (first group, next record number per slot)} reported by its owner once
    # retention emptied a slot; handed to the next owner in descriptors (kera.codec.schema).
    floors: dict = field(default_factory=dict)


class Coordinator:
    def __init__(self, now: float, *, heartbeat_interval_s: float = config.HEARTBEAT_INTERVAL_S,
                 heartbeat_missed_max: int = config.HEARTBEAT_MISSED_MAX,
                 state: dict | None = None, token_source=None, auto_rebalance: bool = True,
                 client_ops_per_s: int = quota.CLIENT_OPS_PER_S):
        """`client_ops_per_s`: requests per second each client principal may make (secure
        clusters; 0: no limit)."""
        if heartbeat_interval_s <= 0 or heartbeat_missed_max < 1:
            raise ValueError("heartbeat interval and missed count must be positive")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = heartbeat_interval_s * heartbeat_missed_max
        self.version = 0
        self.members: dict[str, dict[int, Member]] = {k: {} for k in KINDS}
        self.next_member_id = {k: 0 for k in KINDS}
        self.streams: dict[str, Stream] = {}
        self.next_stream_id = FIRST_STREAM_ID
        self.rotation = 0  # where the next stream's placement starts, mod the live brokers
        self.started_s = now
        self._expiry_checked_s = now
        # Which silent daemons `tick` declares dead, suspecting this coordinator's own
        # network when most are silent at once (kera.coordinator.liveness).
        self.death_watch = DeathWatch(self.dead_after_s)
        # Source of tokens and of the cluster id: `new_token` unless one is injected (the
        # server passes its kera.daemon.env.DaemonEnv's; tests a fixed one).
        self._token_source = token_source
        self.cluster_id = self._issue_token()   # replaced by the persisted one on load
        # Signs the fences recovering brokers may ask of backups (kera.net.fence); persisted.
        # From the token source, so that a simulation with a seeded one stays reproducible.
        self.fence_key = fence_key_from(self._issue_token())
        self.tombstones: dict[int, int] = {}  # deleted stream id -> version of the deletion
        # Why this coordinator must stop (its state is brand new while daemons hold data of a
        # cluster): the server shell logs it and exits. None while all is well.
        self.halted: str | None = None
        # Incarnation tokens: who may claim or use an identity (kera.coordinator.identity).
        self.identities = Identities(self.members, self.dead_after_s, now)
        # Broker incarnations, failover of dead brokers' streamlets, recovery markers
        # (kera.coordinator.recovery).
        self.failover = Failover()
        # Streamlets moved back to restarted or added brokers (kera.coordinator.rebalance).
        self.rebalancer = Rebalancer(auto=auto_rebalance)
        # Which backups hold each virtual segment of each broker, as the brokers report them
        # (kera.coordinator.replica_map): persisted change by change, outside `version`.
        self.replica_map = ReplicaMap()
        # Consumer groups (kera.coordinator.groups): their commits persist with the rest.
        self.groups = groups.Groups(self._streamlets_of, self.streams.keys)
        # Kafka-protocol groups' committed offsets (kera.coordinator.kafka_offsets), likewise.
        self.kafka_offsets = kafka_offsets.KafkaOffsets(lambda: self.groups.groups.keys())
        self.groups.foreign_names = lambda: self.kafka_offsets.groups.keys()
        # Transactions (kera.coordinator.transactions): their state persists with the rest, and
        # a commit decision's positions go to the group stores in the same change.
        # Its producer ids come from the token source when one is given (a test's, or the
        # simulation's through DaemonEnv.new_token), so that a seeded run issues the same ones.
        self.transactions = transactions.Transactions(
            None if token_source is None else _producer_ids(token_source))
        self._txn_expired_s = now
        self.now = now     # the clock of the latest request or tick (for stream deletions)
        # ACLs and their version (kera.coordinator.acl_ops); `caller` is the principal of the
        # request being handled (None in plaintext).
        self.access = acl_ops.AccessState()
        self.caller = None
        self.client_ops = quota.RequestRate(client_ops_per_s) if client_ops_per_s else None
        if state is not None:
            self._load(state)
            # The restart itself is a change: liveness is unknown until daemons heartbeat, and
            # a daemon that applied the last version must notice it is behind.
            self.bump()
        self._ops = ops.table(self)

    OPS = ("register", "heartbeat", "cluster", "create_stream", "describe_stream",
           "list_streams", "delete_stream", "alter_stream", "broker_streams", "replicas", "recovered",
           "recovery_status", "deregister", "rebalance", "group_heartbeat", "group_commit", "group_offsets",
           "group_list", "group_describe", "group_reset", "group_delete",
           "acl_add", "acl_remove", "acl_list", "quota_set", "quota_list",
           "kafka_offset_commit", "kafka_offset_fetch", "kafka_offset_delete", "kafka_group_list",
           "txn_init", "txn_add_parts", "txn_add_positions", "txn_end", "txn_verify",
           "txn_resolve", "txn_describe", "txn_list")

    def _streamlets_of(self, name: str) -> int | None:
        stream = self.streams.get(name)
        return stream.spec.streamlets if stream is not None else None

    # ------------------------------------------------------------------ request entry point
    def handle(self, op: str, header: dict | Fields, now: float, principal=None) -> dict:
        """`principal`: the authenticated caller (kera.net.keys.Principal), None in plaintext."""
        fn = self._ops.get(op)
        if fn is None:
            raise BadRequest(f"unknown op '{op}'")
        if principal is not None and principal.role == "client" and self.client_ops:
            self.client_ops.admit(principal.name, now)   # before it changes anything
        f = header if isinstance(header, Fields) else Fields(header)
        self.caller = principal
        self.now = max(self.now, now)
        try:
            return fn(f, now)
        finally:
            self.caller = None

    # ------------------------------------------------------------------ identity
    @property
    def fresh(self) -> bool:
        """Brand-new state: no daemon ever registered, no stream ever created."""
        return (not any(self.next_member_id.values()) and self.next_stream_id == FIRST_STREAM_ID
                and not self.streams)

    def check_cluster(self, kind: str, address: str, cluster_id: str | None) -> None:
        """A registering daemon that holds data of a cluster (it presents that cluster's id)
        must be of this one. A brand-new coordinator seeing one halts: its directory is empty
        or wrong, and running on would hand out ids and versions that collide with the data."""
        if cluster_id is None or cluster_id == self.cluster_id:   # an id, not a secret
            return
        if self.fresh:
            self.halted = (
                f"this coordinator's metadata directory is empty or wrong: its state is brand "
                f"new, yet {kind} at {address} holds data of cluster {cluster_id}. To proceed, "
                f"restore DIR/coordinator.json of that cluster, or restart the coordinator with "
                f"--dir pointing at that cluster's metadata directory, or (to start a new "
                f"cluster and lose that data) wipe the data directories of its brokers and "
                f"backups. The daemons keep their data meanwhile.")
            raise NotReady("the coordinator has no metadata of this daemon's cluster and stops")
        raise WrongCluster(
            f"{kind} at {address} holds data of cluster {cluster_id}, but this coordinator "
            f"runs cluster {self.cluster_id}: point it at its own cluster's coordinator, or "
            f"wipe its data directory to join this cluster")

    def check_expected(self, kind: str, address: str, expected: str | None) -> None:
        """A daemon started for one cluster (--cluster-id) is refused by any other's
        coordinator, fresh or not: it reached the wrong address (a port taken by another
        cluster's coordinator), and this cluster must not place anything on it."""
        if expected is not None and expected != self.cluster_id:
            raise WrongCluster(
                f"{kind} at {address} was started for cluster {expected} (--cluster-id), but "
                f"this coordinator runs cluster {self.cluster_id}: check its --coordinator")

    def raise_stream_ids(self, mark: int, who: str) -> None:
        """A daemon has seen stream ids up to `mark`: the next one goes above (ids are never
        reused, so old files of a stream can never resurface in a new one)."""
        if mark >= self.next_stream_id:
            log.warning("%s has seen stream id %d, beyond this coordinator's next id %d: "
                        "moving past it", who, mark, self.next_stream_id)
            self.next_stream_id = mark + 1
            self.bump()   # a change of persisted state

    # ------------------------------------------------------------------ membership
    def register(self, now: float, kind: str, address: str, node: str,
                 member_id: int | None = None, token: str | None = None) -> Member:
        """Admit a daemon, or re-admit one under the identity it asks for (a restart): a live
        identity only to the process presenting its token. Issues a new token."""
        table = self.members[kind]
        if member_id is None:   # a key's own id when it has one (one key is one daemon)
            member_id = acl_ops.bound_id(table, self.caller, self.next_member_id[kind])
        member = table.get(member_id)
        if member is None and len(table) >= validate.DAEMONS_MAX:
            raise NotReady(f"{validate.DAEMONS_MAX} {kind}s are registered already")
        acl_ops.check_binding(kind, member_id, member and member.principal, self.caller)
        acl_ops.check_one_id(kind, member_id, table, self.caller)
        if member is not None:
            self.identities.check_claim(member, token, address, now)
        if kind == "broker":
            self.failover.check_epochs_left()
        self.next_member_id[kind] = max(self.next_member_id[kind], member_id + 1)
        if member is None:
            member = table[member_id] = Member(kind, member_id, address, node)
            log.info("%s %d registered at %s (node %s)", kind, member_id, address, node)
        else:
            if (member.address, member.node) != (address, node):
                log.info("%s %d re-registered at %s (node %s), was %s (node %s)", kind,
                         member_id, address, node, member.address, member.node)
            member.address, member.node = address, node
        member.alive = True
        member.last_heartbeat_s = now
        member.applied_version = 0  # a (re)started daemon has applied nothing yet
        member.token = self._issue_token()
        member.token_sha256 = token_sha256(member.token)
        if self.caller is not None:
            member.principal = self.caller.name
        if kind == "broker":
            self.replica_map.forget(member_id)  # it reports its virtual segments again
        self.bump()
        member.registered_version = self.version
        self.failover.registered(self, member, now)
        return member

    def heartbeat(self, now: float, kind: str, member_id: int, applied_version: int,
                  stats: dict | None = None) -> None:
        member = self.members[kind].get(member_id)
        if member is None:
            raise NotReady(f"unknown {kind} id {member_id}: register first")
        if applied_version > self.version:
            raise BadRequest(f"metadata_version {applied_version} was never issued (the "
                             f"current one is {self.version})")
        member.last_heartbeat_s = now
        member.applied_version = applied_version
        if stats is not None:
            member.stats = stats
        if not member.alive:
            member.alive = True
            log.info("%s %d is alive again", kind, member_id)
            self.bump()

    def tick(self, now: float) -> list[Member]:
        """Declare dead every daemon silent for longer than the allowance; returns them."""
        live = [m for table in self.members.values() for m in table.values() if m.alive]
        dead = self.death_watch.due(live, now)
        for member in dead:
            member.alive = False
        if dead:
            self.bump()
        # Dead brokers' streamlets move to live ones (a bump of their own when they do).
        self.failover.daemons_dead(self, dead, now)
        self.failover.tick(self, now)
        self.rebalancer.tick(self, now)
        if now - self._expiry_checked_s >= MEMBER_EXPIRY_CHECK_S:
            self._expiry_checked_s = now
            self.expire_members(now)
        self.groups.expire(now)
        self.now = max(self.now, now)
        if now - self._txn_expired_s >= TXN_EXPIRY_CHECK_S:
            self._txn_expired_s = now
            self.transactions.expire(now)   # its abort markers go out once persisted
        return dead

    # ------------------------------------------------------------------ forgetting members
    def expire_members(self, now: float) -> list[Member]:
        """Forget dead daemons unheard of for MEMBER_EXPIRY_S that hold nothing."""
        expired = []
        for table in self.members.values():
            for member in list(table.values()):
                heard_s = member.last_heartbeat_s
                silent_s = now - (self.started_s if heard_s is None else heard_s)
                if silent_s > MEMBER_EXPIRY_S and not self.kept_because(member, scan_replicas=True):
                    self.forget_member(member, f"expired after {silent_s:.0f} s unheard of")
                    expired.append(member)
        return expired

    def kept_because(self, member: Member, scan_replicas: bool) -> str | None:
        """Why `member` must stay in the table, or None. With `scan_replicas`, a backup named
        in the replica map and a broker with replica map entries stay too (expiry)."""
        if member.alive:
            return "it is alive (stop it first; it is declared dead after missing heartbeats)"
        if member.kind == "broker":
            owned = sorted(s.spec.name for s in self.streams.values() if member.id in s.placement)
            if owned:
                return (f"it owns streamlets of {len(owned)} streams ({', '.join(owned[:5])}"
                        f"{', ...' if len(owned) > 5 else ''}); wait for their failover or "
                        f"delete them")
            if any(b == member.id for b, _ in self.failover.sources_named()):
                return "streamlets being recovered read from its replicas; wait for the recovery"
            if scan_replicas and self.replica_map.names("broker", member.id):
                return "the replica map still holds its virtual segments"
        elif scan_replicas and self.replica_map.names("backup", member.id):
            return "the replica map names it as holding virtual segments"
        return None

    def forget_member(self, member: Member, why: str) -> None:
        del self.members[member.kind][member.id]
        if member.kind == "broker":
            self.replica_map.forget(member.id)
        self.bump()
        log.warning("%s %d (%s, node %s) %s: forgotten (its id is not reused)", member.kind,
                    member.id, member.address, member.node, why)

    # ------------------------------------------------------------------ replica map
    def checked_floors(self, kind: str, entries) -> list:
        """A heartbeat's `floors` ([[stream id, streamlet, first group, [numbers]], ...]),
        checked against the streams; entries of streams that no longer exist are skipped."""
        if entries is None:
            return []
        if kind != "broker":
            raise BadRequest("only brokers report 'floors'")
        by_id = {s.id: s for s in self.streams.values()}
        out = []
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], int):
                raise BadRequest("field 'floors' holds an entry that is not [stream id, "
                                 "streamlet, first group, [record numbers]]")
            stream = by_id.get(entry[0])
            if stream is None:
                continue
            sl = entry[1]
            if not isinstance(sl, int) or isinstance(sl, bool) or \
                    not 0 <= sl < stream.spec.streamlets:
                raise BadRequest(f"field 'floors' names streamlet {sl!r:.20} of stream "
                                 f"'{stream.spec.name}', which has {stream.spec.streamlets}")
            out.append((stream, sl, schema.number_floor(entry[2:], stream.spec.active_groups)))
        return out

    def record_floors(self, broker_id: int, floors: list) -> None:
        """Keep the number floors a streamlet's owner reported (only ever raised); a change
        moves the metadata version, so it is persisted and reaches the brokers."""
        changed = False
        for stream, sl, floor in floors:
            if stream.placement[sl] != broker_id:
                continue   # not its streamlet (any more): it cannot know
            merged = schema.merged_floor(stream.floors.get(sl), floor)
            if merged != stream.floors.get(sl):
                stream.floors[sl] = merged
                changed = True
                log.info("stream '%s' streamlet %d: retention emptied a slot; its numbering "
                         "goes on from group %d, numbers %s", stream.spec.name, sl, *merged)
        if changed:
            self.bump()

    def live(self, kind: str) -> list[Member]:
        return [m for _, m in sorted(self.members[kind].items()) if m.alive]

    def cluster(self) -> dict:
        return {
            "brokers": [m.summary() for _, m in sorted(self.members["broker"].items())],
            "backups": [m.summary() for _, m in sorted(self.members["backup"].items())],
            "metadata_version": self.version,
            "cluster_id": self.cluster_id,   # an id, not a secret: daemons may be bound to it
        }

    # ------------------------------------------------------------------ streams
    def create_stream(self, spec: StreamSpec) -> dict:
        if spec.name in self.streams:
            raise StreamExists(f"stream '{spec.name}' already exists")
        if len(self.streams) >= validate.STREAMS_MAX:
            raise BadRequest(f"the cluster holds {validate.STREAMS_MAX} streams, the most it may")
        streamlets_total = sum(s.spec.streamlets for s in self.streams.values())
        if streamlets_total + spec.streamlets > validate.STREAMLETS_TOTAL_MAX:
            raise BadRequest(f"{spec.streamlets} more streamlets would exceed the cluster's "
                             f"{validate.STREAMLETS_TOTAL_MAX} ({streamlets_total} exist)")
        brokers = self.live("broker")
        if not brokers:
            raise NotReady("no live broker to place the stream on")
        backups_needed = spec.replication - 1
        backups_live = len(self.live("backup"))
        if backups_live < backups_needed:
            raise NotReady(f"replication {spec.replication} needs {backups_needed} live backups, "
                           f"{backups_live} live")
        n = len(brokers)
        placement = [brokers[(self.rotation + i) % n].id for i in range(spec.streamlets)]
        self.rotation = (self.rotation + spec.streamlets) % n
        self.bump()
        stream = Stream(spec, self.next_stream_id, placement, self.version)
        self.next_stream_id += 1
        self.streams[spec.name] = stream
        log.info("stream '%s' (id %d) created: %d streamlets on brokers %s", spec.name, stream.id,
                 spec.streamlets, sorted(set(placement)))
        return self.descriptor(stream)

    def describe_stream(self, name: str) -> dict:
        return self.descriptor(self._stream(name))

    def list_streams(self) -> list[dict]:
        return [self.descriptor(s) for _, s in sorted(self.streams.items())]

    def list_streams_page(self, after: str | None, limit: int,
                          broker_id: int | None = None) -> tuple[list[dict], bool]:
        """Descriptors of the streams named after `after` (only those with a streamlet on
        `broker_id`, if given), in name order: at most `limit` and PAGE_BYTES_MAX packed (at
        least one); and whether more follow."""
        names = sorted(name for name, s in self.streams.items()
                       if broker_id is None or broker_id in s.placement)
        start = bisect_right(names, after) if after is not None else 0
        page: list[dict] = []
        size = 0
        for name in names[start:start + limit]:
            d = self.descriptor(self.streams[name])
            d_size = len(wire.pack(d))
            if page and size + d_size > PAGE_BYTES_MAX:
                break
            page.append(d)
            size += d_size
        return page, start + len(page) < len(names)

    def alter_stream(self, name: str, **changes) -> dict:
        """Change what may change after creation (retention, and the streamlet count, which
        may only grow): validated as at creation; the descriptor's `version` moves, so it is
        `ready` again once every owning broker has applied the change. New streamlets go to
        the least loaded live brokers."""
        stream = self._stream(name)
        unknown = set(changes) - set(validate.ALTERABLE)
        if unknown:
            raise BadRequest(f"cannot alter {sorted(unknown)} of a stream (only "
                             f"{', '.join(validate.ALTERABLE)})")
        spec = replace(stream.spec, **changes)   # __post_init__ validates
        if spec == stream.spec:
            return self.descriptor(stream)
        added = self._added_streamlets(stream, spec.streamlets)
        stream.spec = spec
        stream.placement += added
        self.bump()
        stream.version = self.version
        log.info("stream '%s' (id %d) altered: %s%s", name, stream.id, changes,
                 f"; new streamlets on brokers {sorted(set(added))}" if added else "")
        return self.descriptor(stream)

    def _added_streamlets(self, stream: Stream, streamlets: int) -> list[int]:
        """Owners for the streamlets a raise to `streamlets` adds (least loaded live broker
        first). Lowering is refused: records already placed by key would be orphaned."""
        have = stream.spec.streamlets
        if streamlets < have:
            raise BadRequest(f"stream '{stream.spec.name}' has {have} streamlets: the count can "
                             f"only be raised (as Kafka's partitions), not lowered to {streamlets}")
        added = streamlets - have
        if not added:
            return []
        total = sum(s.spec.streamlets for s in self.streams.values())
        if total + added > validate.STREAMLETS_TOTAL_MAX:
            raise BadRequest(f"{added} more streamlets would exceed the cluster's "
                             f"{validate.STREAMLETS_TOTAL_MAX} ({total} exist)")
        live = self.failover.live_brokers(self)
        if not live:
            raise NotReady("no live broker to place the new streamlets on")
        loads = self.failover.loads(self, live)
        owners = []
        for _ in range(added):
            target = min(loads, key=lambda b: (loads[b], b))
            loads[target] += 1
            owners.append(target)
        return owners

    def delete_stream(self, name: str) -> None:
        stream = self._stream(name)
        del self.streams[name]
        self.failover.stream_deleted(stream.id)
        self.kafka_offsets.forget_topic(name)
        self.transactions.forget_stream(name, self.now)
        self.bump()
        self.tombstones[stream.id] = self.version   # brokers drop exactly this stream
        while len(self.tombstones) > TOMBSTONES_MAX:
            del self.tombstones[next(iter(self.tombstones))]
        log.info("stream '%s' (id %d) deleted", name, stream.id)

    def broker_streams(self, broker_id: int, after: str | None = None,
                       limit: int = STREAMS_PAGE_MAX) -> dict:
        """One page of the streams with a streamlet on `broker_id` (`next`: the name to pass
        as `after` while more follow), with the tombstones and the broker's epoch."""
        streams, more = self.list_streams_page(after, limit, broker_id)
        reply = {"metadata_version": self.version, "streams": streams,
                 "deleted": [[sid, v] for sid, v in self.tombstones.items()]}
        if more:
            reply["next"] = streams[-1]["name"]
        epoch = self.failover.epochs.get(broker_id)
        if epoch is not None:
            reply["epoch"] = epoch   # the broker's incarnation (names its replicas)
        tokens = [[b, e, fence_token(self.fence_key, b, e)]
                  for b, e in self.failover.sources_of(self, broker_id)]
        if tokens:
            reply["fence_tokens"] = tokens   # what it may fence on backups to recover
        return reply

    def descriptor(self, stream: Stream) -> dict:
        spec = stream.spec
        owners = sorted(set(stream.placement))
        brokers = self.members["broker"]
        d = {
            "name": spec.name, "id": stream.id, "streamlets": spec.streamlets,
            "active_groups": spec.active_groups, "replication": spec.replication,
            "group_segments": spec.group_segments, "segment_size_bytes": spec.segment_size_bytes,
            "durability": spec.durability, "replication_capacity": spec.replication_capacity,
            "retention_ms": spec.retention_ms, "retention_bytes": spec.retention_bytes,
            "retain_until_consumed": spec.retain_until_consumed,
            **cleanup.descriptor_fields(spec), "partitioner": spec.partitioner,
            "placement": list(stream.placement),
            "brokers": {str(b): brokers[b].address for b in owners},
            "version": stream.version,
            "ready": all(brokers[b].applied_version >= stream.version for b in owners),
        }
        recovering = self.failover.descriptor_field(stream.id)
        if recovering:
            d["recovering"] = recovering   # [[streamlet, [[broker, epoch], ...]], ...]
        d["states"] = self._streamlet_states(stream, {sl for sl, _ in recovering or ()})
        if stream.floors:
            d["floors"] = _floors_to_wire(stream.floors)
        return d

    def marker_owner(self, part) -> str | None:
        """The address of the live broker owning `part` (stream, streamlet), where its
        transaction markers go; None while it has none (dead owner, deleted stream)."""
        stream = self.streams.get(part[0])
        if stream is None or not 0 <= part[1] < len(stream.placement):
            return None
        member = self.members["broker"].get(stream.placement[part[1]])
        return member.address if member is not None and member.alive else None

    def _streamlet_states(self, stream: Stream, recovering: set) -> list[str]:
        """Per streamlet: `recovering` (its owner rebuilds it from backups), `offline` (its
        owner is dead and it has not been failed over yet) or `serving`."""
        brokers = self.members["broker"]
        out = []
        for sl, owner in enumerate(stream.placement):
            member = brokers.get(owner)
            out.append("recovering" if sl in recovering else
                       "serving" if member is not None and member.alive else "offline")
        return out

    def _stream(self, name: str) -> Stream:
        stream = self.streams.get(name)
        if stream is None:
            raise UnknownStream(f"no stream named '{name}'{_closest(name, self._visible())}")
        return stream

    def _visible(self):
        """The stream names the caller may describe: a suggestion never names one the ACLs
        hide from it."""
        may = ops.caller_may(self, "describe", "stream")
        if may is None or len(self.streams) > SUGGEST_AMONG_MAX:
            return self.streams
        return [n for n in self.streams if may(n)]

    def _issue_token(self) -> str:
        return (self._token_source or new_token)()

    def bump(self) -> None:
        self.version += 1

    # ------------------------------------------------------------------ persistence
    def to_state(self) -> dict:
        """Everything a restart must keep (identities, streams, counters), JSON-ready."""
        state = self.base_state()
        state["replicas"] = self.replica_map.to_state()
        return state

    def base_state(self) -> dict:
        """`to_state()` without the replica map (persisted change by change, see
        `ReplicaMap.take_journal`)."""
        return {
            "format": STATE_FORMAT,
            "metadata_version": self.version,
            "cluster_id": self.cluster_id,
            "fence_key": self.fence_key,
            "tombstones": [[sid, v] for sid, v in self.tombstones.items()],
            "next_stream_id": self.next_stream_id,
            "next_member_id": dict(self.next_member_id),
            "rotation": self.rotation,
            "members": {k: [{"id": m.id, "address": m.address, "node": m.node,
                             "token_sha256": m.token_sha256, "principal": m.principal,
                             "registered_version": m.registered_version,
                             "kafka_address": m.kafka_address}
                            for _, m in sorted(t.items())] for k, t in self.members.items()},
            "streams": [{"id": s.id, "placement": s.placement, "version": s.version,
                         "name": s.spec.name, "streamlets": s.spec.streamlets,
                         "active_groups": s.spec.active_groups,
                         "replication": s.spec.replication,
                         "group_segments": s.spec.group_segments,
                         "segment_size_bytes": s.spec.segment_size_bytes,
                         "durability": s.spec.durability,
                         "replication_capacity": s.spec.replication_capacity,
                         "retention_ms": s.spec.retention_ms,
                         "retention_bytes": s.spec.retention_bytes,
                         "retain_until_consumed": s.spec.retain_until_consumed,
                         **cleanup.descriptor_fields(s.spec),
                         "partitioner": s.spec.partitioner,
                         "floors": _floors_to_wire(s.floors)}
                        for _, s in sorted(self.streams.items())],
            "recovery": self.failover.to_state(),
            "groups": self.groups.to_state(),
            "kafka_offsets": self.kafka_offsets.to_state(),
            "groups_session_max_ms": self.groups.session_max_ms,
            "acls": self.access.to_state(),
            "transactions": self.transactions.to_state(),
        }

    def _load(self, state: dict) -> None:
        """Rebuild from `to_state()` output. Raises ValueError on anything inconsistent: a
        coordinator must not start on metadata it cannot trust."""
        try:
            if state["format"] != STATE_FORMAT:
                raise ValueError(f"unsupported state format {state['format']!r}")
            self.version = _nonneg(state["metadata_version"])
            # Absent in files written before cluster ids and tombstones existed.
            if "cluster_id" in state:
                self.cluster_id = _token_hash(state["cluster_id"]) or self.cluster_id
            if _is_fence_key(state.get("fence_key")):
                self.fence_key = state["fence_key"]
            for sid, v in state.get("tombstones", []):
                self.tombstones[_nonneg(sid)] = _nonneg(v)
            self.next_stream_id = _nonneg(state["next_stream_id"])
            self.rotation = _nonneg(state["rotation"])
            for kind in KINDS:
                self.next_member_id[kind] = _nonneg(state["next_member_id"][kind])
                for m in state["members"][kind]:
                    member_id = _nonneg(m["id"])
                    if member_id >= self.next_member_id[kind] or member_id in self.members[kind]:
                        raise ValueError(f"{kind} id {member_id} is duplicated or not below the next id")
                    self.members[kind][member_id] = Member(
                        kind, member_id, str(m["address"]), str(m["node"]),
                        token_sha256=_token_hash(m.get("token_sha256")),
                        principal=_token_hash(m.get("principal")),
                        registered_version=_nonneg(m.get("registered_version", 0)),
                        kafka_address=_optional_str(m.get("kafka_address")))
                    if self.members[kind][member_id].registered_version > self.version:
                        raise ValueError(f"{kind} id {member_id} registered at a version newer "
                                         f"than the metadata version")
            for s in state["streams"]:
                # Fields added later (retention) may be missing from an older file: defaults.
                spec = StreamSpec(**{k: s[k] for k in StreamSpec.__slots__ if k in s})

                stream = Stream(spec, _nonneg(s["id"]), list(s["placement"]),
                                _nonneg(s["version"]), _floors_loaded(s.get("floors", []), spec))
                if stream.id >= self.next_stream_id or spec.name in self.streams:
                    raise ValueError(f"stream '{spec.name}' is duplicated or its id is not below the next id")
                if len(stream.placement) != spec.streamlets or \
                        any(b not in self.members["broker"] for b in stream.placement):
                    raise ValueError(f"stream '{spec.name}' has a placement on unknown brokers")
                if stream.version > self.version:
                    raise ValueError(f"stream '{spec.name}' is newer than the metadata version")
                self.streams[spec.name] = stream
            # Absent in files written before broker failover existed.
            self.failover.load(state.get("recovery"))
            # Absent in files written before consumer groups existed.
            self.kafka_offsets.load(state.get("kafka_offsets", []))
            self.groups.load(state.get("groups", []), self.started_s,
                             state.get("groups_session_max_ms"))
            # Absent in files written before ACLs existed.
            self.access.load(state.get("acls"))
            # Absent in files written before transactions existed.
            self.transactions.load(state.get("transactions", []), self.started_s)
            # Absent in files written before the replica map existed.
            self.replica_map.load(state.get("replicas", {}), self.members["broker"], _nonneg)
        except (KeyError, TypeError, AttributeError, BadRequest) as exc:
            raise ValueError(f"malformed coordinator state: {exc.__class__.__name__}: {exc}") from None


def _producer_ids(token_source):
    """Transactional producer ids drawn from a generator seeded by one token, taken at the
    first id (a run without transactions takes none)."""
    rng = None

    def issue() -> int:
        nonlocal rng
        if rng is None:
            rng = random.Random(token_source())
        return 1 + rng.randrange(transactions.PRODUCER_ID_MAX)
    return issue


def new_token() -> str:
    """A fresh secret: TOKEN_BYTES random bytes, in hex."""
    return os.urandom(TOKEN_BYTES).hex()



def _token_hash(value) -> str | None:
    """A persisted token hash or cluster id: None or a short string."""
    if value is None or (isinstance(value, str) and 0 < len(value) <= schema.TOKEN_CHARS_MAX * 2):
        return value
    raise ValueError(f"expected a token hash or id, got {value!r}")


def _floors_to_wire(floors: dict) -> list[list]:
    return [[sl, first_group, list(numbers)] for sl, (first_group, numbers) in sorted(floors.items())]


def _floors_loaded(entries, spec: StreamSpec) -> dict:
    """A persisted stream's floors (absent in files written before them)."""
    out = {}
    for sl, first_group, numbers in entries:
        if not 0 <= sl < spec.streamlets:
            raise ValueError(f"stream '{spec.name}' has a floor for streamlet {sl}")
        out[sl] = schema.number_floor([first_group, numbers], spec.active_groups)
    return out


def _nonneg(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _optional_str(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"expected a string or null, not {value!r}")
    return value


# Stream names compared for a "did you mean" hint: a typo is usually near; past this many
# streams the hint is skipped rather than scanning a huge catalogue on the loop.
SUGGEST_AMONG_MAX = 10_000


def _is_fence_key(value) -> bool:
    try:
        return isinstance(value, str) and len(bytes.fromhex(value)) == FENCE_KEY_BYTES
    except ValueError:
        return False


def _closest(name: str, names) -> str:
    """"; did you mean 'x'?" for the most similar existing stream name, or ""."""
    if len(names) > SUGGEST_AMONG_MAX:
        return ""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.75)
    return f"; did you mean '{close[0]}'?" if close else ""
