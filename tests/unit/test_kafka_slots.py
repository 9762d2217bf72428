"""Kafka partitions of a stream with several active groups (kera.broker.kafka.slots): partition p
is slot p % Q of streamlet p // Q, each with dense offsets through Produce, Fetch and
ListOffsets; and Fetch's min_bytes (kera.broker.kafka.fetch). Sans-IO: the Kafka handlers
driven over a real broker core, with stand-ins for the request and the clock."""

import datetime
import struct
from types import SimpleNamespace

import pytest

from kera.broker.kafka import slots
from kera.broker.kafka.fetch import handle_fetch
from kera.broker.kafka.produce import handle_produce
from kera.broker.kafka.topics import streamlets_for
from kera.codec import chunk, kafka_batch
from tests.unit.test_retention_core import broker, desc

KiB = 1024
BATCH = struct.Struct(">qi")        # a batch's base offset and length (after them: 49 bytes ...)
COUNT_AT = 57                       # ... to its record count


class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def context(b):
    streams = {s.info.name: s for s in b.streams.values()}
    return SimpleNamespace(core=b, clock=Clock(), wake_at=lambda deadline: None,
                           stream_by_name=streams.get)


def call(body, answers: list, version: int = 9):
    return SimpleNamespace(body=body, version=version, answer=answers.append)


def produce(ctx, partition: int, tag: bytes, n: int = 10, pid: int = -1, seq: int = -1) -> dict:
    """One Kafka batch of `n` ~100-byte records to `partition` of s1; its partition answer."""
    rows = [(1000 + i, None, tag + b"-%d" % i + b"." * 90, ()) for i in range(n)]
    batch = kafka_batch.build(rows, producer_id=pid, producer_epoch=0 if pid >= 0 else -1,
                              base_sequence=seq)
    answers: list = []
    body = SimpleNamespace(acks=-1, topic_data=[SimpleNamespace(name="s1", partition_data=[
        SimpleNamespace(index=partition, records=batch)])])
    handle_produce(ctx, call(body, answers))
    [answer] = answers
    [part] = answer["responses"][0]["partition_responses"]
    return part


def fetch_call(partition: int, offset: int, min_bytes: int = 1, max_wait_ms: int = 0):
    answers: list = []
    body = SimpleNamespace(max_wait=datetime.timedelta(milliseconds=max_wait_ms),
                           min_bytes=min_bytes, isolation_level=0, topics=[SimpleNamespace(
                               topic="s1", partitions=[SimpleNamespace(
                                   partition=partition, fetch_offset=offset,
                                   partition_max_bytes=1 << 20)])])
    return call(body, answers, version=12), answers


def fetched(answers: list) -> dict:
    [answer] = answers
    [part] = answer["responses"][0]["partitions"]
    return part


def batches(records: bytes) -> list[tuple[int, int, bytes]]:
    """(base offset, record count, the batch's bytes) of each batch of a fetched partition."""
    out, at = [], 0
    while at < len(records):
        base, length = BATCH.unpack_from(records, at)
        count = struct.unpack_from(">i", records, at + COUNT_AT)[0]
        out.append((base, count, bytes(records[at:at + 12 + length])))
        at += 12 + length
    return out


def read_all(ctx, partition: int, offset: int = 0) -> list:
    """Every batch of `partition` from `offset` to its high watermark, fetch after fetch (one
    fetch reads up to the end of a group), as a Kafka consumer goes on."""
    got: list = []
    for _ in range(100):
        c, answers = fetch_call(partition, offset)
        handle_fetch(ctx, c)
        part = fetched(answers)
        assert part["error_code"] == 0 and part["log_start_offset"] == 0
        if offset == part["high_watermark"]:
            return got
        got.extend(batches(part["records"]))
        offset = got[-1][0] + got[-1][1]
    raise AssertionError("no end after 100 fetches")


def two_slots():
    """A stream of one streamlet with 2 active groups (Kafka partitions 0 and 1), 4 KiB
    one-segment groups, so that the slots' groups interleave."""
    return broker(desc(Q=2, G=1, seg=4 * KiB))


def test_partitions_are_streamlet_and_slot():
    info = SimpleNamespace(streamlets=3, active_groups=2)
    assert slots.partitions(info) == 6
    assert [slots.place(info, p) for p in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                         (2, 0), (2, 1)]
    assert slots.place(info, 6) is None and slots.place(info, -1) is None
    assert slots.partition_of(info, 2, 1) == 5


def test_producer_ids_land_in_their_slot_and_stay_apart():
    info = SimpleNamespace(active_groups=3)
    ids = {slot: slots.producer_id(12345 << 8, info, slot) for slot in range(3)}
    assert all(pid % 3 == slot and pid >= slots.ANONYMOUS_IDS for slot, pid in ids.items())
    assert len(set(ids.values())) == 3
    assert slots.producer_id(12345 << 8, SimpleNamespace(active_groups=1), 0) == 12345 << 8
    assert [slots.producer_id(0, info, s) for s in range(3)] == [0, 1, 2]


def test_each_partition_has_dense_offsets_through_produce_and_fetch():
    b = two_slots()
    ctx = context(b)
    bases = {0: [], 1: []}
    for i in range(6):
        # partition 0: an idempotent producer; partition 1: one without idempotence
        bases[0].append(produce(ctx, 0, b"p0-%d" % i, pid=77, seq=10 * i)["base_offset"])
        bases[1].append(produce(ctx, 1, b"p1-%d" % i)["base_offset"])
    assert bases == {0: list(range(0, 60, 10)), 1: list(range(0, 60, 10))}
    produce(ctx, 0, b"p0-5", pid=77, seq=50)                    # a retry: stored once
    streamlet = b.streams[1].streamlets[0]
    assert [g.slot for g in streamlet.groups] == [0, 1, 0, 1], "the slots' groups interleave"
    info = b.streams[1].info
    assert slots.span(b, info, 0, 0) == (0, 60) and slots.span(b, info, 0, 1) == (0, 60)
    for partition in (0, 1):
        got = read_all(ctx, partition)
        assert [(base, n) for base, n, _ in got] == [(i, 10) for i in range(0, 60, 10)]
        assert all(b"p%d-" % partition in raw and b"p%d-" % (1 - partition) not in raw
                   for _, _, raw in got), "only the partition's own slot is read"
    c, answers = fetch_call(1, 25)
    handle_fetch(ctx, c)
    assert batches(fetched(answers)["records"])[0][0] == 20, "inside a batch: that batch"


def test_kera_producers_write_the_partition_of_their_slot():
    b = two_slots()
    ctx = context(b)
    produce(ctx, 1, b"kafka")                                   # partition 1: numbers 0..9
    b.produce(1, [chunk.encode(3, 0, 1, 0, [b"kera-%d" % i for i in range(4)])], 0.0)
    b.produce(2, [chunk.encode(4, 0, 1, 0, [b"even"] * 2)], 0.0)  # producer 4: slot 0
    info = b.streams[1].info
    assert slots.span(b, info, 0, 1) == (0, 14) and slots.span(b, info, 0, 0) == (0, 2)
    c, answers = fetch_call(1, 10)
    handle_fetch(ctx, c)
    [(base, n, raw)] = batches(fetched(answers)["records"])
    assert (base, n) == (10, 4) and b"kera-3" in raw


def test_number_at_time_is_the_slots_own():
    b = two_slots()
    ctx = context(b)
    produce(ctx, 0, b"a")                                       # timestamps 1000..1009
    produce(ctx, 1, b"b")
    info = b.streams[1].info
    assert slots.number_at_time(b, info, 0, 1, 1005 * 1000)[0] == 5
    assert slots.number_at_time(b, info, 0, 1, 2000 * 1000) is None
    assert slots.numbers(b, 1, 0, 1, 1003 * 1000) == {"start": 0, "end": 10, "at_time": 3}


def test_create_partitions_adds_whole_streamlets():
    info = SimpleNamespace(name="t", active_groups=4)
    assert streamlets_for(info, 12) == (3, None)
    count, why = streamlets_for(info, 10)
    assert count == 0 and "multiple of 4" in why and "such as 12" in why
    assert streamlets_for(None, 5) == (5, None)


@pytest.mark.parametrize("Q", [1, 2])
def test_fetch_is_held_until_min_bytes_are_durable(Q):
    b = broker(desc(Q=Q, G=1, seg=64 * KiB))
    ctx = context(b)
    c, answers = fetch_call(0, 0, min_bytes=3000, max_wait_ms=400)
    handle_fetch(ctx, c)
    assert answers == [], "nothing durable: held"
    for i in range(3):
        produce(ctx, 0, b"x%d" % i)                             # ~1.2 KB each
        for token in b.reads.take_ready_fetches(ctx.clock.monotonic()):
            token.done(None)
        if i < 2:
            assert answers == [], f"{i + 1} batches are fewer than min_bytes: held again"
    assert [n for _, n, _ in batches(fetched(answers)["records"])] == [10, 10, 10]


def test_fetch_below_min_bytes_is_answered_when_its_wait_is_over():
    b = broker(desc(G=1, seg=64 * KiB))
    ctx = context(b)
    produce(ctx, 0, b"y")
    c, answers = fetch_call(0, 0, min_bytes=1 << 20, max_wait_ms=300)
    handle_fetch(ctx, c)
    assert answers == [] and b.reads.take_ready_fetches(0.299) == []
    ctx.clock.now = 0.3
    for token in b.reads.take_ready_fetches(ctx.clock.now):
        token.done(None)
    assert [n for _, n, _ in batches(fetched(answers)["records"])] == [10]
    c, answers = fetch_call(0, 0, min_bytes=1, max_wait_ms=300)
    handle_fetch(ctx, c)
    assert len(answers) == 1, "min_bytes found: answered at once"


def test_an_empty_partition_beside_a_written_one_is_answered_empty():
    b = two_slots()
    ctx = context(b)
    produce(ctx, 1, b"only-slot-1")
    c, answers = fetch_call(0, 0)
    handle_fetch(ctx, c)
    part = fetched(answers)
    assert (part["error_code"], part["records"], part["high_watermark"]) == (0, b"", 0)
    produce(ctx, 0, b"now-slot-0")
    assert [n for _, n, _ in read_all(ctx, 0)] == [10]
