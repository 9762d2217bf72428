"""Produce: each partition's record batch is stored as one kera chunk, as the client built it.

The batch is checked (magic, length, CRC, record count) and wrapped, not decoded: compressed
batches stay compressed. A Kafka idempotent producer's (producer id, epoch) becomes the
chunk's kera producer id and its base sequence the chunk's sequence, so the broker's producer
table (kera.broker.producers.classify_kafka) stores a retried batch once; a producer without
idempotence gets no table entry, as in Kafka. acks=1 is answered as acks=all: kera answers
only once the records are durable on every copy the stream asks for.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera.broker.producers import ANONYMOUS_PRODUCER_ID
from kera.broker.kafka.context import Call, Context, Deferred
from kera.broker.kafka.errors import kafka_code
from kera.broker.kafka.producer_ids import PRODUCER_ID_BITS
from kera.codec import kafka_batch
from kera.codec.chunk import wrap
from kera.errors import KeraError, KeylessRecord

# Kafka answers a keyless record on a compacted topic INVALID_RECORD from Produce v8 on (KIP-467
# added the code); older clients know the same refusal as CORRUPT_MESSAGE.
INVALID_RECORD_SINCE_VERSION = 8

# Bits of a kera producer id below a Kafka producer id: its epoch, modulo 256 (an epoch grows
# only when a producer is bumped after an error; 256 bumps would meet the first epoch's entry).
EPOCH_BITS = 8


def kera_producer_id(producer_id: int, epoch: int) -> int:
    """The kera producer id of a Kafka producer's (id, epoch): a new epoch is a new kera
    producer, whose sequences start afresh as Kafka's do."""
    if producer_id < 0:
        return ANONYMOUS_PRODUCER_ID
    return (producer_id << EPOCH_BITS) | (epoch & ((1 << EPOCH_BITS) - 1))


class Entry:
    """One partition of a Produce request: its answer so far and its chunk's index."""
    __slots__ = ("topic", "partition", "error", "message", "frame")

    def __init__(self, topic: str, partition: int):
        self.topic, self.partition = topic, partition
        self.error, self.message, self.frame = ErrorCode.none, None, None

    def refuse(self, code: ErrorCode, message: str) -> "Entry":
        self.error, self.message = code, message
        return self


def handle_produce(ctx: Context, call: Call) -> None:
    frames: list = []
    entries = [_prepare(ctx, topic.name, part, frames)
               for topic in call.body.topic_data for part in topic.partition_data]
    acks = call.body.acks
    pending = ProduceReply(call, entries, acks)
    if not frames:
        pending.done([])
        return
    try:
        results = ctx.core.produce(pending, frames, ctx.clock.monotonic(), acks != 0)
    except KeraError as err:            # refused whole: not registered, or every chunk throttled
        for e in entries:
            if e.frame is not None:
                e.refuse(kafka_code(err), err.message)
        pending.done([])
        return
    if results is not None:
        pending.done(results)


def _prepare(ctx: Context, topic: str, part, frames: list) -> Entry:
    entry = Entry(topic, part.index)
    batch = part.records
    stream = ctx.stream_by_name(topic)
    if stream is None or not 0 <= part.index < stream.info.streamlets:
        return entry.refuse(ErrorCode.unknown_topic_or_partition,
                            f"no partition {part.index} of topic {topic!r} on this broker")
    if stream.info.active_groups != 1:
        return entry.refuse(ErrorCode.invalid_request,
                            f"topic {topic!r} has {stream.info.active_groups} active groups per "
                            f"streamlet; Kafka clients write streams created with one")
    if not batch:
        return entry.refuse(ErrorCode.invalid_record, "a partition with no record batch")
    try:
        h = kafka_batch.read_header(batch)   # wrap() checks the whole batch, CRC included
        if h.producer_id >= 1 << PRODUCER_ID_BITS:
            return entry.refuse(ErrorCode.unknown_producer_id,
                                f"producer id {h.producer_id} was not issued by kera")
        if h.producer_id >= 0 and h.base_sequence < 0:
            return entry.refuse(ErrorCode.invalid_record,
                                f"an idempotent batch (producer {h.producer_id}) without a sequence")
        pid = kera_producer_id(h.producer_id, h.producer_epoch)
        sequence = h.base_sequence if pid != ANONYMOUS_PRODUCER_ID else 0
        frames.append(wrap(batch, pid, sequence, stream.info.id, part.index))
    except KeraError as err:
        return entry.refuse(kafka_code(err), err.message)
    entry.frame = len(frames) - 1
    return entry


class ProduceReply(Deferred):
    """A Produce request's answer, given once the broker's core has the results of its chunks
    (at once, or when they are durable: kera.broker.core.Broker.take_replies)."""
    __slots__ = ("call", "entries", "acks")

    def __init__(self, call: Call, entries: list[Entry], acks: int):
        self.call, self.entries, self.acks = call, entries, acks

    def done(self, results) -> None:
        if isinstance(results, KeraError):   # the whole request failed (produce timeout)
            results = [[results.code, results.message, results.retriable]] * len(self.entries)
        if self.acks == 0:
            self.call.answer(None)
            return
        by_topic: dict[str, list] = {}
        for e in self.entries:
            by_topic.setdefault(e.topic, []).append(_partition(e, results, self.call.version))
        self.call.answer({"responses": [{"name": t, "partition_responses": p}
                                        for t, p in by_topic.items()]})


def _partition(e: Entry, results: list, version: int) -> dict:
    out = {"index": e.partition, "error_code": e.error, "base_offset": -1,
           "log_start_offset": -1, "error_message": e.message}
    if e.frame is None or e.frame >= len(results):
        return out
    r = results[e.frame]
    if not r:                                   # a retry stored earlier, place not looked up
        out["error_code"] = ErrorCode.duplicate_sequence_number
    elif isinstance(r[0], str):                 # [code, message, retriable]
        out["error_code"], out["error_message"] = kafka_code(r[0]), r[1]
        if r[0] == KeylessRecord.code and version < INVALID_RECORD_SINCE_VERSION:
            out["error_code"] = ErrorCode.corrupt_message
    elif len(r) == 4:
        out["base_offset"] = r[3]
    return out
