"""Kafka's transaction APIs (the "transaction version 1" protocol, with KIP-447's
TxnOffsetCommit v3): AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn,
DescribeTransactions, ListTransactions, each mapped onto a `txn_*` op of kera's coordinator
(kera.coordinator.transactions, docs/TRANSACTIONS.md "Kafka's APIs").

Any broker forwards them: the transaction state lives in kera's coordinator, not in the broker
FindCoordinator names, so no request is refused NOT_COORDINATOR. TxnOffsetCommit goes to the
group's broker (as OffsetCommit: kera.broker.kafka.groups), which checks the generation and
member against its classic group first (KIP-447: a consumer fenced by a rebalance cannot commit
into a transaction). A part of a transaction is a (stream, streamlet): Kafka partition p of a
topic with one active group per streamlet. Topics with several (kera.broker.kafka.slots) take no
Kafka transactional writes: their partitions share a streamlet's transaction index under hashed
producer ids that markers cannot find.

The coordinator reports no start times: DescribeTransactions gives the epoch (1970) as the
start, and ListTransactions' duration filter (v1, "running longer than") keeps every open
transaction. Each broker lists the ids it coordinates (as ListGroups does), so a client merging
every broker's list sees each once.
"""

from __future__ import annotations

import datetime

from kio.schema.errors import ErrorCode

from kera.broker.kafka.context import Call, Context, Gather
from kera.broker.kafka.errors import kafka_code
from kera.broker.kafka.groups import not_here, coordinator_of
from kera.coordinator.kafka_offsets import METADATA_CHARS_MAX
from kera.errors import KeraError

# The first version of each API that knows PRODUCER_FENCED (KIP-588); older ones are told
# INVALID_PRODUCER_EPOCH, which they treat the same way (fatal for the producer).
FENCED_SINCE_VERSION = {22: 4, 24: 2, 25: 2, 26: 2, 28: 3}
# Kafka's transaction states (ListTransactions' state filters): kera's coordinator names its
# states the same; PrepareEpochFence is Kafka's only, never reported here.
KAFKA_STATES = ("Empty", "Ongoing", "PrepareCommit", "PrepareAbort", "CompleteCommit",
                "CompleteAbort", "Dead", "PrepareEpochFence")
# kera error codes that say the coordinator could not be asked (a failover, a timeout): the
# client finds the coordinator again and retries, as after a Kafka coordinator move.
COORDINATOR_GONE = ("unreachable", "not_leader", "timeout", "not_ready")
NO_START_TIME = datetime.datetime.fromtimestamp(0, datetime.timezone.utc)


def txn_code(error: KeraError | None, api_key: int, version: int) -> ErrorCode:
    """The Kafka code of a transaction op's outcome, for this API and version."""
    if error is None:
        return ErrorCode.none
    if error.code in COORDINATOR_GONE:
        return ErrorCode.coordinator_not_available
    if error.code == "not_authorized":
        return ErrorCode.transactional_id_authorization_failed
    code = kafka_code(error)
    if code == ErrorCode.producer_fenced and version < FENCED_SINCE_VERSION.get(api_key, 0):
        return ErrorCode.invalid_producer_epoch
    return code


def owner(transactional_id: str, producer_id: int, epoch: int) -> dict:
    return {"transactional_id": transactional_id, "producer_id": producer_id, "epoch": epoch}


# ---------------------------------------------------------------------- AddPartitionsToTxn
def handle_add_partitions(ctx: Context, call: Call) -> None:
    ctx.catalog.fresh(lambda error: _add_partitions(ctx, call, error))


def _add_partitions(ctx: Context, call: Call, listing_error: KeraError | None) -> None:
    b = call.body
    asked = [(t.name, p) for t in b.v3_and_below_topics for p in t.partitions]
    codes = {tp: _partition_refusal(ctx, *tp, listing_error) for tp in asked}

    def answer(default: ErrorCode) -> None:
        by_topic: dict[str, list] = {}
        for (topic, p) in asked:
            by_topic.setdefault(topic, []).append(
                {"partition_index": p, "partition_error_code": codes[(topic, p)] or default})
        call.answer({"results_by_topic_v3_and_below": [
            {"name": t, "results_by_partition": ps} for t, ps in by_topic.items()]})

    if any(codes.values()):   # as Kafka: all or nothing, the others not attempted
        answer(ErrorCode.operation_not_attempted)
        return
    fields = {**owner(b.v3_and_below_transactional_id, b.v3_and_below_producer_id,
                      b.v3_and_below_producer_epoch), "parts": [list(tp) for tp in asked]}
    ctx.catalog.calls.call("txn_add_parts", fields, lambda h, e: answer(
        txn_code(e, call.req.api_key, call.version)))


def _partition_refusal(ctx: Context, topic: str, partition: int,
                       listing_error: KeraError | None) -> ErrorCode:
    """Why partition `partition` of `topic` cannot join a transaction (0: it can)."""
    if listing_error is not None:
        return ErrorCode.coordinator_not_available
    info = ctx.catalog.topics.get(topic)
    if info is None or not 0 <= partition < info.streamlets * info.active_groups:
        return ErrorCode.unknown_topic_or_partition
    if info.active_groups != 1:
        return ErrorCode.invalid_request
    return ErrorCode.none


# ---------------------------------------------------------------------- AddOffsetsToTxn
def handle_add_offsets(ctx: Context, call: Call) -> None:
    b = call.body
    fields = {**owner(b.transactional_id, b.producer_id, b.producer_epoch),
              "group": b.group_id, "positions": [], "kafka": True}
    ctx.catalog.calls.call("txn_add_positions", fields, lambda h, e: call.answer(
        {"error_code": _group_code(e, call)}))


def _group_code(error: KeraError | None, call: Call) -> ErrorCode:
    if error is not None and error.code == "bad_request" and "group" in error.message:
        return ErrorCode.inconsistent_group_protocol   # a kera group's name
    return txn_code(error, call.req.api_key, call.version)


# ---------------------------------------------------------------------- TxnOffsetCommit
def handle_txn_offset_commit(ctx: Context, call: Call) -> None:
    b = call.body
    parts = [(t.name, p.partition_index, p.committed_offset, p.committed_metadata or "")
             for t in b.topics for p in t.partitions]

    def answer(code: ErrorCode) -> None:
        by_topic: dict[str, list] = {}
        for topic, index, _off, _meta in parts:
            by_topic.setdefault(topic, []).append({"partition_index": index, "error_code": code})
        call.answer({"topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()]})

    code = not_here(ctx, b.group_id) or _member_refusal(ctx, call)
    if not code and any(len(meta) > METADATA_CHARS_MAX for *_, meta in parts):
        code = ErrorCode.offset_metadata_too_large
    if code:
        answer(code)
        return
    fields = {**owner(b.transactional_id, b.producer_id, b.producer_epoch), "group": b.group_id,
              "kafka": True, "positions": [[t, p, [off, meta]] for t, p, off, meta in parts]}
    ctx.catalog.calls.call("txn_add_positions", fields,
                           lambda h, e: answer(_group_code(e, call)))


def _member_refusal(ctx: Context, call: Call) -> ErrorCode:
    """KIP-447 (v3): the committing consumer's generation and member, checked against the
    group as OffsetCommit checks them; earlier versions and a commit naming no member (a
    producer given only the group's name) are not checked, as in Kafka."""
    b = call.body
    generation, member = getattr(b, "generation_id", -1), getattr(b, "member_id", "")
    if generation < 0 and not member:
        return ErrorCode.none
    return ErrorCode(ctx.groups.commit_allowed(b.group_id, generation, member,
                                               ctx.clock.monotonic()))


# ---------------------------------------------------------------------- EndTxn
def handle_end_txn(ctx: Context, call: Call) -> None:
    b = call.body
    fields = {**owner(b.transactional_id, b.producer_id, b.producer_epoch),
              "commit": bool(b.committed)}
    ctx.catalog.calls.call("txn_end", fields, lambda h, e: call.answer(
        {"error_code": txn_code(e, call.req.api_key, call.version)}))


# ---------------------------------------------------------------------- describe and list
def handle_describe_transactions(ctx: Context, call: Call) -> None:
    ids = list(call.body.transactional_ids)
    gather = Gather(len(ids), lambda states: call.answer({"transaction_states": states}))
    for i, tid in enumerate(ids):
        ctx.catalog.calls.call("txn_describe", {"transactional_id": tid},
                               lambda h, e, i=i, tid=tid: gather.put(i, _described(ctx, tid, h, e)))


def _described(ctx: Context, tid: str, header: dict | None, error: KeraError | None) -> dict:
    out = {"transactional_id": tid, "transaction_state": "", "transaction_timeout": 0,
           "transaction_start_time": NO_START_TIME, "producer_id": -1, "producer_epoch": -1,
           "topics": []}
    if error is not None:
        code = ErrorCode.transactional_id_not_found if error.code == "invalid_producer_id_mapping" \
            else txn_code(error, 65, 0)
        return {**out, "error_code": code}
    topics: dict[str, list] = {}
    for stream, sl in header.get("parts", []):
        topics.setdefault(stream, []).extend(_partitions_of(ctx, stream, sl))
    return {**out, "error_code": ErrorCode.none, "transaction_state": header.get("state", ""),
            "transaction_timeout": header.get("timeout_ms", 0),
            "producer_id": header.get("producer_id", -1),
            "producer_epoch": header.get("epoch", -1),
            "topics": [{"topic": t, "partitions": ps} for t, ps in sorted(topics.items())]}


def _partitions_of(ctx: Context, stream: str, sl: int) -> list[int]:
    """The Kafka partitions of streamlet `sl` (one per active group slot)."""
    info = ctx.catalog.topics.get(stream)
    q = 1 if info is None else info.active_groups
    return list(range(sl * q, sl * q + q))


def _coordinates(ctx: Context, tid: str) -> bool:
    owner = coordinator_of(ctx, tid)
    return owner is not None and owner["node_id"] == ctx.node_id


def handle_list_transactions(ctx: Context, call: Call) -> None:
    b = call.body
    states = set(b.state_filters)
    pids = set(b.producer_id_filters)
    running_only = getattr(b, "duration_filter", -1) >= 0

    def done(header, error) -> None:
        if error is not None:
            call.answer({"error_code": txn_code(error, 66, call.version)})
            return
        rows = [{"transactional_id": t["transactional_id"], "producer_id": t["producer_id"],
                 "transaction_state": t["state"]} for t in header.get("transactions", [])]
        # each broker lists the ids it coordinates, as Kafka's do (clients merge the lists)
        rows = [r for r in rows if _coordinates(ctx, r["transactional_id"])
                and (not states or r["transaction_state"] in states)
                and (not pids or r["producer_id"] in pids)
                and (not running_only or r["transaction_state"] in KAFKA_STATES[1:4])]
        call.answer({"error_code": ErrorCode.none, "transaction_states": rows,
                     "unknown_state_filters": sorted(states - set(KAFKA_STATES))})

    ctx.catalog.calls.call("txn_list", {}, done)
