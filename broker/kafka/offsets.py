"""ListOffsets: a partition's earliest and latest offsets, the first offset at a time, and
the record with the largest timestamp.

Offsets are record numbers of the partition's slot (kera.broker.kafka.slots): the earliest is the first retained record's, the latest the
durable end (the high watermark). By timestamp, the first durable record whose timestamp is
at or after the time asked (kera.broker.time_index), or -1 when none is, as Kafka answers.
By max timestamp (-3, v7, KIP-734): the first record carrying the largest timestamp, found
by a binary search over that same query (the time index keeps each group's running maximum,
so each probe is a few index lookups; a search is at most TIMESTAMP_PROBES_MAX of them).
With isolation_level 1 (read_committed) the latest offset is the LSO, the first offset of the
partition's oldest open transaction (kera.broker.kafka.fetch.last_stable), as Kafka answers.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera.broker.kafka import slots
from kera.broker.kafka.context import Call, Context
from kera.broker.kafka.errors import kafka_code
from kera.broker.kafka.fetch import READ_COMMITTED, last_stable
from kera.errors import KeraError

EARLIEST = -2
LATEST = -1
MAX_TIMESTAMP = -3
US_PER_MS = 1000
# Timestamps searched for the largest: 0 to 2**63 - 1 µs, so 63 halvings find it (records
# stamped before 1970 are not searched: Kafka's producers stamp with the wall clock).
TIMESTAMP_US_SEARCHED_MAX = 2**63 - 1
TIMESTAMP_PROBES_MAX = 64


def handle_list_offsets(ctx: Context, call: Call) -> None:
    committed = getattr(call.body, "isolation_level", 0) == READ_COMMITTED
    topics = [{"name": t.name,
               "partitions": [_partition(ctx, t.name, p, committed) for p in t.partitions]}
              for t in call.body.topics]
    call.answer({"topics": topics})


def _partition(ctx: Context, topic: str, p, committed: bool = False) -> dict:
    out = {"partition_index": p.partition_index, "error_code": ErrorCode.none,
           "timestamp": -1, "offset": -1, "leader_epoch": -1}
    stream = ctx.stream_by_name(topic)
    where = None if stream is None else slots.place(stream.info, p.partition_index)
    if where is None:
        out["error_code"] = ErrorCode.not_leader_or_follower if stream is None and \
            topic in ctx.catalog.topics else ErrorCode.unknown_topic_or_partition
        return out
    try:
        out["offset"], out["timestamp"] = _offset(ctx, stream.info, *where, p.timestamp,
                                                  committed)
    except KeraError as err:
        out["error_code"] = kafka_code(err)
    return out


def _offset(ctx: Context, info, sl: int, slot: int, timestamp: int,
            committed: bool = False) -> tuple[int, int]:
    """(offset, the found record's timestamp in ms, -1 for the special queries) in slot `slot`
    of streamlet `sl` (kera.broker.kafka.slots); `committed`: the latest is the LSO."""
    start, end = slots.span(ctx.core, info, sl, slot)
    if committed:
        end = last_stable(ctx.core, info.id, sl, slot, end)[0]
    if timestamp == EARLIEST:
        return start, -1
    if timestamp == MAX_TIMESTAMP:
        found = latest_stamped(lambda us: slots.number_at_time(ctx.core, info, sl, slot, us))
        return (-1, -1) if found is None else (found[0], found[1] // US_PER_MS)
    if timestamp < 0:                      # LATEST, and queries of later versions (-4, -5)
        return end, -1
    found = slots.number_at_time(ctx.core, info, sl, slot, timestamp * US_PER_MS)
    if found is None:
        return -1, -1
    return found[0], found[1] // US_PER_MS


def latest_stamped(first_at) -> tuple[int, int] | None:
    """(number, timestamp µs) of the first record carrying the largest timestamp, None when
    there is none; `first_at(us)` is the first record at or after `us`, or None. Sans-IO: the
    largest `us` that still finds a record is the largest timestamp, and its first record is
    the first record that carries it."""
    found = first_at(0)
    if found is None:
        return None
    lo, hi = found[1], TIMESTAMP_US_SEARCHED_MAX   # first_at(lo) finds a record
    for _ in range(TIMESTAMP_PROBES_MAX):
        if lo >= hi:
            break
        mid = (lo + hi + 1) // 2
        probe = first_at(mid)
        if probe is None:
            hi = mid - 1
        else:
            lo, found = probe[1], probe
    return found
