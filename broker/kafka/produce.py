"""Produce: each partition's record batch is stored as one kera chunk, as the client built it.

The batch is checked (magic, length, CRC, record count) and wrapped, not decoded: compressed
batches stay compressed. A Kafka idempotent producer's (producer id, epoch) becomes the
chunk's kera producer id and its base sequence the chunk's sequence, so the broker's producer
table (kera.broker.producers.classify_kafka) stores a retried batch once; a producer without
idempotence gets no table entry, as in Kafka. acks=1 is answered as acks=all: kera answers
only once the records are durable on every copy the stream asks for.

A transactional batch (attribute bit 4) is stored as such: the broker's core asks kera's
coordinator, before the first one of a transaction in a partition, that the partition was
added to the producer's open transaction (Kafka's TV1 verification; kera.broker.core
`_txn_admit`), and refuses a non-transactional batch from a producer whose transaction is open
in the partition. Topics with several active groups per streamlet take no transactional
batches (kera.broker.kafka.transactions says why).
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera.broker.kafka import slots
from kera.broker.kafka.context import Call, Context, Deferred
from kera.broker.kafka.errors import kafka_code
from kera.broker.kafka.producer_ids import PRODUCER_ID_BITS
from kera.codec import kafka_batch
from kera.codec.chunk import wrap
from kera.codec.txn import is_anonymous_kafka, kera_producer_id
from kera.errors import KeraError, KeylessRecord

# Kafka answers a keyless record on a compacted topic INVALID_RECORD from Produce v8 on (KIP-467
# added the code); older clients know the same refusal as CORRUPT_MESSAGE.
INVALID_RECORD_SINCE_VERSION = 8
# Produce tells a fenced transactional producer INVALID_PRODUCER_EPOCH, as Kafka's does (its
# clients take it as fencing); PRODUCER_FENCED is the transaction APIs' code.
PRODUCE_CODES = {ErrorCode.producer_fenced: ErrorCode.invalid_producer_epoch}

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
    where = None if stream is None else slots.place(stream.info, part.index)
    if where is None:
        return entry.refuse(ErrorCode.unknown_topic_or_partition,
                            f"no partition {part.index} of topic {topic!r} on this broker")
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
        if h.transactional and (h.producer_id < 0 or stream.info.active_groups != 1):
            return entry.refuse(ErrorCode.invalid_record if h.producer_id < 0 else
                                ErrorCode.invalid_request,
                                f"a transactional batch needs a producer id and a topic with one "
                                f"active group per streamlet ({topic!r} has "
                                f"{stream.info.active_groups})")
        pid, sequence = _identity(stream.info, where, h)
        frames.append(wrap(batch, pid, sequence, stream.info.id, where[0]))
    except KeraError as err:
        return entry.refuse(kafka_code(err), err.message)
    entry.frame = len(frames) - 1
    return entry


def _identity(info, where: tuple[int, int], h) -> tuple[int, int]:
    """(kera producer id, sequence) of a Kafka batch for slot where[1] of streamlet where[0]
    (kera.broker.kafka.slots); an anonymous producer's batches have no sequence rule."""
    pid = slots.producer_id(kera_producer_id(h.producer_id, h.producer_epoch), info, where[1])
    return pid, 0 if is_anonymous_kafka(pid) else h.base_sequence


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
        code = kafka_code(r[0])
        out["error_code"], out["error_message"] = PRODUCE_CODES.get(code, code), r[1]
        if r[0] == KeylessRecord.code and version < INVALID_RECORD_SINCE_VERSION:
            out["error_code"] = ErrorCode.corrupt_message
    elif len(r) == 4:
        out["base_offset"] = r[3]
    return out
