"""DeleteRecords: move partitions' start (Kafka's log start offset) forward, where retention
allows it.

kera deletes whole groups, never part of one (kera.broker.retention), so a partition's start
moves to the first record of the oldest group that holds a record at or past the offset
asked: each finished group wholly below it is deleted now, as retention would delete it; an
open group wholly below it (the partition's newest, with no record at or past the offset) is
closed, so its slot's next record opens a new group and it can go once durable. A slot's
last group goes only once the coordinator holds the partition's numbering (a heartbeat,
about a second; until then a failover would number from 0), and a group goes only once its
records are durable: what must wait is deleted by the retention passes that follow (every
0.5 s, kera.broker.retention's `delete_marks`). The answer's low watermark is the partition's
real start when it is given, which may be below the offset asked; Kafka's tools print it.

Offset -1 means the high watermark; past it is OFFSET_OUT_OF_RANGE, as in Kafka. A
compact-only topic answers POLICY_VIOLATION, as Kafka's: its records are removed by
compaction, not by offset. So does a topic with several active groups per streamlet
(kera.broker.kafka.slots): its partitions share their streamlet's groups, which are deleted
oldest first whatever their slot, so one partition's start cannot move alone; retention
deletes them.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera.broker.kafka import slots
from kera.broker.kafka.context import Call, Context
from kera.broker.kafka.errors import kafka_code
from kera.codec import cleanup
from kera.errors import KeraError

HIGH_WATERMARK = -1


def handle_delete_records(ctx: Context, call: Call) -> None:
    topics = [{"name": t.name,
               "partitions": [_partition(ctx, t.name, p.partition_index, p.offset)
                              for p in t.partitions]}
              for t in call.body.topics]
    call.answer({"topics": topics})


def _partition(ctx: Context, topic: str, index: int, offset: int) -> dict:
    out = {"partition_index": index, "low_watermark": -1, "error_code": ErrorCode.none}
    stream = ctx.stream_by_name(topic)
    if stream is None or slots.place(stream.info, index) is None:
        out["error_code"] = ErrorCode.not_leader_or_follower if stream is None and \
            topic in ctx.catalog.topics else ErrorCode.unknown_topic_or_partition
        return out
    if stream.info.active_groups != 1 or \
            not cleanup.deletes(getattr(stream.info, "cleanup_policy", cleanup.DEFAULT_POLICY)):
        out["error_code"] = ErrorCode.policy_violation
        return out
    try:
        out["low_watermark"], out["error_code"] = _delete(ctx, stream, index, offset)
    except KeraError as err:
        out["error_code"] = kafka_code(err)
    return out


def _delete(ctx: Context, stream, index: int, offset: int) -> tuple[int, ErrorCode]:
    """(the partition's start after deleting below `offset`, the error code)."""
    sid = stream.info.id
    start, end = ctx.core.reads.number_span(sid, index)   # not_owner, not_ready: refused here
    target = end if offset == HIGH_WATERMARK else offset
    if not 0 <= target <= end:
        return start, ErrorCode.offset_out_of_range
    streamlet = stream.streamlets.get(index)
    if streamlet is None or target <= start:
        return start, ErrorCode.none
    _close_if_below(ctx, streamlet, target)
    ctx.core.retention.delete_below(streamlet, target)
    return ctx.core.reads.number_span(sid, index)[0], ErrorCode.none


def _close_if_below(ctx: Context, streamlet, target: int) -> None:
    """Close the slot's open group when every record it holds lies below `target`, so that it
    is finished once durable and may be deleted (its slot's next record opens a new group, as
    after retention closes an old group)."""
    group = streamlet.slots[0] if streamlet.slots else None
    if group is None or group.closed or not group.head or group.number_base is None:
        return
    if group.number_base + group.head <= target:
        ctx.core.placement.close_group(group)
