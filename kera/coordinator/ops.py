"""The coordinator's request ops: each checks its request's fields, then asks the state
machine (kera.coordinator.core.Coordinator) and shapes the reply. Sans-IO.

`table(core)` maps every op name to its handler, (Fields, now) -> reply fields; the group,
Kafka-offset, ACL and transaction ops come from their own modules. A handler raises the
KeraError its reply carries; a refused request changes nothing.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from kera.codec import schema, wire
from kera.codec.wire import Fields
from kera.coordinator import acl_ops, groups, kafka_offsets, transactions, validate
from kera.coordinator.recovery import parse_streamlets
from kera.coordinator.txn_positions import TxnPositions
from kera.coordinator.validate import StreamSpec
from kera.errors import BadRequest

if TYPE_CHECKING:
    from kera.coordinator.core import Coordinator

# A broker's reported stream-id high-water mark is accepted up to this: far more streams than a
# cluster ever creates (one id per create_stream), yet a bogus mark cannot exhaust the id space.
STREAM_ID_MARK_MAX = 2**48
# Number floors one heartbeat may carry: the broker sends at most this many
# (kera.broker.retention.FLOORS_PER_HEARTBEAT_MAX), the rest in later heartbeats.
FLOORS_PER_HEARTBEAT_MAX = 256
# Stream descriptors per `list_streams` page, at most (the default `limit`); a page also
# stays under kera.coordinator.core.PAGE_BYTES_MAX packed.
STREAMS_PAGE_MAX = 1000
# Entries per `replicas` page: an entry packs to at most ~70 bytes (u32 ids, u64 vseg, up to
# VSEG_BACKUPS_MAX backup ids), so a full page is about 1.4 MiB.
REPLICAS_PAGE_MAX = 20_000
# Consumption marks one broker heartbeat reply carries (one per streamlet of its
# retain-until-consumed streams, ~4 bytes each: ~1 MiB, under the 4 MiB header limit). Streams
# past it get no mark, which only keeps their data longer.
CONSUMED_MARKS_MAX = 262_144


def table(core: "Coordinator") -> dict:
    """The request handlers by op: (Fields, now) -> reply."""
    ops = {op: partial(fn, core) for op, fn in (
        ("register", register), ("heartbeat", heartbeat), ("cluster", cluster),
        ("create_stream", create_stream), ("describe_stream", describe_stream),
        ("list_streams", list_streams), ("delete_stream", delete_stream),
        ("alter_stream", alter_stream), ("broker_streams", broker_streams),
        ("replicas", replicas), ("recovered", recovered),
        ("recovery_status", recovery_status), ("deregister", deregister),
        ("rebalance", rebalance))}
    ops.update(groups.ops(core.groups, lambda: caller_may_read(core)))
    ops.update(kafka_offsets.ops(core.kafka_offsets))
    ops.update(acl_ops.ops(core.access, core.bump))
    positions = TxnPositions(core.groups, core.kafka_offsets, core.transactions,
                             lambda op, kind: caller_may(core, op, kind))
    ops.update(transactions.ops(core.transactions, positions.apply, positions.check))
    return ops


def caller_may_read(core: "Coordinator"):
    """For the request being handled: whether its principal may read a stream (None in
    plaintext, where every caller is trusted)."""
    principal, acls = core.caller, core.access.acls
    if principal is None:
        return None
    return lambda stream: acls.allowed(principal, "read", "stream", stream)


def caller_may(core: "Coordinator", operation: str, resource_type: str):
    """For the request being handled: whether its principal may do `operation` to a
    resource of `resource_type` by name; None when nothing is checked (plaintext, admins,
    and brokers, whose Kafka listeners check the Kafka user's own grants)."""
    principal, acls = core.caller, core.access.acls
    if principal is None or principal.role in ("admin", "broker"):
        return None
    return lambda name: acls.allowed(principal, operation, resource_type, name)


def register(core: "Coordinator", f: Fields, now: float) -> dict:
    kind = validate.kind(f)
    member_id = f.int("daemon_id", None, hi=validate.CHOSEN_ID_MAX)
    address, node = validate.address(f), validate.node(f)
    kafka_address = validate.address(f, "kafka_address") if "kafka_address" in f.h else None
    if kafka_address is not None and kind != "broker":
        raise BadRequest("only brokers register a 'kafka_address'")
    token = f.str("token", None, hi=schema.TOKEN_CHARS_MAX)
    mark = f.int("stream_id_mark", 0, hi=STREAM_ID_MARK_MAX)
    core.check_cluster(kind, address, f.str("cluster_id", None, hi=schema.TOKEN_CHARS_MAX))
    core.check_expected(kind, address, f.str("expect_cluster_id", None, hi=schema.TOKEN_CHARS_MAX))
    member = core.register(now, kind, address, node, member_id, token)
    member.kafka_address = kafka_address
    core.raise_stream_ids(mark, f"{kind} {member.id} at {address}")   # once admitted
    return {"daemon_id": member.id, "token": member.token, "cluster_id": core.cluster_id,
            "heartbeat_interval_ms": round(core.heartbeat_interval_s * 1000)}


def heartbeat(core: "Coordinator", f: Fields, now: float) -> dict:
    kind = validate.kind(f)
    member_id = f.int("daemon_id", hi=validate.ID_MAX)
    applied = f.int("metadata_version", hi=validate.VERSION_MAX)
    stats = validate.stats(f)
    report = validate.vsegs(f)
    if report is not None and kind != "broker":
        raise BadRequest("only brokers report 'vsegs'")
    floors = core.checked_floors(kind, f.list("floors", None,
                                               max_len=FLOORS_PER_HEARTBEAT_MAX))
    mark = f.int("stream_id_mark", 0, hi=STREAM_ID_MARK_MAX)
    # Everything is checked before anything changes: a refused heartbeat changes nothing.
    token = f.str("token", None, hi=schema.TOKEN_CHARS_MAX)
    core.identities.authenticate(kind, member_id, token, now)
    acl_ops.check_binding(kind, member_id, core.members[kind][member_id].principal, core.caller)
    if applied > core.version:
        raise BadRequest(f"metadata_version {applied} was never issued (the current one "
                         f"is {core.version})")
    core.failover.check_heartbeat(core, kind, member_id, f, now)
    core.rebalancer.check_heartbeat(kind, member_id)
    core.heartbeat(now, kind, member_id, applied, stats)
    # Also in heartbeats: after a restart from an older state, a daemon that only
    # heartbeats (its token is still valid) never registers again.
    core.raise_stream_ids(mark, f"{kind} {member_id}")
    if report:
        core.replica_map.report(member_id, report)
    core.record_floors(member_id, floors)
    reply = {"metadata_version": core.version}
    if kind == "broker":
        reply.update(core.access.for_heartbeat(f.int("acl_version", None, lo=-1, hi=2**62)))
        reply.update(consumed_for(core, member_id, f.int("consumed_at", None, lo=-1,
                                                         hi=2**62)))
    if kind == "backup":
        bound = {str(i): m.principal for i, m in core.members["broker"].items() if m.principal}
        if bound:
            reply["broker_principals"] = bound   # backups refuse other keys' replica ops
        free = core.failover.backup_heartbeat(core, member_id, f)
        if free:
            reply["free"] = free   # incarnations whose replicas are no longer needed
        reply["fence_key"] = core.fence_key   # to verify recovering brokers' fences
    return reply


def cluster(core: "Coordinator", f: Fields, now: float) -> dict:
    reply = core.cluster()
    # Every live daemon has had time to heartbeat since this coordinator started, so one
    # not alive is dead, not merely unheard of yet (recovery waits for this).
    reply["settled"] = now - core.started_s > core.dead_after_s
    return reply


def create_stream(core: "Coordinator", f: Fields, now: float) -> dict:
    return {"stream": core.create_stream(StreamSpec.from_fields(f))}


def describe_stream(core: "Coordinator", f: Fields, now: float) -> dict:
    return {"stream": core.describe_stream(f.str("name", hi=validate.NAME_CHARS_MAX))}


def list_streams(core: "Coordinator", f: Fields, now: float) -> dict:
    after = f.str("after", None, hi=validate.NAME_CHARS_MAX)
    limit = f.int("limit", STREAMS_PAGE_MAX, lo=1, hi=STREAMS_PAGE_MAX)
    streams, more = core.list_streams_page(after, limit)
    reply = {"streams": streams}
    if more:
        reply["next"] = streams[-1]["name"]   # pass as `after` for the next page
    return reply


def delete_stream(core: "Coordinator", f: Fields, now: float) -> dict:
    core.delete_stream(f.str("name", hi=validate.NAME_CHARS_MAX))
    return {}


def alter_stream(core: "Coordinator", f: Fields, now: float) -> dict:
    name = f.str("name", hi=validate.NAME_CHARS_MAX)
    return {"stream": core.alter_stream(name, **validate.alterations(f))}


def broker_streams(core: "Coordinator", f: Fields, now: float) -> dict:
    return core.broker_streams(f.int("broker_id", hi=validate.ID_MAX),
                               f.str("after", None, hi=validate.NAME_CHARS_MAX),
                               f.int("limit", STREAMS_PAGE_MAX, lo=1, hi=STREAMS_PAGE_MAX))


def recovered(core: "Coordinator", f: Fields, now: float) -> dict:
    core.identities.authenticate("broker", f.int("broker_id", hi=validate.ID_MAX),
                      f.str("token", None, hi=schema.TOKEN_CHARS_MAX), now)
    cleared = core.failover.recovered(core, f.int("broker_id", hi=validate.ID_MAX),
                                      f.int("epoch", hi=validate.VERSION_MAX),
                                      parse_streamlets(f))
    if cleared:
        core.bump()
    return {"cleared": cleared}


def recovery_status(core: "Coordinator", f: Fields, now: float) -> dict:
    return {**core.failover.status(), "rebalance": core.rebalancer.status(core, now)}


def deregister(core: "Coordinator", f: Fields, now: float) -> dict:
    kind = validate.kind(f)
    member_id = f.int("daemon_id", hi=validate.ID_MAX)
    member = core.members[kind].get(member_id)
    if member is None:
        raise BadRequest(f"no {kind} has id {member_id}")
    why = core.kept_because(member, scan_replicas=False)
    if why:
        raise BadRequest(f"{kind} {member_id} cannot be deregistered: {why}")
    core.forget_member(member, "deregistered")
    return {"metadata_version": core.version}


def rebalance(core: "Coordinator", f: Fields, now: float) -> dict:
    return core.rebalancer.request(core, now, f.bool("dry_run", False))


def replicas(core: "Coordinator", f: Fields, now: float) -> dict:
    after = f.list("after", None, max_len=3)
    if after is not None:
        after = wire.int_list(after, "after", 3)
    limit = f.int("limit", REPLICAS_PAGE_MAX, lo=1, hi=REPLICAS_PAGE_MAX)
    entries = core.replica_map.entries(f.int("broker_id", None, hi=validate.ID_MAX),
                                   f.int("backup_id", None, hi=validate.ID_MAX),
                                   after=tuple(after) if after else None, limit=limit + 1)
    reply = {"replicas": entries[:limit]}
    if len(entries) > limit:
        reply["next"] = entries[limit - 1][:3]   # [broker_id, vlog, vseg]: the next `after`
    return reply


def consumed_for(core: "Coordinator", broker_id: int, held: int | None) -> dict:
    """Consumption marks (Groups.consumed_below) of the retain-until-consumed streams
    placed on `broker_id`, when its copy (`held`, a token that grows with every commit and
    metadata change) is stale."""
    token = core.groups.changes + core.version
    if held is None or held == token:
        return {}
    marks, count = [], 0
    for name, s in sorted(core.streams.items()):
        if s.spec.retain_until_consumed and broker_id in s.placement:
            count += s.spec.streamlets
            if count > CONSUMED_MARKS_MAX:
                break   # the rest keep their data (no mark: nothing consumed) until next time
            marks.append([s.id, core.groups.consumed_below(name, s.spec.streamlets)])
    return {"consumed_at": token, "consumed": marks}
