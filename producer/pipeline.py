"""Sealed chunks on their way to the brokers: request building, acks, retries. Sans-IO.

Chunks wait in *lanes*, one per (producer identity, stream, streamlet), in sequence order. The
request thread asks `build` for requests (one per broker at a time, one lane per streamlet: its
next chunk, then a run of the chunks after it while there is room, up to `request_size_bytes`,
at most `in_flight_per_broker` requests in flight per broker), sends them, and feeds back each
reply (`on_reply`), send failure or timeout (`on_request_failed`). A request left unanswered
while its streamlet's owner moved (a failover) is failed early (`probe_stalled`). The clock is
passed in; nothing here touches a socket or a thread.

Ordering: the broker stores chunk k+1 of a lane only after chunk k (`sequence_gap`
otherwise), so a lane may pipeline several chunks. After any failure the lane *pauses* until
its in-flight chunks are all answered, then resends from its first unacknowledged chunk, in
order, with the same bytes (same producer id and sequence: a chunk stored by an attempt whose
reply was lost is acknowledged as a duplicate, never stored twice).

A chunk that fails for good (non-retriable error, or `retries_max` attempts) is reported as a
Failure. The lane's later chunks would then hit `sequence_gap` forever, so a lane of this
producer's own chunks takes a fresh identity: producer id + Q (the stream's active groups,
so the broker keeps the same group slot and thus the order) and sequences from 0, and its
waiting chunks are re-sealed under it.

A transactional producer's lanes (`sequence_bit` TXN_SEQUENCE_BIT, kera.producer.transaction)
never change identity: it is bound to the transaction. A chunk of theirs that fails for good
fails the lanes' later chunks too and is kept as `txn_error` (the transaction can only be
aborted); a front gap it cannot heal, or a request left unanswered (its chunk may still land),
also sets `txn_new_epoch`: the abort then bumps the epoch, which fences such a chunk.
`halted` stops sending while an abort drops what is unsent and waits for what is in flight.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kera.codec import chunk as chunkcodec
from kera.config import STALL_PROBE_INTERVAL_S, STALL_PROBE_S
from kera.codec import schema
from kera.codec.frame_pack import pack
from kera.net.backoff import Backoff
from kera.errors import KeraError, SequenceGap, Timeout, UnknownStream

UNSENT, IN_FLIGHT, ACKED = 0, 1, 2
U64 = 1 << 64
# A lane's first unacknowledged chunk refused with sequence_gap this often: take a new identity.
FRONT_GAP_ATTEMPTS_MAX = 8
BACKOFF_MS_MAX = 1000
# A retriable refusal's wait before the chunk is sent again (kera.net.backoff), by the chunk's
# attempts so far + 1: 5 ms for a chunk not counted as sent, doubling per send.
RETRY_BACKOFF = Backoff(first_ms=5, max_ms=BACKOFF_MS_MAX)


def next_identity(producer_id: int, slot_stride: int) -> int:
    """A fresh producer id in the same group slot (same residue mod the active groups)."""
    if producer_id + slot_stride < U64:
        return producer_id + slot_stride
    return producer_id % slot_stride


class PendingChunk:
    __slots__ = ("data", "lane", "sequence", "records", "serial", "state", "attempts", "futures")

    def __init__(self, data: bytes, lane: "Lane", sequence: int, records: int, serial: int,
                 futures: list | None = None):
        self.futures = futures  # (index or -1, count, DeliveryFuture) to settle, or None
        self.data = data
        self.lane = lane
        self.sequence = sequence
        self.records = records
        self.serial = serial
        self.state = UNSENT
        self.attempts = 0

    @property
    def size(self) -> int:
        return len(self.data)


class Lane:
    """Chunks of one (producer id, stream, streamlet) that are not yet acknowledged."""

    __slots__ = ("stream", "stream_id", "streamlet", "producer_id", "own", "slot_stride",
                 "next_sequence", "chunks", "cursor", "in_flight", "paused", "retry_at",
                 "reidentify", "sequence_bit", "acked_sequence")

    def __init__(self, stream: str, stream_id: int, streamlet: int, producer_id: int, own: bool,
                 slot_stride: int = 1, sequence_bit: int = 0):
        self.stream = stream
        self.stream_id = stream_id
        self.streamlet = streamlet
        self.producer_id = producer_id
        self.own = own                  # our sequence space: may be re-sealed under a new id
        self.slot_stride = slot_stride  # active groups Q: id + Q keeps the broker's group slot
        self.next_sequence = 0
        self.chunks: collections.deque[PendingChunk] = collections.deque()
        self.cursor = 0                 # chunks before it are in flight or acked
        self.in_flight = 0
        self.paused = False             # after a failure: send nothing until in_flight == 0
        self.retry_at = 0.0
        self.reidentify = False
        # Set in a chunk's sequence field (TXN_SEQUENCE_BIT for a transactional producer's).
        self.sequence_bit = sequence_bit
        self.acked_sequence = -1        # the highest sequence acknowledged

    @property
    def wire_sequence(self) -> int:
        """The sequence field of the next chunk sealed in this lane."""
        return self.next_sequence | self.sequence_bit

    def next_unsent(self, now: float) -> PendingChunk | None:
        if self.paused or now < self.retry_at:
            return None
        chunks = self.chunks
        while self.cursor < len(chunks):
            c = chunks[self.cursor]
            if c.state == UNSENT:
                return c
            self.cursor += 1
        return None

    def pop_acked(self) -> None:
        chunks = self.chunks
        while chunks and chunks[0].state == ACKED:
            chunks.popleft()
            self.cursor = max(0, self.cursor - 1)


def _take(lane: Lane, c: PendingChunk, chunks: list) -> None:
    """Put lane's next unsent chunk `c` in the request being filled."""
    c.state = IN_FLIGHT
    c.attempts += 1
    lane.cursor += 1
    lane.in_flight += 1
    chunks.append(c)


class Failure(NamedTuple):
    stream: str
    streamlet: int
    error: KeraError
    records: int


@dataclass
class Outgoing:
    """One produce request: chunks for streamlets of one broker."""
    broker: str
    chunks: list
    req_id: int | None = None
    deadline: float = 0.0
    probe_at: float = 0.0     # when to look again whether its owner moved (probe_stalled)

    @property
    def frames(self) -> list:
        """The request's payload: its chunks, short ones packed several to a frame."""
        return pack([c.data for c in self.chunks])


@dataclass
class Pipeline:
    request_size_bytes: int
    in_flight_per_broker: int
    retries_max: int
    request_timeout_s: float
    lanes: dict = field(default_factory=dict)
    # Every chunk not yet acknowledged or failed, by serial, in serial order (flush waits on it).
    incomplete: dict = field(default_factory=dict)
    in_flight: dict = field(default_factory=dict)      # broker -> {req_id: Outgoing}
    failures: list = field(default_factory=list)
    pending_bytes: int = 0
    last_serial: int = -1
    dead_streams: set = field(default_factory=set)     # stream ids refused as unknown for good
    want_refresh: set = field(default_factory=set)     # (name, id) of streams with no owner known
    stats: collections.Counter = field(default_factory=collections.Counter)
    # Outcomes of chunks with futures, (futures, stream, streamlet, result, error): the request
    # thread settles them outside the producer's lock (delivery.settle).
    settled: list = field(default_factory=list)
    # Transactional producers (module doc): the bit their lanes' sequences carry; the first
    # definitive failure of the transaction; whether its abort must bump the epoch; chunks
    # acknowledged in it (the broker then holds it open); sending stopped by an abort.
    sequence_bit: int = 0
    txn_error: KeraError | None = None
    txn_new_epoch: bool = False
    txn_acked: int = 0
    halted: bool = False

    FAILURES_KEPT_MAX = 1000

    def __post_init__(self):
        self._serials = itertools.count()
        self._rotation = 0

    # ------------------------------------------------------------------ lanes and chunks
    def own_lane(self, stream: str, stream_id: int, streamlet: int, producer_id: int,
                 slot_stride: int) -> Lane:
        key = (stream_id, streamlet)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(stream, stream_id, streamlet, producer_id, True,
                                          slot_stride, self.sequence_bit)
        return lane

    def add(self, lane: Lane, data: bytes, sequence: int, records: int,
            futures: list | None = None) -> PendingChunk:
        """Queue a sealed chunk at the tail of its lane."""
        if lane.own:
            assert sequence == lane.next_sequence, (sequence, lane.next_sequence)
            lane.next_sequence += 1
        serial = next(self._serials)
        c = PendingChunk(data, lane, sequence, records, serial, futures)
        lane.chunks.append(c)
        self.incomplete[serial] = c
        self.last_serial = serial
        self.pending_bytes += len(data)
        return c

    def add_foreign(self, stream: str, data: bytes) -> PendingChunk:
        """Queue a chunk that carries its own producer id and sequence (never re-sealed)."""
        h = chunkcodec.read_header(data)
        key = (h.producer_id, h.stream_id, h.streamlet)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(stream, h.stream_id, h.streamlet, h.producer_id, False)
        return self.add(lane, data, h.sequence, h.record_count)

    def oldest_incomplete(self) -> int | None:
        return next(iter(self.incomplete), None)

    def done_through(self, serial: int) -> bool:
        """Is every chunk with a serial <= `serial` acknowledged or failed?"""
        oldest = self.oldest_incomplete()
        return oldest is None or oldest > serial

    # ------------------------------------------------------------------ requests
    def build(self, now: float, address_of: Callable[[int, int], str | None]) -> list[Outgoing]:
        """Requests to send now, filling each broker's window."""
        if self.halted:
            return []
        by_broker: dict[str, list[Lane]] = {}
        lanes = list(self.lanes.values())
        if len(lanes) > 1:  # rotate the starting lane so no streamlet starves the others
            self._rotation = (self._rotation + 1) % len(lanes)
            lanes = lanes[self._rotation:] + lanes[:self._rotation]
        for lane in lanes:
            if lane.next_unsent(now) is None:
                continue
            address = address_of(lane.stream_id, lane.streamlet)
            if address is None:  # no live owner known: wait for a metadata refresh
                lane.retry_at = now + BACKOFF_MS_MAX / 1000
                self.want_refresh.add((lane.stream, lane.stream_id))
                continue
            by_broker.setdefault(address, []).append(lane)
        out = []
        for broker, blanes in by_broker.items():
            busy = len(self.in_flight.setdefault(broker, {}))
            while busy < self.in_flight_per_broker:
                chunks = self._fill(blanes, now)
                if not chunks:
                    break
                out.append(Outgoing(broker, chunks))
                busy += 1
        return out

    def _fill(self, lanes: list[Lane], now: float) -> list[PendingChunk]:
        """One request's chunks: the next chunk of each lane first (one lane per streamlet, so
        every streamlet with chunks waiting gets its share), then, while the request has room,
        the chunks after those, lane by lane: a run of one lane's consecutive chunks, which
        the broker appends in order as it would across requests. Runs cut the per-request
        work (a request's receive, reply and R=1 file write) that one chunk per streamlet
        paid for every few chunks: `send_batch` at R=1 (4 streamlets, bench/test_core.py) went
        from 3.09 M to 5.12 M records/s (medians of 4 alternations), and a lane's run is
        adjacent in its segment, so it also replicates as one frame."""
        chunks: list[PendingChunk] = []
        taken: list[Lane] = []
        streamlets = set()
        size = 0
        for lane in lanes:
            key = (lane.stream_id, lane.streamlet)
            if key in streamlets:
                continue
            c = lane.next_unsent(now)
            if c is None:
                continue
            if chunks and size + c.size > self.request_size_bytes:
                continue
            _take(lane, c, chunks)
            taken.append(lane)
            streamlets.add(key)
            size += c.size
        for lane in taken:
            c = lane.next_unsent(now)
            while c is not None and size + c.size <= self.request_size_bytes:
                _take(lane, c, chunks)
                size += c.size
                c = lane.next_unsent(now)
        return chunks

    def sent(self, out: Outgoing, req_id: int, now: float) -> None:
        out.req_id = req_id
        out.deadline = now + self.request_timeout_s
        out.probe_at = now + STALL_PROBE_S
        self.in_flight.setdefault(out.broker, {})[req_id] = out
        self.stats["requests"] += 1

    def on_request_failed(self, out: Outgoing, error: KeraError, now: float) -> set[tuple[str, int]]:
        """The request could not be sent, timed out or got an error reply as a whole."""
        if out.req_id is not None:
            self.in_flight.get(out.broker, {}).pop(out.req_id, None)
        refresh = set()
        for c in out.chunks:
            refresh |= self._chunk_failed(c, error, now)
        return refresh

    def on_reply(self, broker: str, header: dict, now: float) -> set[tuple[str, int]]:
        """Apply one produce reply; returns the (name, id) of streams whose metadata needs a
        refresh."""
        out = self.in_flight.get(broker, {}).get(header.get("id"))
        if out is None:
            return set()  # a late reply to a request that timed out: its chunks were resent
        if header.get("ok") is not True:
            return self.on_request_failed(out, schema.error_reply(header), now)
        results = header.get("results")
        if not isinstance(results, list) or len(results) != len(out.chunks):
            err = KeraError(f"produce reply from {broker} has a malformed results list", retriable=True)
            return self.on_request_failed(out, err, now)
        del self.in_flight[broker][out.req_id]
        refresh = set()
        for c, result in zip(out.chunks, results):
            result = schema.produce_result(result)
            if isinstance(result, KeraError):
                refresh |= self._chunk_failed(c, result, now)
            else:
                self._chunk_acked(c, result)
        return refresh

    def expire(self, now: float) -> set[tuple[str, int]]:
        """Fail the requests whose reply is overdue (their chunks will be resent)."""
        refresh = set()
        for broker, window in self.in_flight.items():
            for out in [o for o in window.values() if o.deadline <= now]:
                refresh |= self.on_request_failed(
                    out, Timeout(f"no reply from broker {broker} within {self.request_timeout_s:.1f} s"), now)
        return refresh

    def probe_stalled(self, now: float,
                      address_of: Callable[[int, int], str | None]) -> set[tuple[str, int]]:
        """Once a request to a broker is unanswered for STALL_PROBE_S: every request to it
        whose streamlets have another owner in the metadata fails now (their chunks are resent
        there; younger ones too, so their lanes resume together); the streams of the others
        are returned, (name, id), to ask the coordinator again."""
        refresh = set()
        for broker, window in self.in_flight.items():
            stalled = [o for o in window.values() if o.probe_at <= now]
            if not stalled:
                continue
            for out in list(window.values()):
                if {address_of(c.lane.stream_id, c.lane.streamlet) for c in out.chunks} - {broker, None}:
                    self.stats["requests_rerouted"] += 1
                    refresh |= self.on_request_failed(out, Timeout(
                        f"broker {broker} no longer owns the streamlets of a request it has not "
                        f"answered: resent to their new owner"), now)
            for out in stalled:
                if out.req_id in window:
                    out.probe_at = now + STALL_PROBE_INTERVAL_S
                    refresh |= {(c.lane.stream, c.lane.stream_id) for c in out.chunks}
        return refresh

    def next_deadline(self, now: float) -> float | None:
        """The earliest request deadline, stall probe or lane retry time worth waking up for."""
        times = [min(o.deadline, o.probe_at) for w in self.in_flight.values() for o in w.values()]
        times += [lane.retry_at for lane in self.lanes.values()
                  if lane.retry_at > now and not lane.paused and lane.cursor < len(lane.chunks)]
        return min(times, default=None)

    # ------------------------------------------------------------------ outcomes
    def _chunk_acked(self, c: PendingChunk, result: tuple) -> None:
        lane = c.lane
        c.state = ACKED
        lane.in_flight -= 1
        lane.acked_sequence = max(lane.acked_sequence, c.sequence)
        if lane.sequence_bit:
            self.txn_acked += 1
        self.stats["chunks_acked"] += 1
        self.stats["records_acked"] += c.records
        self._complete(c, result)
        lane.pop_acked()
        self._maybe_resume(lane)
        self._forget_if_done(lane)

    def _forget_if_done(self, lane: Lane) -> None:
        """A caller-identified lane is dropped once empty (one per Spark task attempt, say)."""
        if not lane.own and not lane.chunks and not lane.in_flight:
            self.lanes.pop((lane.producer_id, lane.stream_id, lane.streamlet), None)

    def _complete(self, c: PendingChunk, result: tuple | None = None,
                  error: KeraError | None = None) -> None:
        del self.incomplete[c.serial]
        self.pending_bytes -= len(c.data)
        if c.futures:
            self.settled.append((c.futures, c.lane.stream, c.lane.streamlet, result, error))

    def _chunk_failed(self, c: PendingChunk, error: KeraError, now: float) -> set[tuple[str, int]]:
        lane = c.lane
        lane.in_flight -= 1
        c.state = UNSENT
        lane.paused = True
        refresh = {(lane.stream, lane.stream_id)} if error.refresh_metadata else set()
        if lane.sequence_bit and isinstance(error, Timeout):
            self.txn_new_epoch = True   # no answer: this copy may still be stored later
        if isinstance(error, SequenceGap):
            if self._behind_unacked(c):
                c.attempts -= 1  # collateral of an earlier chunk's failure, not this chunk's
            elif lane.own and c.attempts >= FRONT_GAP_ATTEMPTS_MAX:
                # Every earlier chunk was acknowledged, yet the broker misses one: it lost this
                # producer's state (a restart without replicas). This chunk was never stored
                # (refused), so resending it under a fresh identity cannot duplicate it.
                c.attempts = 0
                if lane.sequence_bit:   # the identity is the transaction's: abort, new epoch
                    self.txn_new_epoch = True
                    error = KeraError(
                        f"the broker lost this producer's sequence in stream '{lane.stream}' "
                        f"streamlet {lane.streamlet}: the transaction cannot commit; abort it "
                        f"(the abort starts a new epoch) and redo it", retriable=False)
                else:
                    lane.reidentify = True
        if error.retriable and c.attempts <= self.retries_max:
            self.stats["retries"] += 1
            lane.retry_at = max(lane.retry_at, now + RETRY_BACKOFF.delay_s(c.attempts + 1))
        elif isinstance(error, UnknownStream) and not error.retriable:
            self._fail_stream(lane.stream_id, error)
        else:
            self._fail_chunk(c, error)
        self._maybe_resume(lane)
        return refresh

    def _behind_unacked(self, c: PendingChunk) -> bool:
        for other in c.lane.chunks:
            if other is c:
                return False
            if other.state != ACKED:
                return True
        return False

    def _fail_chunk(self, c: PendingChunk, error: KeraError) -> None:
        lane = c.lane
        lane.chunks.remove(c)
        self._complete(c, error=error)
        self._record_failure(lane, error, c.records)
        if lane.sequence_bit and self.txn_error is None:
            self.txn_error = error
        if lane.own and not lane.sequence_bit:
            lane.reidentify = True
        else:
            # The caller owns this sequence space: its later chunks can never be stored.
            for other in [o for o in lane.chunks if o.state == UNSENT]:
                lane.chunks.remove(other)
                follows = KeraError(f"chunk {other.sequence} follows failed chunk {c.sequence}")
                self._complete(other, error=follows)
                self._record_failure(lane, follows, other.records)
        lane.pop_acked()

    def _fail_stream(self, stream_id: int, error: KeraError) -> None:
        """The stream is gone: every waiting chunk of it fails now."""
        self.dead_streams.add(stream_id)
        for lane in [lane for lane in self.lanes.values() if lane.stream_id == stream_id]:
            for c in [c for c in lane.chunks if c.state == UNSENT]:
                lane.chunks.remove(c)
                self._complete(c, error=error)
                self._record_failure(lane, error, c.records)
            lane.pop_acked()

    def fail_stream(self, stream_id: int, error: KeraError) -> None:
        """Called when the coordinator confirms the stream no longer exists."""
        self._fail_stream(stream_id, error)
        for lane in self.lanes.values():
            if lane.stream_id == stream_id:
                self._maybe_resume(lane)

    def _record_failure(self, lane: Lane, error: KeraError, records: int) -> None:
        self.stats["records_failed"] += records
        self.stats["chunks_failed"] += 1
        if len(self.failures) < self.FAILURES_KEPT_MAX:
            self.failures.append(Failure(lane.stream, lane.streamlet, error, records))

    def _maybe_resume(self, lane: Lane) -> None:
        if not lane.paused or lane.in_flight:
            return
        lane.paused = False
        lane.cursor = 0
        lane.pop_acked()
        if lane.reidentify:
            self._reidentify(lane)
        self._forget_if_done(lane)

    def _reidentify(self, lane: Lane) -> None:
        lane.reidentify = False
        # A chunk acknowledged behind unacknowledged ones proves those were stored (the broker
        # stores a lane's chunks only in order): they count as acknowledged, not resent.
        last_acked = max((i for i, c in enumerate(lane.chunks) if c.state == ACKED), default=-1)
        for c in list(lane.chunks)[:last_acked + 1]:
            if c.state != ACKED:
                c.state = ACKED
                self.stats["chunks_acked"] += 1
                self.stats["records_acked"] += c.records
                self._complete(c)
        lane.pop_acked()
        lane.producer_id = next_identity(lane.producer_id, lane.slot_stride)
        for i, c in enumerate(lane.chunks):
            assert c.state == UNSENT, "a lane re-identifies only when nothing is in flight"
            c.data = chunkcodec.reseal(c.data, lane.producer_id, i)
            c.sequence = i
        lane.next_sequence = len(lane.chunks)
        self.stats["reidentified"] += 1

    # ------------------------------------------------------------------ transactions
    def drop_unsent(self, error: KeraError) -> int:
        """Discard every chunk not in flight (an abort); their futures fail with `error`, and
        no Failure is kept (the abort is the caller's decision). Returns the records dropped."""
        dropped = 0
        for lane in self.lanes.values():
            for c in [c for c in lane.chunks if c.state == UNSENT]:
                lane.chunks.remove(c)
                self._complete(c, error=error)
                dropped += c.records
            lane.cursor = 0
            lane.pop_acked()
        return dropped

    def chunks_in_flight(self) -> int:
        return sum(lane.in_flight for lane in self.lanes.values())

    def end_transaction(self) -> None:
        """After a commit or an abort with nothing left in flight: the next transaction starts
        clean, each lane's sequences continuing after its last stored chunk."""
        assert self.chunks_in_flight() == 0
        for lane in self.lanes.values():
            if lane.own and not lane.chunks:
                lane.next_sequence = lane.acked_sequence + 1
                lane.paused, lane.retry_at, lane.cursor = False, 0.0, 0
        self.txn_error, self.txn_acked, self.failures = None, 0, []

    def new_identity(self, producer_id: int) -> None:
        """A new epoch (init_transactions): every own lane, empty, restarts at sequence 0."""
        for lane in self.lanes.values():
            assert not lane.chunks and not lane.in_flight, "identity changes only between transactions"
            if lane.own:
                lane.producer_id = producer_id
                lane.next_sequence, lane.acked_sequence = 0, -1
        self.txn_new_epoch = False
        self.end_transaction()

    def take_failures(self) -> list[Failure]:
        failures, self.failures = self.failures, []
        return failures
