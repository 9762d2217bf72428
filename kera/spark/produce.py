"""Executor side of a write: send chunks with fixed identities until every one is acknowledged.

A chunk's identity (producer id, sequence) is fixed when it is built, so every resend carries
the same bytes and the broker stores it at most once (PROTOCOL.md "Produce rules"). Per
streamlet, chunks go out in sequence order; several requests may be in flight per broker.
When a chunk is refused with a retriable error (or its request times out) it is sent again
after a pause: later chunks of its streamlet that the broker refused as `sequence_gap` follow
it, in order. Retries per chunk are bounded.

`ProduceQueue` is the sans-IO core (what to send next, what a reply means); `Sender` is the
thin loop around it with sockets.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import zmq

from kera import schema, wire
from kera.errors import KeraError, NotOwner, SequenceGap, Timeout, UnknownStream
from kera.spark.metadata import Metadata, StreamInfo

log = logging.getLogger(__name__)

ATTEMPTS_MAX = 30            # sends of one chunk before the write task fails
RETRY_PAUSE_S = 0.005        # pause before a resend; doubles per attempt up to
RETRY_PAUSE_MAX_S = 1.0

Key = tuple[int, int, int]   # (producer id, stream id, streamlet)


@dataclass
class _Streamlet:
    address: str
    unacked: dict = field(default_factory=dict)   # seq -> chunk bytes, in sequence order
    in_flight: set = field(default_factory=set)
    attempts: dict = field(default_factory=dict)  # seq -> sends that failed
    not_before: float = 0.0


@dataclass
class Request:
    token: int
    address: str
    chunks: list  # [(key, seq, bytes)]

    @property
    def frames(self) -> list:
        return [c for _, _, c in self.chunks]


class ProduceQueue:
    def __init__(self, in_flight_per_broker: int, request_size_bytes: int,
                 attempts_max: int = ATTEMPTS_MAX):
        self.in_flight_per_broker = in_flight_per_broker
        self.request_size_bytes = request_size_bytes
        self.attempts_max = attempts_max
        self.streamlets: dict[Key, _Streamlet] = {}
        self.requests: dict[int, Request] = {}
        self.pending_bytes = 0
        self.stale: set[int] = set()   # stream ids whose placement must be refreshed
        self._tokens = itertools.count()
        self._next_seq: dict[Key, int] = {}
        self.acked = 0                 # chunks acknowledged so far (progress, for deadlines)

    @property
    def done(self) -> bool:
        return self.pending_bytes == 0 and not self.requests

    def add(self, key: Key, seq: int, chunk: bytes, address: str) -> None:
        """Queue a chunk; a key's chunks must come in sequence order (from any first one)."""
        expected = self._next_seq.get(key, seq)
        assert seq == expected, f"chunk {seq} of {key} added out of order (expected {expected})"
        self._next_seq[key] = seq + 1
        s = self.streamlets.get(key)
        if s is None:
            s = self.streamlets[key] = _Streamlet(address)
        s.unacked[seq] = chunk
        self.pending_bytes += len(chunk)

    def move(self, key: Key, address: str) -> None:
        if key in self.streamlets:
            self.streamlets[key].address = address

    def next_requests(self, now: float) -> list[Request]:
        """Requests to send now: per broker up to the window, each with at most one chunk per
        streamlet (for each producer, its lowest not acknowledged and not in flight) up to
        request_size_bytes."""
        busy: dict[str, int] = {}
        for r in self.requests.values():
            busy[r.address] = busy.get(r.address, 0) + 1
        ready: dict[str, list] = {}
        for key, s in self.streamlets.items():
            if s.not_before > now:
                continue
            seq = next((q for q in s.unacked if q not in s.in_flight), None)
            if seq is not None:
                ready.setdefault(s.address, []).append((key, seq))
        out = []
        for address, candidates in ready.items():
            while candidates and busy.get(address, 0) < self.in_flight_per_broker:
                chunks, size, rest, taken = [], 0, [], set()
                for key, seq in candidates:
                    chunk = self.streamlets[key].unacked[seq]
                    if key[1:] in taken or (chunks and size + len(chunk) > self.request_size_bytes):
                        rest.append((key, seq))
                        continue
                    taken.add(key[1:])
                    chunks.append((key, seq, chunk))
                    size += len(chunk)
                    self.streamlets[key].in_flight.add(seq)
                req = Request(next(self._tokens), address, chunks)
                self.requests[req.token] = req
                busy[address] = busy.get(address, 0) + 1
                out.append(req)
                # The next request may take the next chunk of the streamlets just sent.
                refill = []
                for key, seq, _ in chunks:
                    s = self.streamlets[key]
                    nxt = next((q for q in s.unacked if q not in s.in_flight), None)
                    if nxt is not None:
                        refill.append((key, nxt))
                candidates = rest + refill
        return out

    def on_reply(self, token: int, results: list, now: float) -> None:
        """A produce reply: one result per chunk, `[g, segment, base_offset]` when stored (or
        already stored), `[code, message, retriable]` when refused."""
        req = self.requests.pop(token, None)
        if req is None:
            return
        if not isinstance(results, list) or len(results) != len(req.chunks):
            self._failed(req, KeraError(f"produce reply from {req.address} has "
                                        f"{len(results) if isinstance(results, list) else '?'} "
                                        f"results for {len(req.chunks)} chunks", retriable=True), now)
            return
        for (key, seq, chunk), result in zip(req.chunks, results):
            s = self.streamlets[key]
            s.in_flight.discard(seq)
            result = schema.produce_result(result)
            if isinstance(result, KeraError):
                self._refused(key, seq, result, now)
            elif seq in s.unacked:
                self.pending_bytes -= len(s.unacked.pop(seq))
                s.attempts.pop(seq, None)
                self.acked += 1

    def on_failure(self, token: int, error: KeraError, now: float) -> None:
        """The whole request failed: an error reply or no reply in time."""
        req = self.requests.pop(token, None)
        if req is not None:
            self._failed(req, error, now)

    def _failed(self, req: Request, error: KeraError, now: float) -> None:
        for key, seq, _ in req.chunks:
            self.streamlets[key].in_flight.discard(seq)
        for key, seq, _ in req.chunks:
            self._refused(key, seq, error, now)

    def _refused(self, key: Key, seq: int, error: KeraError, now: float) -> None:
        s = self.streamlets[key]
        if seq not in s.unacked:
            return
        if not error.retriable:
            raise error
        tries = s.attempts[seq] = s.attempts.get(seq, 0) + 1
        if tries >= self.attempts_max:
            raise KeraError(f"chunk {seq} of stream {key[1]} streamlet {key[2]} refused "
                            f"{tries} times; last: {error.code}: {error}", retriable=True)
        if isinstance(error, (NotOwner, UnknownStream, Timeout)):
            self.stale.add(key[1])
        if not isinstance(error, SequenceGap):  # a gap clears as soon as the earlier chunk lands
            s.not_before = max(s.not_before, now + min(RETRY_PAUSE_MAX_S, RETRY_PAUSE_S * 2 ** tries))


class Sender:
    """Sockets around a ProduceQueue: one connection per broker, bounded unacknowledged bytes.
    Fails (Timeout) when no chunk is acknowledged for STALL_TIMEOUTS request timeouts."""

    STALL_TIMEOUTS = 3

    def __init__(self, meta: Metadata, in_flight_per_broker: int, request_size_bytes: int,
                 buffer_bytes: int, timeout_s: float):
        self.meta = meta
        self.queue = ProduceQueue(in_flight_per_broker, request_size_bytes)
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self._progress = (0, time.monotonic())  # (acked chunks, when that count last moved)
        self.streams: dict[int, StreamInfo] = {}
        self._sent: dict[tuple[str, int], tuple[int, float]] = {}  # (address, req id) -> (token, deadline)
        self.poller = zmq.Poller()
        self._polled: set[str] = set()

    def stream(self, name: str) -> StreamInfo:
        for info in self.streams.values():
            if info.name == name:
                return info
        info = self.meta.describe(name)
        self.streams[info.id] = info
        return info

    def send(self, producer_id: int, info: StreamInfo, streamlet: int, seq: int, chunk: bytes) -> None:
        if self.queue.done:  # idle until now (waiting for rows is not a stall)
            self._progress = (self.queue.acked, time.monotonic())
        self.queue.add((producer_id, info.id, streamlet), seq, chunk, info.owner(streamlet))
        self.pump(0.0)
        while self.queue.pending_bytes > self.buffer_bytes:
            self.pump(self.timeout_s)

    def flush(self) -> None:
        while not self.queue.done:
            self.pump(self.timeout_s)

    def pump(self, wait_s: float) -> None:
        """Send what may be sent, then handle replies (waiting up to wait_s for the first)."""
        now = time.monotonic()
        self._check_progress(now)
        self._refresh()
        for req in self.queue.next_requests(now):
            conn = self.meta.conn(req.address)
            if req.address not in self._polled:
                self.poller.register(conn.sock, zmq.POLLIN)
                self._polled.add(req.address)
            try:
                req_id = conn.send("produce", None, req.frames, timeout_s=self.timeout_s)
            except Timeout as exc:  # the broker is not reachable: retry after a pause
                self.queue.on_failure(req.token, exc, now)
                continue
            self._sent[(req.address, req_id)] = (req.token, now + self.timeout_s)
        if not self._sent:
            if not self.queue.done:  # everything is waiting out a retry pause
                time.sleep(min(wait_s, RETRY_PAUSE_S))
            return
        wait_ms = max(0, int(1000 * min(wait_s, self._first_deadline() - now)))
        socks = dict(self.poller.poll(wait_ms))
        for address in list(self._polled):
            conn = self.meta.conn(address)
            if conn.sock not in socks:
                continue
            while conn.sock.poll(0, zmq.POLLIN):
                header, _ = conn.recv(0)
                sent = self._sent.pop((address, header.get("id")), None)
                if sent is None:
                    continue  # a late reply to a request that already timed out
                token = sent[0]
                try:
                    wire.raise_for_reply(header)
                    self.queue.on_reply(token, wire.Fields(header).list("results"), time.monotonic())
                except KeraError as exc:
                    self.queue.on_failure(token, exc, time.monotonic())
        self._expire(time.monotonic())

    def _check_progress(self, now: float) -> None:
        acked, since = self._progress
        if self.queue.acked != acked or self.queue.done:
            self._progress = (self.queue.acked, now)
        elif now - since > self.STALL_TIMEOUTS * self.timeout_s:
            raise Timeout(f"no chunk acknowledged for {now - since:.0f} s "
                          f"({self.queue.pending_bytes} bytes waiting)")

    def _first_deadline(self) -> float:
        return min(deadline for _, deadline in self._sent.values())

    def _expire(self, now: float) -> None:
        for (address, req_id), (token, deadline) in list(self._sent.items()):
            if deadline <= now:
                del self._sent[(address, req_id)]
                self.queue.on_failure(token, Timeout(f"no produce reply from {address} within "
                                                     f"{self.timeout_s:.0f} s"), now)

    def _refresh(self) -> None:
        """Look up streams whose owner refused or ignored chunks: the streamlet may have moved."""
        while self.queue.stale:
            sid = self.queue.stale.pop()
            old = self.streams.get(sid)
            if old is None:
                continue
            info = self.meta.describe(old.name)
            if info.id != sid:
                raise UnknownStream(f"stream {old.name!r} was deleted while being written")
            self.streams[sid] = info
            for key in self.queue.streamlets:
                if key[1] == sid:
                    self.queue.move(key, info.owner(key[2]))

    def close(self) -> None:
        self.meta.close()
