"""What the consumer's request thread fetches next and what it makes of replies. Sans-IO.

One fetch request at a time per broker, reading every assigned streamlet that broker owns
(`[sid, sl, cursor, max_bytes]` each). A reply turns into cache items, in order: a ChunkItem per
new chunk, a LowItem when finished groups let a streamlet's cursor move up, an ErrorItem for an
error the caller must see. A broker that had nothing new is asked again after `idle_wait_s`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from kera.chunk import HEADER_SIZE, Chunk, chunk_size
from kera.consumer.cursor import ChunkItem, ErrorItem, FetchCursor, LowItem, ResetItem, parse_groups
from kera import schema, wire
from kera.errors import BadRequest, CorruptChunk, KeraError, PositionLost, Timeout, UnknownStream

BACKOFF_MS_BASE = 5
BACKOFF_MS_MAX = 1000

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    req_id: int
    streamlets: list
    deadline: float


@dataclass
class FetchState:
    stream: str
    stream_id: int
    cursors: dict                       # streamlet -> FetchCursor
    fetch_max_bytes: int
    request_timeout_s: float
    idle_wait_s: float
    in_flight: dict = field(default_factory=dict)       # broker -> InFlight
    next_fetch_at: dict = field(default_factory=dict)   # broker -> monotonic time
    retry_at: dict = field(default_factory=dict)        # streamlet -> monotonic time
    failures: dict = field(default_factory=dict)        # streamlet -> consecutive failures
    # Set after not_owner, unknown_stream, timeouts: the thread asks the coordinator again, and
    # a stream the coordinator no longer knows is fatal (the broker's word alone is not: its
    # metadata may lag the coordinator's).
    want_refresh: bool = False
    fatal: bool = False
    # What a position_lost read does: "raise", "earliest" or "latest" (Consumer's docstring).
    on_lost_position: str = "raise"
    # Streamlets reset to "latest": their next read only learns the group table.
    to_latest: set = field(default_factory=set)

    def build(self, now: float, address_of: Callable[[int, int], str | None]
              ) -> list[tuple[str, list, list]]:
        """(broker, reads, streamlets) for each broker to fetch from now."""
        if self.fatal:
            return []
        by_broker: dict[str, list[int]] = {}
        for sl in self.cursors:
            if self.retry_at.get(sl, 0.0) > now:
                continue
            address = address_of(self.stream_id, sl)
            if address is None:
                self.want_refresh = True
                self.retry_at[sl] = now + BACKOFF_MS_MAX / 1000
                continue
            by_broker.setdefault(address, []).append(sl)
        out = []
        for broker, sls in by_broker.items():
            if broker in self.in_flight or self.next_fetch_at.get(broker, 0.0) > now:
                continue
            per_read = max(1, self.fetch_max_bytes // len(sls))
            reads = [[self.stream_id, sl, self.cursors[sl].wire(), per_read] for sl in sls]
            out.append((broker, reads, sls))
        return out

    def sent(self, broker: str, req_id: int, streamlets: list, now: float) -> None:
        self.in_flight[broker] = InFlight(req_id, streamlets, now + self.request_timeout_s)

    def send_failed(self, broker: str, streamlets: list, now: float) -> None:
        for sl in streamlets:
            self._read_failed(sl, Timeout(f"broker {broker} is not reachable"), now, [])

    def expire(self, now: float) -> None:
        for broker, fl in list(self.in_flight.items()):
            if fl.deadline <= now:
                del self.in_flight[broker]
                for sl in fl.streamlets:
                    self._read_failed(sl, Timeout(f"no fetch reply from {broker} within "
                                                  f"{self.request_timeout_s:.1f} s"), now, [])

    def next_wake(self, now: float) -> float | None:
        times = [fl.deadline for fl in self.in_flight.values()]
        times += [t for t in self.next_fetch_at.values() if t > now]
        times += [t for t in self.retry_at.values() if t > now]
        return min(times, default=None)

    # ------------------------------------------------------------------ replies
    def on_reply(self, broker: str, header: dict, frames: list, now: float) -> list:
        """Cache items made of one fetch reply (empty for a late or unknown reply)."""
        fl = self.in_flight.get(broker)
        if fl is None or header.get("id") != fl.req_id:
            return []
        del self.in_flight[broker]
        items: list = []
        if header.get("ok") is not True:
            err = schema.error_reply(header)
            for sl in fl.streamlets:
                self._read_failed(sl, err, now, items)
            return items
        results = header.get("results")
        if not isinstance(results, list) or len(results) != len(fl.streamlets):
            for sl in fl.streamlets:
                self._read_failed(sl, KeraError(f"fetch reply from {broker} has a malformed "
                                                "results list", retriable=True), now, items)
            return items
        epochs = header.get("epochs")
        if not isinstance(epochs, list) or len(epochs) != len(results):
            epochs = [None] * len(results)   # a broker that predates epochs
        got = 0
        at = 0
        for sl, result, epoch in zip(fl.streamlets, results, epochs):
            try:
                error, n_frames, groups = _parse_result(result)
                if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)
                                          or epoch < 0):
                    raise BadRequest(f"bad epoch {epoch!r}")
                if at + n_frames > len(frames):
                    raise BadRequest(f"fetch reply announces {at + n_frames} frames, carries {len(frames)}")
            except BadRequest as err:
                self._read_failed(sl, KeraError(f"malformed fetch result from {broker}: {err}",
                                                retriable=True), now, items)
                # Frames of the reads after this one can no longer be attributed: refetch all.
                for later in fl.streamlets[fl.streamlets.index(sl) + 1:]:
                    self.retry_at[later] = now
                break
            read_frames = frames[at:at + n_frames]
            at += n_frames
            if error is not None:
                self._read_failed(sl, error, now, items)
                continue
            try:
                if sl in self.to_latest:
                    self._reset_to_latest(sl, groups, epoch, items)
                    continue
                got += self._apply_read(sl, read_frames, groups, items, epoch)
            except CorruptChunk as err:
                self._read_failed(sl, CorruptChunk(f"fetched chunk of streamlet {sl}: {err}",
                                                   retriable=True), now, items)
                continue
            self.failures.pop(sl, None)
        if not got:
            self.next_fetch_at[broker] = now + self.idle_wait_s
        return items

    def _apply_read(self, sl: int, frames: list, groups, items: list, epoch: int | None = None) -> int:
        cursor: FetchCursor = self.cursors[sl]
        if epoch is not None:
            cursor.epoch = epoch   # the broker checked any epoch the cursor had: the same
        new = []
        for frame in frames:
            buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
            at = 0
            while at < len(buf):  # a frame may hold several chunks back to back
                if len(buf) - at < HEADER_SIZE:
                    raise CorruptChunk(f"{len(buf) - at} stray bytes after the chunks of a frame")
                size = chunk_size(buf, at)
                chunk = Chunk(buf[at:at + size])  # checks both checksums
                at += size
                h = chunk.header
                if h.stream_id != self.stream_id or h.streamlet != sl:
                    raise CorruptChunk(f"chunk of stream {h.stream_id} streamlet {h.streamlet} "
                                       f"in a read of stream {self.stream_id} streamlet {sl}")
                new.append(chunk)
        # Only once the whole read checked out does the cursor move (a corrupt read is refetched).
        count = 0
        for chunk in new:
            skip = cursor.on_chunk(chunk.header)
            if skip is not None:
                items.append(ChunkItem(sl, chunk, skip, cursor.epoch))
                count += 1
        low = cursor.on_groups(groups)
        if low is not None:
            items.append(LowItem(sl, low))
        return count

    def _reset_to_latest(self, sl: int, groups, epoch: int | None, items: list) -> None:
        cursor = FetchCursor.at_end(sl, groups, min((gi.group for gi in groups), default=0))
        cursor.epoch = epoch
        self.cursors[sl] = cursor
        self.to_latest.discard(sl)
        items.append(ResetItem(sl, cursor.low, dict(cursor.offsets), epoch))

    def _position_lost(self, sl: int, err: KeraError, items: list) -> None:
        """Apply `on_lost_position` (not "raise"): restart the streamlet in its new history."""
        log.warning("stream '%s' streamlet %d: %s; restarting at %s", self.stream, sl,
                    err.message, self.on_lost_position)
        self.cursors[sl] = FetchCursor(sl, 0, {}, earliest=True)
        if self.on_lost_position == "latest":
            self.to_latest.add(sl)   # the next read (from the first group) gives the table
        else:
            items.append(ResetItem(sl, 0, {}, None))

    def _read_failed(self, sl: int, err: KeraError, now: float, items: list) -> None:
        if isinstance(err, PositionLost) and self.on_lost_position != "raise":
            self._position_lost(sl, err, items)
            return
        n = self.failures[sl] = self.failures.get(sl, 0) + 1
        if isinstance(err, UnknownStream) or err.retriable:
            if err.refresh_metadata:
                self.want_refresh = True
        else:
            self.fatal = True
            items.append(ErrorItem(err.__class__(
                f"stream '{self.stream}' streamlet {sl}: {err.message}", retriable=False)))
            return
        self.retry_at[sl] = now + min(BACKOFF_MS_MAX, BACKOFF_MS_BASE << min(n, 10)) / 1000


def _parse_result(result):
    error, n_frames, groups = schema.fetch_result(result, wire.MAX_FRAMES)   # checked against the frames by the caller
    return error, n_frames, parse_groups(groups)
