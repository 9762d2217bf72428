"""Fetch: a partition's durable chunks from the offset asked, as Kafka record batches.

A chunk that came from a Kafka client is served as it was produced, its base offset set to
its record number (outside the batch's CRC: one copy of the bytes, no decoding); a chunk from
a kera client is encoded as an uncompressed batch once per fetch (per-record work only for a
reader of the other protocol). A fetch at an offset inside a batch returns that whole batch:
the client skips the records before its offset, as with Kafka. A fetch that finds nothing is
held by the broker's held fetches (kera.broker.fetch_waits) until one of its partitions has
new durable records or its max_wait_ms passes.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera import config
from kera.broker.kafka.context import Call, Context, Deferred
from kera.broker.kafka.errors import kafka_code
from kera.codec import kafka_batch
from kera.codec.chunk import FLAG_KAFKA, FLAG_SPARSE, Chunk, frame_chunks, kafka_rows, read_header
from kera.errors import KeraError

# A held Fetch waits at most this long, whatever its max_wait_ms (the broker's bound on held
# fetches, kera.config.FETCH_WAIT_MAX_MS, so that a parked request never outlives it).
FETCH_WAIT_MAX_MS = config.FETCH_WAIT_MAX_MS


class Part:
    """One partition of a Fetch: where it reads, and what it found."""
    __slots__ = ("topic", "index", "offset", "max_bytes", "stream", "error", "start", "end",
                 "read")

    def __init__(self, topic: str, p):
        self.topic, self.index = topic, p.partition
        self.offset, self.max_bytes = p.fetch_offset, max(p.partition_max_bytes, 1)
        self.stream, self.error, self.start, self.end, self.read = None, ErrorCode.none, -1, -1, None


def handle_fetch(ctx: Context, call: Call) -> None:
    FetchRequest(ctx, call).run(again=False)


class FetchRequest(Deferred):
    __slots__ = ("ctx", "call", "parts")

    def __init__(self, ctx: Context, call: Call):
        self.ctx, self.call = ctx, call
        self.parts = [Part(t.topic, p) for t in call.body.topics for p in t.partitions]

    def run(self, again: bool) -> None:
        reads = [self._locate(p) for p in self.parts]
        reads = [r for r in reads if r is not None]
        results, frames = self.ctx.core.fetch(reads, again=again) if reads else ([], [])
        batches = self._batches(results, frames)
        if not again and not any(batches.values()) and self._hold(reads):
            return
        self.call.answer(self._response(batches))

    def done(self, _result) -> None:
        """Held, and released (new durable records, or the wait is over): read again."""
        self.run(again=True)

    def _hold(self, reads: list) -> bool:
        wait_ms = min(int(self.call.body.max_wait.total_seconds() * 1000), FETCH_WAIT_MAX_MS)
        if wait_ms <= 0 or not reads or any(p.error for p in self.parts):
            return False
        deadline = self.ctx.clock.monotonic() + wait_ms / 1000
        if not self.ctx.core.park_fetch(self, reads, deadline):
            return False
        self.ctx.wake_at(deadline)
        return True

    def _locate(self, p: Part) -> list | None:
        """The broker read of partition `p` at its offset; None (its error set) when none."""
        core = self.ctx.core
        stream = self.ctx.stream_by_name(p.topic)
        if stream is None or not 0 <= p.index < stream.info.streamlets:
            p.error = ErrorCode.unknown_topic_or_partition
            return None
        p.stream = stream
        try:
            p.start, p.end = core.number_span(stream.info.id, p.index)
            if not p.start <= p.offset <= p.end:
                p.error = ErrorCode.offset_out_of_range
                return None
            low, offsets = core.cursor_at_number(stream.info.id, p.index, p.offset)
        except KeraError as err:
            p.error = kafka_code(err)
            return None
        p.read = [stream.info.id, p.index, {"low": low, "offsets": offsets}, p.max_bytes]
        return p.read

    def _batches(self, results: list, frames: list) -> dict:
        out: dict[int, list] = {}
        at = 0
        located = [p for p in self.parts if p.read is not None]
        for p, (error, count, _groups) in zip(located, results):
            if error is not None:
                p.error = kafka_code(error[0])
            out[id(p)] = [as_batch(c) for f in frames[at:at + count] for c in frame_chunks(f)]
            at += count
        return out

    def _response(self, batches: dict) -> dict:
        by_topic: dict[str, list] = {}
        committed = getattr(self.call.body, "isolation_level", 0) == 1
        for p in self.parts:
            by_topic.setdefault(p.topic, []).append({
                "partition_index": p.index, "error_code": p.error, "high_watermark": p.end,
                "last_stable_offset": p.end, "log_start_offset": p.start,
                "aborted_transactions": [] if committed else None, "preferred_read_replica": -1,
                "records": b"".join(batches.get(id(p), ()))})
        return {"responses": [{"topic": t, "partitions": ps} for t, ps in by_topic.items()],
                "session_id": 0, "error_code": ErrorCode.none}


def as_batch(view) -> bytes:
    """A stored chunk as one Kafka record batch whose base offset is its record number. A
    compacted chunk's records keep their offset deltas and its last offset delta is its span's
    (docs/COMPACTION.md), even with no record left: Kafka's consumers go on at the batch's
    last offset + 1, so a reader in a compacted range never fetches it again."""
    h = read_header(view)
    if h.flags & FLAG_KAFKA:
        return kafka_batch.with_offset(view[h.header_size:h.size], h.number)
    c = Chunk(view, check=False)
    if h.flags & FLAG_SPARSE:
        return kafka_batch.build(kafka_rows(c), base_offset=h.number,
                                 offset_deltas=c.record_offsets().tolist(),
                                 last_offset_delta=c.span - 1)
    return kafka_batch.build(kafka_rows(c), base_offset=h.number)
