"""The classic consumer-group APIs: FindCoordinator, JoinGroup, SyncGroup, Heartbeat,
LeaveGroup, OffsetCommit, OffsetFetch, ListGroups, DescribeGroups, DeleteGroups, OffsetDelete.

Membership runs on one broker per group (kera.broker.kafka.classic_groups): the live Kafka
broker the group id hashes to, which FindCoordinator names; a request for a group that hashes
elsewhere is answered NOT_COORDINATOR, so the client looks again (after a broker failure the
group moves, its members rejoin and resume from the commits). Committed offsets are the
coordinator's (kera.coordinator.kafka_offsets), so they survive brokers and coordinator
failovers; each commit is checked against the group's generation and member here first.
"""

from __future__ import annotations

import zlib

from kio.schema.errors import ErrorCode

from kera.broker.kafka.context import Call, Context, Gather
from kera.broker.kafka.errors import kafka_code
from kera.broker.kafka.metadata import brokers
from kera.coordinator.kafka_offsets import METADATA_CHARS_MAX

KEY_TYPE_GROUP = 0
KEY_TYPE_TRANSACTION = 1


def coordinator_of(ctx: Context, group_id: str) -> dict | None:
    """The broker (as Metadata lists it) that coordinates `group_id`, None when none is live."""
    live = brokers(ctx)
    if not live:
        return None
    return live[zlib.crc32(group_id.encode()) % len(live)]


def not_here(ctx: Context, group_id: str) -> ErrorCode | None:
    """Kafka's refusal of a group request sent to a broker that does not coordinate the
    group (NOT_COORDINATOR, or COORDINATOR_NOT_AVAILABLE while none does); None here."""
    owner = coordinator_of(ctx, group_id)
    if owner is None:
        return ErrorCode.coordinator_not_available
    return None if owner["node_id"] == ctx.node_id else ErrorCode.not_coordinator


def _ms(value) -> int:
    return int(value.total_seconds() * 1000) if hasattr(value, "total_seconds") else int(value)


# ---------------------------------------------------------------------- FindCoordinator
def handle_find_coordinator(ctx: Context, call: Call) -> None:
    body = call.body
    keys = list(body.coordinator_keys) if hasattr(body, "coordinator_keys") else [body.key]
    found = [_coordinator(ctx, key, getattr(body, "key_type", KEY_TYPE_GROUP)) for key in keys]
    if hasattr(body, "coordinator_keys"):
        call.answer({"coordinators": found})
    else:
        call.answer(found[0])


def _coordinator(ctx: Context, key: str, key_type: int) -> dict:
    """A group's or a transactional id's coordinator: the live broker its name hashes to. A
    transactional id's requests are forwarded to kera's coordinator by whichever broker takes
    them (kera.broker.kafka.transactions); the hash only spreads the clients."""
    known = key_type in (KEY_TYPE_GROUP, KEY_TYPE_TRANSACTION)
    owner = coordinator_of(ctx, key) if known else None
    if owner is None:
        return {"key": key, "error_code": ErrorCode.coordinator_not_available, "node_id": -1,
                "host": "", "port": -1, "error_message": "no live Kafka broker" if known
                else f"key type {key_type} is not a group (0) or a transaction (1)"}
    return {"key": key, "error_code": ErrorCode.none, "error_message": None,
            "node_id": owner["node_id"], "host": owner["host"], "port": owner["port"]}


# ---------------------------------------------------------------------- membership
def handle_join_group(ctx: Context, call: Call) -> None:
    b = call.body
    refused = not_here(ctx, b.group_id)
    if refused is not None:
        call.answer({"error_code": refused, "generation_id": -1, "member_id": b.member_id})
        return
    session_ms = _ms(b.session_timeout)
    rebalance_ms = _ms(getattr(b, "rebalance_timeout", b.session_timeout))
    result = ctx.groups.join(
        b.group_id, b.member_id, call.req.client_id or "", call.conn.state["source"],
        session_ms, rebalance_ms, b.protocol_type, [(p.name, p.metadata) for p in b.protocols],
        call.version >= 4, call, ctx.clock.monotonic())
    _park_or_answer(ctx, call, result)


def _join_answer(result) -> dict:
    return {"error_code": result.error, "generation_id": result.generation_id,
            "protocol_type": result.protocol_type, "protocol_name": result.protocol_name,
            "leader": result.leader_id, "member_id": result.member_id,
            "members": [{"member_id": m, "group_instance_id": None, "metadata": meta}
                        for m, meta in result.members]}


def _sync_answer(result) -> dict:
    return {"error_code": result.error, "assignment": result.assignment,
            "protocol_type": result.protocol_type, "protocol_name": result.protocol_name}


def _park_or_answer(ctx: Context, call: Call, result) -> None:
    if result is not None:
        call.answer(_join_answer(result) if hasattr(result, "leader_id") else _sync_answer(result))
    else:
        forget = lambda: ctx.groups.forget_token(call)   # noqa: E731 (a closure per call)
        call.conn.state.setdefault("on_close", []).append(forget)
    pump(ctx)


def handle_sync_group(ctx: Context, call: Call) -> None:
    b = call.body
    refused = not_here(ctx, b.group_id)
    if refused is not None:
        call.answer({"error_code": refused})
        return
    result = ctx.groups.sync(
        b.group_id, b.generation_id, b.member_id,
        [(a.member_id, a.assignment) for a in b.assignments], call, ctx.clock.monotonic(),
        getattr(b, "protocol_type", None), getattr(b, "protocol_name", None))
    _park_or_answer(ctx, call, result)


def handle_heartbeat(ctx: Context, call: Call) -> None:
    b = call.body
    code = not_here(ctx, b.group_id) or ctx.groups.heartbeat(
        b.group_id, b.generation_id, b.member_id, ctx.clock.monotonic())
    call.answer({"error_code": code})
    pump(ctx)


def handle_leave_group(ctx: Context, call: Call) -> None:
    b = call.body
    members = [m.member_id for m in b.members] if hasattr(b, "members") else [b.member_id]
    refused = not_here(ctx, b.group_id)
    if refused is not None:
        call.answer({"error_code": refused, "members": []})
        return
    results = ctx.groups.leave(b.group_id, members, ctx.clock.monotonic())
    first = next((code for _, code in results if code), 0)
    call.answer({"error_code": first if not hasattr(b, "members") else 0,
                 "members": [{"member_id": m, "group_instance_id": None, "error_code": code}
                             for m, code in results]})
    pump(ctx)


def pump(ctx: Context) -> None:
    """Answer the parked JoinGroup and SyncGroup requests that are ready, and wake the loop
    at the next group deadline (the broker daemon calls this after every turn too)."""
    now = ctx.clock.monotonic()
    ctx.groups.tick(now)
    for call, result in ctx.groups.take_ready(now):
        if not call.conn.closed:
            call.answer(_join_answer(result) if hasattr(result, "leader_id")
                        else _sync_answer(result))
    deadline = ctx.groups.next_deadline()
    if deadline is not None:
        ctx.wake_at(deadline)


# ---------------------------------------------------------------------- offsets
def handle_offset_commit(ctx: Context, call: Call) -> None:
    b = call.body
    generation = getattr(b, "generation_id_or_member_epoch", getattr(b, "generation_id", -1))
    code = not_here(ctx, b.group_id) or ctx.groups.commit_allowed(
        b.group_id, generation, b.member_id, ctx.clock.monotonic())
    parts = [(t.name, p.partition_index, p.committed_offset, p.committed_metadata or "")
             for t in b.topics for p in t.partitions]

    def answer(code) -> None:
        by_topic: dict[str, list] = {}
        for topic, index, _off, _meta in parts:
            by_topic.setdefault(topic, []).append({"partition_index": index, "error_code": code})
        call.answer({"topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()]})

    if not code and any(len(meta) > METADATA_CHARS_MAX for *_, meta in parts):
        code = ErrorCode.offset_metadata_too_large
    if code:
        answer(code)
        return
    ctx.catalog.calls.call("kafka_offset_commit", {"group": b.group_id, "offsets": [
        list(p) for p in parts]}, lambda h, e: answer(0 if e is None else _group_code(e)))


def _group_code(error) -> ErrorCode:
    if error.code == "bad_request":       # the name is a kera group's, or offsets are full
        return ErrorCode.inconsistent_group_protocol
    return ErrorCode.coordinator_not_available if error.retriable else kafka_code(error)


def handle_offset_fetch(ctx: Context, call: Call) -> None:
    b = call.body
    if hasattr(b, "groups"):
        asks = [(g.group_id, g.topics) for g in b.groups]
    else:
        asks = [(b.group_id, b.topics)]
    gather = Gather(len(asks), lambda answers: call.answer(
        {"groups": answers} if hasattr(b, "groups") else answers[0]))
    for i, (group, topics) in enumerate(asks):
        ctx.catalog.calls.call("kafka_offset_fetch", {"group": group},
                               lambda h, e, i=i, g=group, t=topics:
                               gather.put(i, _fetched(g, t, h, e)))


def _fetched(group: str, topics, header, error) -> dict:
    if error is not None:
        return {"group_id": group, "error_code": ErrorCode.coordinator_not_available,
                "topics": []}
    stored = {(t, p): (off, meta) for t, p, off, meta in header.get("offsets", [])}
    if topics is None:
        wanted: dict[str, list] = {}
        for t, p in stored:
            wanted.setdefault(t, []).append(p)
    else:
        wanted = {t.name: list(t.partition_indexes) for t in topics}
    out = [{"name": t, "partitions": [_committed(stored.get((t, p)), p) for p in ps]}
           for t, ps in wanted.items()]
    return {"group_id": group, "error_code": ErrorCode.none, "topics": out}


def _committed(entry, index: int) -> dict:
    offset, metadata = entry if entry is not None else (-1, "")
    return {"partition_index": index, "committed_offset": offset, "committed_leader_epoch": -1,
            "metadata": metadata, "error_code": ErrorCode.none}


# ---------------------------------------------------------------------- admin
def handle_list_groups(ctx: Context, call: Call) -> None:
    local = {g: (ptype, state) for g, ptype, state in ctx.groups.list()}

    def done(header, error) -> None:
        stored = header.get("groups", []) if error is None else []
        # each broker lists the groups it coordinates, as Kafka's do (clients merge the lists)
        names = set(local) | {g for g in stored if not_here(ctx, g) is None}
        call.answer({"error_code": ErrorCode.none, "groups": [
            {"group_id": g, "protocol_type": local.get(g, ("consumer", ""))[0],
             "group_state": local.get(g, ("", "Empty"))[1]} for g in sorted(names)]})

    ctx.catalog.calls.call("kafka_group_list", {}, done)


def handle_describe_groups(ctx: Context, call: Call) -> None:
    call.answer({"groups": [_described(ctx, g) for g in call.body.groups]})


def _described(ctx: Context, group_id: str) -> dict:
    refused = not_here(ctx, group_id)
    if refused is not None:
        return {"error_code": refused, "group_id": group_id, "group_state": "",
                "protocol_type": "", "protocol_data": "", "members": []}
    d = ctx.groups.describe(group_id)
    return {"error_code": ErrorCode.none, "group_id": group_id, "group_state": d.state,
            "protocol_type": d.protocol_type, "protocol_data": d.protocol_name,
            "members": [{"member_id": m.member_id, "group_instance_id": None,
                         "client_id": m.client_id, "client_host": m.client_host,
                         "member_metadata": m.metadata, "member_assignment": m.assignment}
                        for m in d.members]}


def handle_delete_groups(ctx: Context, call: Call) -> None:
    names = list(call.body.groups_names)
    gather = Gather(len(names), lambda codes: call.answer({"results": [
        {"group_id": g, "error_code": code} for g, code in zip(names, codes)]}))
    done = gather.put
    for i, group in enumerate(names):
        code = not_here(ctx, group) or ctx.groups.delete(group)
        if code and code != ErrorCode.group_id_not_found:
            done(i, code)
            continue
        ctx.catalog.calls.call("kafka_offset_delete", {"group": group},
                               lambda h, e, i=i: done(i, 0 if e is None else _group_code(e)))


def handle_offset_delete(ctx: Context, call: Call) -> None:
    """OffsetDelete: forget some partitions' committed offsets of a group. As Kafka: refused
    for a topic the group's live members subscribe to (GROUP_SUBSCRIBED_TO_TOPIC), and whole
    (NON_EMPTY_GROUP) while members of another protocol than "consumer" are in it."""
    b = call.body
    parts = [(t.name, p.partition_index) for t in b.topics for p in t.partitions]
    code = not_here(ctx, b.group_id)
    subscribed = ctx.groups.subscribed(b.group_id) if code is None else set()
    if subscribed is None:
        code = ErrorCode.non_empty_group

    def answer(top: ErrorCode, per_part) -> None:
        by_topic: dict[str, list] = {}
        for topic, index in parts:
            by_topic.setdefault(topic, []).append({"partition_index": index,
                                                   "error_code": per_part(topic)})
        call.answer({"error_code": top, "topics": [{"name": t, "partitions": ps}
                                                   for t, ps in by_topic.items()]})

    if code:
        answer(code, lambda topic: ErrorCode.none)
        return
    deleted = [[t, p] for t, p in parts if t not in subscribed]

    def part_code(topic: str) -> ErrorCode:
        return ErrorCode.group_subscribed_to_topic if topic in subscribed else ErrorCode.none

    def stored(header, error) -> None:
        if error is not None:
            answer(_group_code(error), lambda topic: ErrorCode.none)
        elif header.get("found") is False and not ctx.groups.describe(b.group_id).members:
            answer(ErrorCode.group_id_not_found, lambda topic: ErrorCode.none)
        else:
            answer(ErrorCode.none, part_code)

    ctx.catalog.calls.call("kafka_offset_delete", {"group": b.group_id, "partitions": deleted},
                           stored)
