"""Fetch: a partition's durable chunks from the offset asked, as Kafka record batches.

A chunk that came from a Kafka client is served as it was produced, its base offset set to
its record number (outside the batch's CRC: one copy of the bytes, no decoding); a chunk from
a kera client is encoded as an uncompressed batch once per fetch (per-record work only for a
reader of the other protocol). A fetch at an offset inside a batch returns that whole batch:
the client skips the records before its offset, as with Kafka. A fetch that finds fewer than
its min_bytes (fetch.min.bytes) is held by the broker's held fetches (kera.broker.fetch_waits)
and read again each time one of its partitions has new durable records, until it finds
min_bytes or its max_wait_ms (at most FETCH_WAIT_MAX_MS) passes. A partition is a streamlet's
slot (kera.broker.kafka.slots).

Transactions (docs/TRANSACTIONS.md, "Serving reads"): every partition's `last_stable_offset` is
its LSO, the first offset of its oldest open transaction (the high watermark when none is
open), from the broker's transaction index (kera.broker.transactions). A read_committed fetch
(isolation_level 1) is served whole chunks below the LSO only, with `aborted_transactions`,
the aborted transactions whose records lie in the span served, as (producer id, first
offset): the client drops their records, and control batches, itself. read_uncommitted is
served to the high watermark, `aborted_transactions` null. A kera producer's transactional
chunk is encoded as a transactional batch of its producer id and epoch, so that list applies.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera import config
from kera.broker.kafka import slots
from kera.broker.kafka.context import Call, Context, Deferred
from kera.broker.kafka.errors import kafka_code
from kera.codec import kafka_batch, txn
from kera.codec.chunk import (FLAG_KAFKA, FLAG_SPARSE, RESERVED_PRODUCER_IDS, Chunk, frame_chunks,
                              kafka_rows, read_header)
from kera.errors import KeraError

# A held Fetch waits at most this long, whatever its max_wait_ms: the broker's bound on held
# fetches (kera.config.FETCH_WAIT_MAX_MS), and Kafka's default fetch.max.wait.ms. Replies leave
# a connection in request order, so a held Fetch also delays every request pipelined behind it
# on its connection (a librdkafka consumer's offset commits, for one): the cap bounds that.
FETCH_WAIT_MAX_MS = config.FETCH_WAIT_MAX_MS
READ_COMMITTED = 1      # Fetch's isolation_level


class Part:
    """One partition of a Fetch: where it reads, and what it found."""
    __slots__ = ("topic", "index", "offset", "max_bytes", "stream", "error", "start", "end",
                 "read", "lso", "txns", "served_end")

    def __init__(self, topic: str, p):
        self.topic, self.index = topic, p.partition
        self.offset, self.max_bytes = p.fetch_offset, max(p.partition_max_bytes, 1)
        self.stream, self.error, self.start, self.end, self.read = None, ErrorCode.none, -1, -1, None
        self.lso = -1
        self.txns = None            # (the streamlet's transaction index, slot), if it has one
        self.served_end = -1        # the offset after the last record served


def handle_fetch(ctx: Context, call: Call) -> None:
    FetchRequest(ctx, call).run(again=False)


class FetchRequest(Deferred):
    __slots__ = ("ctx", "call", "parts", "deadline")

    def __init__(self, ctx: Context, call: Call):
        self.ctx, self.call = ctx, call
        self.parts = [Part(t.topic, p) for t in call.body.topics for p in t.partitions]
        self.deadline: float | None = None    # set when first held

    def run(self, again: bool) -> None:
        reads = [self._locate(p) for p in self.parts]
        reads = [r for r in reads if r is not None]
        results, frames = self.ctx.core.reads.fetch(reads, again=again) if reads else ([], [])
        batches = self._batches(results, frames)
        if self._hold(reads, sum(len(b) for parts in batches.values() for b in parts)):
            return
        self.call.answer(self._response(batches))

    def done(self, _result) -> None:
        """Held, and released (new durable records, or the wait is over): read again."""
        self.run(again=True)

    def _hold(self, reads: list, found_bytes: int) -> bool:
        """Hold the fetch (again) while it found fewer than min_bytes and its wait is not over;
        a partition's error is answered at once, as Kafka does."""
        if found_bytes >= max(self.call.body.min_bytes, 1) or not reads or \
                any(p.error for p in self.parts):
            return False
        now = self.ctx.clock.monotonic()
        first = self.deadline is None
        if first:
            wait_ms = min(int(self.call.body.max_wait.total_seconds() * 1000), FETCH_WAIT_MAX_MS)
            self.deadline = now + max(wait_ms, 0) / 1000
        if now >= self.deadline or not self.ctx.core.reads.park_fetch(self, reads, self.deadline):
            return False
        if first:   # one loop wake-up at the deadline, however often new records re-hold it
            self.ctx.wake_at(self.deadline)
        return True

    def _locate(self, p: Part) -> list | None:
        """The broker read of partition `p` at its offset; None (its error set) when none."""
        core = self.ctx.core
        stream = self.ctx.stream_by_name(p.topic)
        where = None if stream is None else slots.place(stream.info, p.index)
        if where is None:
            p.error = ErrorCode.unknown_topic_or_partition
            return None
        p.stream = stream
        sl, slot = where
        try:
            p.start, p.end = slots.span(core, stream.info, sl, slot)
            if not p.start <= p.offset <= p.end:
                p.error = ErrorCode.offset_out_of_range
                return None
            at, factor = slots.cursor(core, stream.info, sl, slot, p.offset)
        except KeraError as err:
            p.error = kafka_code(err)
            return None
        p.lso, p.txns = last_stable(core, stream.info.id, sl, slot, p.end)
        p.read = [stream.info.id, sl, at, p.max_bytes * factor]
        return p.read

    @property
    def committed(self) -> bool:
        return getattr(self.call.body, "isolation_level", 0) == READ_COMMITTED

    def _batches(self, results: list, frames: list) -> dict:
        out: dict[int, list] = {}
        at = 0
        located = [p for p in self.parts if p.read is not None]
        for p, (error, count, _groups) in zip(located, results):
            if error is not None:
                p.error = kafka_code(error[0])
            limit = p.lso if self.committed else p.end
            out[id(p)] = parts = []
            for f in frames[at:at + count]:
                for c in frame_chunks(f):
                    h = read_header(c)
                    if h.number >= limit:
                        break   # whole chunks below the LSO: chunks do not straddle it
                    parts.extend(batch_parts(c, h))
                    p.served_end = h.number + h.record_count
            at += count
        return out

    def _response(self, batches: dict) -> dict:
        by_topic: dict[str, list] = {}
        for p in self.parts:
            by_topic.setdefault(p.topic, []).append({
                "partition_index": p.index, "error_code": p.error, "high_watermark": p.end,
                "last_stable_offset": p.lso if p.lso >= 0 else p.end,
                "log_start_offset": p.start,
                "aborted_transactions": aborted(p) if self.committed else None,
                "preferred_read_replica": -1,
                # The one copy of the records: from the segments (and a Kafka batch's new
                # offset), into the reply, which goes out by reference (messages.encode_parts).
                "records": b"".join(batches.get(id(p), ()))})
        return {"responses": [{"topic": t, "partitions": ps} for t, ps in by_topic.items()],
                "session_id": 0, "error_code": ErrorCode.none}


def last_stable(core, sid: int, sl: int, slot: int, end: int) -> tuple[int, tuple | None]:
    """(LSO, (transaction index, slot) or None) of a partition whose high watermark is `end`."""
    idx = core.txn.indexes.get((sid, sl))
    if idx is None:
        return end, None
    lso = idx.lso(slot)
    return (end if lso is None else min(lso, end)), (idx, slot)


def aborted(p: Part) -> list[dict]:
    """Kafka's `aborted_transactions` of the span `p` was served."""
    if p.txns is None or p.served_end <= p.offset:
        return []
    idx, slot = p.txns
    return [{"producer_id": a.producer_id, "first_offset": a.first}
            for a in idx.aborted_between(slot, p.offset, p.served_end)]


def as_batch(view, h=None) -> bytes:
    """`batch_parts` joined: the stored chunk as one Kafka record batch."""
    return b"".join(batch_parts(view, h))


def batch_parts(view, h=None) -> tuple:
    """A stored chunk (header `h`, read when not given) as the buffers of one Kafka record
    batch whose base offset is its record number: a Kafka client's chunk as views of it around
    its new base offset (the caller's join is its one copy), any other built anew. A
    compacted chunk's records keep their offset deltas and its last offset delta is its span's (docs/COMPACTION.md), even with no record left: Kafka's
    consumers go on at the batch's last offset + 1, so a reader in a compacted range never
    fetches it again. A kera transactional chunk is a transactional batch of its producer."""
    h = read_header(view) if h is None else h
    if h.flags & FLAG_KAFKA:
        return kafka_batch.offset_parts(view[h.header_size:h.size], h.number)
    c = Chunk(view, check=False)
    if h.flags & FLAG_SPARSE:
        return (kafka_batch.build(kafka_rows(c), base_offset=h.number,
                                  offset_deltas=c.record_offsets().tolist(),
                                  last_offset_delta=c.span - 1),)
    if h.producer_id not in RESERVED_PRODUCER_IDS and txn.is_transactional(h.sequence):
        pid, epoch = txn.split_producer_id(h.producer_id)
        return (kafka_batch.build(kafka_rows(c), base_offset=h.number, producer_id=pid,
                                  producer_epoch=epoch, attributes=kafka_batch.TRANSACTIONAL),)
    return (kafka_batch.build(kafka_rows(c), base_offset=h.number),)
