"""Kafka groups for kera's own tools: `kafka_group_members` and `kafka_group_reset`, two kera
ops (kera's protocol, CURVE and ACLs) a broker with a Kafka listener answers for the Kafka
groups it coordinates. `kera group describe` and `kera group reset-positions` use them.

A Kafka group's members live only on its coordinating broker (kera.broker.kafka.groups), so
that broker is where a reset must be refused while the group has members, and where the
check and the write are one step, as Kafka's own coordinator refuses an OffsetCommit without
a generation while a group is not Empty: a member joining between a check and a write would
otherwise commit its old positions over the reset. The write itself is kera's coordinator's
(`kafka_offset_commit`), as every Kafka commit's. A broker that does not coordinate the group
answers which broker does (its id), so the caller asks that one.
"""

from __future__ import annotations

from kera.broker.kafka.classic_groups import NONE
from kera.broker.kafka.consumer_protocol import assigned_partitions
from kera.broker.kafka.context import Context
from kera.broker.kafka.groups import coordinator_of
from kera.coordinator.kafka_offsets import GROUP_CHARS_MAX, PARTITIONS_PER_COMMIT_MAX
from kera.errors import GroupNotEmpty, KeraError, NotOwner

CONSUMER_PROTOCOL = "consumer"


def register(server, ctx: Context) -> None:
    """Answer the two ops on the broker's kera server (kera.net.server.Server)."""
    from kera.net.server import DEFERRED

    def on_reset(req):
        reset(ctx, req.fields, lambda error: server.reply(req, {}) if error is None
              else server.fail(req, error))
        return DEFERRED

    server.on("kafka_group_members", lambda req: members(ctx, req.fields))
    server.on("kafka_group_reset", on_reset)


def _group(fields) -> str:
    return fields.str("group", hi=GROUP_CHARS_MAX)


def members(ctx: Context, fields) -> dict:
    """{"coordinator": id} and, when that is this broker, the group's state and members with
    their assigned partitions; {"coordinator": None} while no broker may coordinate it."""
    group = _group(fields)
    owner = coordinator_of(ctx, group)
    if owner is None or owner["node_id"] != ctx.node_id:
        return {"coordinator": None if owner is None else owner["node_id"]}
    d = ctx.groups.describe(group)
    consumer = d.protocol_type == CONSUMER_PROTOCOL
    return {"coordinator": ctx.node_id, "state": d.state, "protocol_type": d.protocol_type,
            "protocol": d.protocol_name, "members": [
                {"member_id": m.member_id, "client_id": m.client_id, "host": m.client_host,
                 "assignment": [list(p) for p in assigned_partitions(m.assignment)]
                 if consumer else []} for m in d.members]}


def reset(ctx: Context, fields, done) -> None:
    """Store `offsets` ([[topic, partition, offset, metadata], ...]) as the group's commits,
    refused while the group has members; `done(None)` once stored, `done(error)` otherwise."""
    group = _group(fields)
    offsets = fields.list("offsets", max_len=PARTITIONS_PER_COMMIT_MAX)
    owner = coordinator_of(ctx, group)
    if owner is None or owner["node_id"] != ctx.node_id:
        where = "no broker does now" if owner is None else f"broker {owner['node_id']} does"
        raise NotOwner(f"broker {ctx.node_id} does not coordinate Kafka group {group!r}: "
                       f"{where}; ask it", retriable=True)
    if ctx.groups.commit_allowed(group, -1, "") != NONE:
        d = ctx.groups.describe(group)
        raise GroupNotEmpty(f"Kafka group {group!r} is {d.state} with {len(d.members)} "
                            f"members: stop its consumers (or wait for their sessions to end) "
                            f"and reset again")

    def stored(header, error: KeraError | None) -> None:
        done(error)

    ctx.catalog.calls.call("kafka_offset_commit", {"group": group, "offsets": offsets}, stored)
