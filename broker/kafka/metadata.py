"""Metadata and DescribeCluster: topics with their partitions' leaders, and the brokers.

A topic has a partition per streamlet and active group slot (kera.broker.kafka.slots); a
partition's leader is the broker that owns its streamlet; a failover moves the streamlet,
and the next Metadata names the new owner (clients follow NOT_LEADER_OR_FOLLOWER with a
refresh, as with Kafka). A topic's id is derived from the cluster's and the stream's ids, so
every broker gives the same one and a recreated topic gets a new one. Topics the coordinator
does not know are created when auto-creation is on (Kafka's auto.create.topics.enable) and
the client allows it, and answered LEADER_NOT_AVAILABLE until their partitions have owners.
"""

from __future__ import annotations

import hashlib
import logging
import uuid

from kio.schema.errors import ErrorCode

from kera.broker.kafka import authorize, slots
from kera.broker.kafka.context import Call, Context
from kera.broker.kafka.topics import create_topic, valid_topic_name

log = logging.getLogger(__name__)


def topic_id(cluster_id: str, stream_id: int) -> uuid.UUID:
    digest = hashlib.sha256(f"{cluster_id}/{stream_id}".encode()).digest()
    return uuid.UUID(bytes=digest[:16])


def handle_metadata(ctx: Context, call: Call) -> None:
    ctx.catalog.fresh(lambda error: _answer(ctx, call))


def _answer(ctx: Context, call: Call) -> None:
    body = call.body
    asked = None if body.topics is None else [t.name for t in body.topics]
    if asked is not None and not asked and call.version == 0:
        asked = None                     # v0: an empty list means every topic
    names = sorted(ctx.catalog.topics) if asked is None else asked
    creating = _auto_create(ctx, call, names)
    call.answer({"brokers": brokers(ctx), "cluster_id": ctx.settings.cluster_id,
                 "controller_id": ctx.node_id,
                 "topics": [_topic(ctx, name, name in creating) for name in names]})


def brokers(ctx: Context) -> list[dict]:
    known = {b.node_id: b for b in ctx.catalog.brokers.values()}
    me = ctx.settings.advertise
    if me is not None and ctx.node_id >= 0:
        known[ctx.node_id] = me.with_id(ctx.node_id)
    return [{"node_id": b.node_id, "host": b.host, "port": b.port, "rack": None}
            for b in sorted(known.values(), key=lambda b: b.node_id)]


def _auto_create(ctx: Context, call: Call, names: list[str]) -> set[str]:
    allowed = getattr(call.body, "allow_auto_topic_creation", True)
    if not (ctx.settings.auto_create_topics and allowed):
        return set()
    missing = {n for n in names if n not in ctx.catalog.topics and valid_topic_name(n) is None
               and authorize.may_create(ctx, call, n)}
    for name in missing:
        create_topic(ctx, name, ctx.settings.default_partitions,
                     ctx.settings.default_replication, lambda code, message: None)
    return missing


def _topic(ctx: Context, name: str, creating: bool) -> dict:
    info = ctx.catalog.topics.get(name)
    if info is None:
        code = ErrorCode.leader_not_available if creating else ErrorCode.unknown_topic_or_partition
        if valid_topic_name(name) is not None:
            code = ErrorCode.invalid_topic_exception
        return {"error_code": code, "name": name, "partitions": [], "is_internal": False}
    live = ctx.catalog.brokers
    partitions = []
    for index in range(slots.partitions(info)):
        owner = info.placement[slots.place(info, index)[0]]
        leader = owner if owner is not None and (owner in live or owner == ctx.node_id) else -1
        partitions.append({
            "error_code": ErrorCode.none if leader >= 0 else ErrorCode.leader_not_available,
            "partition_index": index, "leader_id": leader, "leader_epoch": -1,
            "replica_nodes": [leader] if leader >= 0 else [],
            "isr_nodes": [leader] if leader >= 0 else [], "offline_replicas": []})
    return {"error_code": ErrorCode.none, "name": name, "partitions": partitions,
            "topic_id": topic_id(ctx.settings.cluster_id, info.id), "is_internal": False}


def handle_describe_cluster(ctx: Context, call: Call) -> None:
    call.answer({"error_code": ErrorCode.none, "cluster_id": ctx.settings.cluster_id,
                 "controller_id": ctx.node_id, "brokers": [
                     {"broker_id": b["node_id"], "host": b["host"], "port": b["port"],
                      "rack": None} for b in brokers(ctx)]})
