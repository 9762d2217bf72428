"""ListOffsets: a partition's earliest and latest offsets, and the first offset at a time.

Offsets are record numbers: the earliest is the first retained record's, the latest the
durable end (the high watermark). By timestamp, the first durable record whose timestamp is
at or after the time asked (kera.broker.time_index), or -1 when none is, as Kafka answers.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera.broker.kafka.context import Call, Context
from kera.broker.kafka.errors import kafka_code
from kera.errors import KeraError

EARLIEST = -2
LATEST = -1
US_PER_MS = 1000


def handle_list_offsets(ctx: Context, call: Call) -> None:
    topics = [{"name": t.name,
               "partitions": [_partition(ctx, t.name, p) for p in t.partitions]}
              for t in call.body.topics]
    call.answer({"topics": topics})


def _partition(ctx: Context, topic: str, p) -> dict:
    out = {"partition_index": p.partition_index, "error_code": ErrorCode.none,
           "timestamp": -1, "offset": -1, "leader_epoch": -1}
    stream = ctx.stream_by_name(topic)
    if stream is None or not 0 <= p.partition_index < stream.info.streamlets:
        out["error_code"] = ErrorCode.not_leader_or_follower if stream is None and \
            topic in ctx.catalog.topics else ErrorCode.unknown_topic_or_partition
        return out
    try:
        out["offset"], out["timestamp"] = _offset(ctx, stream.info.id, p.partition_index,
                                                  p.timestamp)
    except KeraError as err:
        out["error_code"] = kafka_code(err)
    return out


def _offset(ctx: Context, sid: int, sl: int, timestamp: int) -> tuple[int, int]:
    """(offset, the found record's timestamp in ms, -1 for the special queries)."""
    start, end = ctx.core.number_span(sid, sl)
    if timestamp == EARLIEST:
        return start, -1
    if timestamp < 0:                      # LATEST, and the max-timestamp query (-3)
        return end, -1
    found = ctx.core.number_at_time(sid, sl, timestamp * US_PER_MS)
    if found is None:
        return -1, -1
    return found[0], found[1] // US_PER_MS
