"""What the consumer's request thread fetches next and what it makes of replies. Sans-IO.

A consumer reads *parts*: (stream name, streamlet) pairs, of any number of streams. One fetch
request at a time per broker, reading every part that broker owns (`[sid, sl, cursor,
max_bytes]` each, at most FETCH_READS_MAX of them). A reply turns into cache items, in order: a ChunkItem per
new chunk, a LowItem when finished groups let a streamlet's cursor move up, an ErrorItem for an
error the caller must see. A request asks the broker to hold it up to `max_wait_ms` while it
finds nothing (kera.broker.fetch_waits); a reply that says it was held is followed by the next
request at once, and a broker that had nothing new without holding (one that predates held
fetches, or that holds too many) is asked again after `idle_wait_s`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from kera.codec.chunk import Chunk, frame_chunks
from kera.consumer.cursor import ChunkItem, ErrorItem, FetchCursor, LowItem, ResetItem, parse_groups
from kera.codec import schema
from kera.codec import wire
from kera.config import STALL_PROBE_INTERVAL_S, STALL_PROBE_S
from kera.errors import BadRequest, CorruptChunk, KeraError, PositionLost, Timeout, UnknownStream
from kera.net.backoff import Backoff

BACKOFF_MS_MAX = 1000
# A failed read's wait before its part is fetched again (kera.net.backoff): after n failures in
# a row, delay_s(n + 1), 10 ms after the first, doubling up to BACKOFF_MS_MAX.
RETRY_BACKOFF = Backoff(first_ms=5, max_ms=BACKOFF_MS_MAX)
# The broker's bound on reads in one fetch request (broker/core.py): a broker owning more parts
# is read FETCH_READS_MAX of them per request, in turn.
FETCH_READS_MAX = 4096

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    req_id: int
    parts: list
    deadline: float
    probe_at: float       # when to look again whether its parts' owner moved (probe_stalled)
    # The cursor each read was built from: a part sought or unassigned since has another (or
    # none), and that read's result is dropped.
    sent_cursors: list = field(default_factory=list)


@dataclass
class FetchState:
    stream_ids: dict                    # stream name -> stream id
    cursors: dict                       # (stream, streamlet) -> FetchCursor
    fetch_max_bytes: int
    request_timeout_s: float
    idle_wait_s: float
    in_flight: dict = field(default_factory=dict)       # broker -> InFlight
    next_fetch_at: dict = field(default_factory=dict)   # broker -> monotonic time
    retry_at: dict = field(default_factory=dict)        # part -> monotonic time
    failures: dict = field(default_factory=dict)        # part -> consecutive failures
    # Streams named after not_owner, unknown_stream, timeouts: the thread asks the coordinator
    # again, and a stream the coordinator no longer knows is fatal (the broker's word alone is
    # not: its metadata may lag the coordinator's).
    want_refresh: set = field(default_factory=set)
    fatal: bool = False
    # What a position_lost read does: "raise", "earliest" or "latest" (Consumer's docstring).
    on_lost_position: str = "raise"
    # Parts reset to "latest": their next read only learns the group table.
    to_latest: set = field(default_factory=set)
    # broker -> where its next request starts in its list of parts (more than FETCH_READS_MAX).
    rotation: dict = field(default_factory=dict)
    # How long a broker may hold a request that finds nothing (0: answer at once).
    max_wait_ms: int = 0

    # ------------------------------------------------------------------ assignment
    def set_cursor(self, part: tuple, cursor: FetchCursor) -> None:
        """Read `part` from `cursor` on (a new part, or a seek: a read in flight is dropped)."""
        self.cursors[part] = cursor
        self.to_latest.discard(part)
        self.retry_at.pop(part, None)
        self.failures.pop(part, None)

    def remove(self, part: tuple) -> None:
        self.cursors.pop(part, None)
        self.to_latest.discard(part)
        self.retry_at.pop(part, None)
        self.failures.pop(part, None)

    def build(self, now: float, address_of: Callable[[int, int], str | None]
              ) -> list[tuple[str, list, list]]:
        """(broker, reads, parts) for each broker to fetch from now: one request per broker
        carrying every part it owns (FETCH_READS_MAX at most, in turn)."""
        if self.fatal:
            return []
        by_broker: dict[str, list[tuple]] = {}
        for part in self.cursors:
            if self.retry_at.get(part, 0.0) > now:
                continue
            address = address_of(self.stream_ids[part[0]], part[1])
            if address is None:
                self.want_refresh.add(part[0])
                self.retry_at[part] = now + BACKOFF_MS_MAX / 1000
                continue
            by_broker.setdefault(address, []).append(part)
        out = []
        for broker, parts in by_broker.items():
            if broker in self.in_flight or self.next_fetch_at.get(broker, 0.0) > now:
                continue
            parts = self._turn(broker, parts)
            per_read = max(1, self.fetch_max_bytes // len(parts))
            reads = [[self.stream_ids[st], sl, self.cursors[(st, sl)].wire(), per_read]
                     for st, sl in parts]
            out.append((broker, reads, parts))
        return out

    def _turn(self, broker: str, parts: list) -> list:
        """The parts of this turn's request to `broker`: all of them, or FETCH_READS_MAX
        starting where the previous turn stopped (so none starves)."""
        if len(parts) <= FETCH_READS_MAX:
            return parts
        start = self.rotation.get(broker, 0) % len(parts)
        self.rotation[broker] = start + FETCH_READS_MAX
        return (parts[start:] + parts[:start])[:FETCH_READS_MAX]

    def wait_ms(self, parts: list) -> int:
        """How long the request reading `parts` may be held: not at all while a part waits to
        learn where "latest" is (its read's answer is the group table, wanted now)."""
        if self.to_latest and any(part in self.to_latest for part in parts):
            return 0
        return self.max_wait_ms

    def sent(self, broker: str, req_id: int, parts: list, now: float,
             wait_ms: int = 0) -> None:
        wait_s = wait_ms / 1000   # a held request is not late until its wait is over too
        self.in_flight[broker] = InFlight(req_id, parts, now + self.request_timeout_s + wait_s,
                                          now + STALL_PROBE_S + wait_s,
                                          [self.cursors.get(p) for p in parts])

    def send_failed(self, broker: str, parts: list, now: float) -> None:
        for part in parts:
            self._read_failed(part, Timeout(f"broker {broker} is not reachable"), now, [])

    def expire(self, now: float) -> None:
        for broker, fl in list(self.in_flight.items()):
            if fl.deadline <= now:
                del self.in_flight[broker]
                for part in self._still_read(fl):
                    self._read_failed(part, Timeout(f"no fetch reply from {broker} within "
                                                  f"{self.request_timeout_s:.1f} s"), now, [])

    def probe_stalled(self, now: float, address_of: Callable[[int, int], str | None]) -> None:
        """A fetch unanswered for STALL_PROBE_S is dropped once one of its parts has another
        owner in the metadata (the parts are fetched there at once, none lost: their cursors
        did not move); until then its streams' owners are asked again now and then."""
        for broker, fl in list(self.in_flight.items()):
            if fl.probe_at > now:
                continue
            owners = {address_of(self.stream_ids[st], sl) for st, sl in fl.parts if st in self.stream_ids}
            if owners - {broker, None}:
                del self.in_flight[broker]   # its late reply is ignored (on_reply)
                continue
            fl.probe_at = now + STALL_PROBE_INTERVAL_S
            self.want_refresh |= {st for st, _ in fl.parts}

    def _still_read(self, fl: InFlight) -> list:
        """The parts of a request still read from the cursor it was built from."""
        return [part for part, sent in zip(fl.parts, fl.sent_cursors)
                if sent is not None and self.cursors.get(part) is sent]

    def next_wake(self, now: float) -> float | None:
        times = [min(fl.deadline, fl.probe_at) for fl in self.in_flight.values()]
        times += [t for t in self.next_fetch_at.values() if t > now]
        times += [t for t in self.retry_at.values() if t > now]
        return min(times, default=None)

    # ------------------------------------------------------------------ replies
    def on_reply(self, broker: str, header: dict, frames: list, now: float) -> list:
        """Cache items made of one fetch reply (empty for a late or unknown reply). The result
        of a part sought or unassigned since the request was sent is dropped."""
        fl = self.in_flight.get(broker)
        if fl is None or header.get("id") != fl.req_id:
            return []
        del self.in_flight[broker]
        items: list = []
        live = self._still_read(fl)
        if header.get("ok") is not True:
            err = schema.error_reply(header)
            for part in live:
                self._read_failed(part, err, now, items)
            return items
        results = header.get("results")
        if not isinstance(results, list) or len(results) != len(fl.parts):
            for part in live:
                self._read_failed(part, KeraError(f"fetch reply from {broker} has a malformed "
                                                  "results list", retriable=True), now, items)
            return items
        epochs = header.get("epochs")
        if not isinstance(epochs, list) or len(epochs) != len(results):
            epochs = [None] * len(results)   # a broker that predates epochs
        got = self._apply_results(broker, fl, results, epochs, frames, now, items)
        if not got and header.get("held") is not True:
            self.next_fetch_at[broker] = now + self.idle_wait_s
        return items

    def _apply_results(self, broker: str, fl: InFlight, results: list, epochs: list,
                       frames: list, now: float, items: list) -> int:
        got = 0
        at = 0
        for i, (part, result, epoch) in enumerate(zip(fl.parts, results, epochs)):
            try:
                error, n_frames, groups = _parse_result(result)
                if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)
                                          or epoch < 0):
                    raise BadRequest(f"bad epoch {epoch!r}")
                if at + n_frames > len(frames):
                    raise BadRequest(f"fetch reply announces {at + n_frames} frames, carries {len(frames)}")
            except BadRequest as err:
                if self.cursors.get(part) is fl.sent_cursors[i]:
                    self._read_failed(part, KeraError(f"malformed fetch result from {broker}: {err}",
                                                      retriable=True), now, items)
                # Frames of the reads after this one can no longer be attributed: refetch all.
                for later in fl.parts[i + 1:]:
                    if later in self.cursors:
                        self.retry_at[later] = now
                break
            read_frames = frames[at:at + n_frames]
            at += n_frames
            if self.cursors.get(part) is not fl.sent_cursors[i]:
                continue   # sought or unassigned since: what was read is of no use
            got += self._apply_one(part, error, read_frames, groups, epoch, now, items)
        return got

    def _apply_one(self, part: tuple, error, frames: list, groups, epoch, now: float,
                   items: list) -> int:
        if error is not None:
            self._read_failed(part, error, now, items)
            return 0
        try:
            if part in self.to_latest:
                self._reset_to_latest(part, groups, epoch, items)
                return 0
            got = self._apply_read(part, frames, groups, items, epoch)
        except CorruptChunk as err:
            self._read_failed(part, CorruptChunk(f"fetched chunk of streamlet {part[1]}: {err}",
                                                 retriable=True), now, items)
            return 0
        self.failures.pop(part, None)
        return got

    def _apply_read(self, part: tuple, frames: list, groups, items: list,
                    epoch: int | None = None) -> int:
        cursor: FetchCursor = self.cursors[part]
        if epoch is not None:
            cursor.epoch = epoch   # the broker checked any epoch the cursor had: the same
        sid, sl = self.stream_ids[part[0]], part[1]
        new = []
        for frame in frames:
            for view in frame_chunks(frame):   # a frame may hold several chunks back to back
                chunk = Chunk(view)            # checks both checksums
                h = chunk.header
                if h.stream_id != sid or h.streamlet != sl:
                    raise CorruptChunk(f"chunk of stream {h.stream_id} streamlet {h.streamlet} "
                                       f"in a read of stream {sid} streamlet {sl}")
                new.append(chunk)
        # Only once the whole read checked out does the cursor move (a corrupt read is refetched).
        count = 0
        for chunk in new:
            skip = cursor.on_chunk(chunk.header, chunk)
            if skip is not None:
                items.append(ChunkItem(part, chunk, skip, cursor.epoch))
                count += 1
        low = cursor.on_groups(groups)
        if low is not None:
            items.append(LowItem(part, low))
        return count

    def _reset_to_latest(self, part: tuple, groups, epoch: int | None, items: list) -> None:
        cursor = FetchCursor.at_end(part[1], groups, min((gi.group for gi in groups), default=0))
        cursor.epoch = epoch
        self.cursors[part] = cursor
        self.to_latest.discard(part)
        items.append(ResetItem(part, cursor.low, dict(cursor.offsets), epoch))

    def _position_lost(self, part: tuple, err: KeraError, items: list) -> None:
        """Apply `on_lost_position` (not "raise"): restart the streamlet in its new history."""
        log.warning("stream '%s' streamlet %d: %s; restarting at %s", part[0], part[1],
                    err.message, self.on_lost_position)
        self.cursors[part] = FetchCursor(part[1], 0, {}, earliest=True)
        if self.on_lost_position == "latest":
            self.to_latest.add(part)   # the next read (from the first group) gives the table
        else:
            items.append(ResetItem(part, 0, {}, None))

    def _read_failed(self, part: tuple, err: KeraError, now: float, items: list) -> None:
        if part not in self.cursors:
            return   # unassigned since the read was sent
        if isinstance(err, PositionLost) and self.on_lost_position != "raise":
            self._position_lost(part, err, items)
            return
        n = self.failures[part] = self.failures.get(part, 0) + 1
        if isinstance(err, UnknownStream) or err.retriable:
            if err.refresh_metadata:
                self.want_refresh.add(part[0])
        else:
            self.fatal = True
            items.append(ErrorItem(err.__class__(
                f"stream '{part[0]}' streamlet {part[1]}: {err.message}", retriable=False)))
            return
        self.retry_at[part] = now + RETRY_BACKOFF.delay_s(n + 1)


def _parse_result(result):
    error, n_frames, groups = schema.fetch_result(result, wire.MAX_FRAMES)   # checked against the frames by the caller
    return error, n_frames, parse_groups(groups)
