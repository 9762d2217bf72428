"""The Consumer: a request thread fills a bounded cache of chunks; the caller walks records.

    with Consumer("127.0.0.1:7000", "clicks", start="earliest") as c:
        for record in c:              # kera.position.Record
            ...
        c.poll(timeout_s=1.0)         # one Record or None
        c.poll_batch(timeout_s=1.0)   # list of Batch (columnar: to_arrow(), values, ...)
        c.positions()                 # exact resumable positions of what was consumed

Records of one group come in offset order and groups of one slot in order (the broker's fetch
rules), so one producer's records to a streamlet are read in the order they were sent.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

from kera import config, rpc
from kera.consumer.batch import Batch
from kera.consumer.cursor import (ChunkItem, ConsumedCursor, ErrorItem, FetchCursor, LowItem,
                                  ResetItem, cursors_with_epochs, parse_groups)
from kera.consumer.fetching import FetchState
from kera.errors import BadRequest, ClientClosed, KeraError, Timeout
from kera.metadata import Metadata
from kera.position import Position, Record

log = logging.getLogger(__name__)
# What a consumer does with a position into a history its streamlet no longer has.
LOST_POSITION_POLICIES = ("raise", "earliest", "latest")

LATEST_RETRY_S = 0.05


class Consumer:
    def __init__(self, bootstrap: str, stream: str, *, start="earliest",
                 streamlets=None, member: int | None = None, members: int | None = None,
                 cache_chunks_max: int = config.DEFAULT_CACHE_CHUNKS_MAX,
                 fetch_max_bytes: int = config.DEFAULT_FETCH_MAX_BYTES,
                 request_timeout_s: float = config.DEFAULT_REQUEST_TIMEOUT_S,
                 fetch_wait_ms: float = config.DEFAULT_FETCH_WAIT_MS,
                 on_lost_position: str = "raise"):
        """`on_lost_position`: what to do when a streamlet no longer has the history a position
        points into (its data was lost: an R=1 broker restarted without it), like Kafka's
        auto.offset.reset: "raise" (the default) raises PositionLost from poll; "earliest"
        restarts the streamlet at its first record, "latest" at its end (both log a warning).
        Raising is the default, unlike Kafka's "latest": kera promises not to lose
        acknowledged records, so a loss is an event the application must hear of and decide
        on, never something a reader skips past. The position is never reinterpreted in the
        new history (that would silently skip the records produced after the loss)."""
        if cache_chunks_max < 1 or fetch_max_bytes < 1:
            raise ValueError("cache_chunks_max and fetch_max_bytes must be positive")
        if on_lost_position not in LOST_POSITION_POLICIES:
            raise ValueError(f"on_lost_position must be one of {LOST_POSITION_POLICIES}, "
                             f"not {on_lost_position!r}")
        self.stream = stream
        self.cache_chunks_max = cache_chunks_max
        self.request_timeout_s = request_timeout_s
        self._meta = Metadata(bootstrap, timeout_s=request_timeout_s)
        try:
            self.info = info = self._meta.stream(stream)
            self.streamlets = _assigned(info.streamlets, streamlets, member, members)
            starts = self._start_cursors(start)
        except BaseException:
            self._meta.close()
            raise
        self._consumed = {sl: ConsumedCursor(sl, low, offsets, epoch)
                          for sl, (low, offsets, epoch) in starts.items()}
        # A streamlet starting from its beginning starts from its first retained group.
        self._fetch = FetchState(stream, info.id,
                                 {sl: FetchCursor(sl, low, offsets, earliest=(low, offsets) == (0, {}),
                                                  epoch=epoch)
                                  for sl, (low, offsets, epoch) in starts.items()},
                                 fetch_max_bytes=fetch_max_bytes, request_timeout_s=request_timeout_s,
                                 idle_wait_s=fetch_wait_ms / 1000, on_lost_position=on_lost_position)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._items: collections.deque = collections.deque()
        self._cached_chunks = 0
        self._fetcher_waiting = False
        self._stopping = False
        self._closed = False
        self._error: KeraError | None = None
        # The item being walked record by record: (ChunkItem, keys, values, timestamps) + index.
        self._cur: ChunkItem | None = None
        self._cur_lists = None
        self._cur_idx = 0
        self.records_consumed = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        from kera.consumer.fetcher import Fetcher
        self._fetcher = Fetcher(self)
        self._fetcher.start()

    # ------------------------------------------------------------------ start positions
    def _start_cursors(self, start) -> dict[int, tuple[int, dict[int, int], int | None]]:
        if isinstance(start, str):
            if start == "earliest":
                return {sl: (0, {}, None) for sl in self.streamlets}
            if start == "latest":
                return {sl: self._latest(sl) for sl in self.streamlets}
            raise BadRequest(f"start must be 'earliest', 'latest' or a list of positions, not {start!r}")
        given = cursors_with_epochs(list(start), self.stream)
        unknown = sorted(sl for sl, (low, offsets, epoch) in given.items()
                         if epoch is None and (low, offsets) != (0, {0: 0}))
        if unknown:
            log.warning("stream '%s': positions of streamlets %s carry no epoch (saved by an "
                        "older kera): resumed unchecked, a loss of their data since cannot be "
                        "detected; save positions() again to get checked ones", self.stream, unknown)
        # Streamlets without a saved position start at the beginning.
        return {sl: given.get(sl, (0, {}, None)) for sl in self.streamlets}

    def _latest(self, sl: int) -> tuple[int, dict[int, int]]:
        """Each group's durable end, from the owning broker's `offsets`."""
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            address = self.info.address_of(sl)
            err: KeraError
            if address is None:
                err = KeraError(f"streamlet {sl} of '{self.stream}' has no live broker", retriable=True)
            else:
                try:
                    header, _ = rpc.call(address, "offsets", {"sid": self.info.id, "sl": sl},
                                         timeout_s=max(0.1, deadline - time.monotonic()))
                    first = header.get("first_group", 0)
                    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
                        raise KeraError(f"bad first_group {first!r} from {address}", retriable=True)
                    cursor = FetchCursor.at_end(sl, parse_groups(header.get("groups")), first)
                    epoch = header.get("epoch")
                    if epoch is not None and (not isinstance(epoch, int) or epoch < 0):
                        raise KeraError(f"bad epoch {epoch!r} from {address}", retriable=True)
                    return cursor.low, cursor.offsets, epoch
                except KeraError as e:
                    if not e.retriable:
                        raise
                    err = e
            if time.monotonic() + LATEST_RETRY_S >= deadline:
                raise Timeout(f"latest offsets of '{self.stream}' streamlet {sl}: {err.message}")
            time.sleep(LATEST_RETRY_S)
            self.info = self._meta.refresh(self.stream)

    # ------------------------------------------------------------------ reading
    def poll(self, timeout_s: float | None = None) -> Record | None:
        """The next record, waiting up to `timeout_s` (None: forever); None on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            cur = self._cur
            if cur is not None:
                i = self._cur_idx
                keys, values, stamps = self._cur_lists
                if i < len(values):
                    self._cur_idx = i + 1
                    self.records_consumed += 1
                    return Record(keys[i], values[i], stamps[i], self.stream, cur.streamlet,
                                  cur.group, cur.first + i)
                self._finish_current()
            item = self._next_item(deadline)
            if item is None:
                return None
            if type(item) is ChunkItem:
                chunk, skip = item.chunk, item.skip
                self._cur = item
                self._cur_idx = 0
                self._cur_lists = (chunk.keys()[skip:], chunk.values()[skip:],
                                   chunk.timestamps[skip:].tolist())
            else:
                self._apply(item)

    def poll_batch(self, timeout_s: float | None = 0.0, max_chunks: int | None = None) -> list[Batch]:
        """Whole chunks as columnar Batches (at least one unless `timeout_s` passes first)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        limit = self.cache_chunks_max if max_chunks is None else max(1, max_chunks)
        out: list[Batch] = []
        cur = self._cur
        if cur is not None:
            i = self._cur_idx
            if i < len(self._cur_lists[1]):
                out.append(Batch(self.stream, cur.streamlet, cur.group, cur.first + i, cur.chunk,
                                 cur.skip + i))
                self.records_consumed += len(self._cur_lists[1]) - i
            self._finish_current()
        while len(out) < limit:
            item = self._next_item(None if out else deadline, block=not out)
            if item is None:
                break
            if type(item) is ChunkItem:
                out.append(Batch(self.stream, item.streamlet, item.group, item.first, item.chunk, item.skip))
                self._consumed[item.streamlet].consumed(item.group, item.end, item.epoch)
                self.records_consumed += item.count
            else:
                try:
                    self._apply(item)
                except KeraError:
                    if out:  # deliver what precedes the error; raise it on the next call
                        self._items.appendleft(item)
                        break
                    raise
        return out

    def __iter__(self):
        while not self._closed:
            try:
                record = self.poll(timeout_s=0.2)
            except ClientClosed:
                return
            if record is not None:
                yield record

    def positions(self) -> list[Position]:
        """Where to resume to read exactly what follows what was consumed: for each assigned
        streamlet, every group from its lowest unfinished one up."""
        cur = self._cur
        out: list[Position] = []
        for sl in self.streamlets:
            partial = None
            if cur is not None and cur.streamlet == sl:
                partial = (cur.group, cur.first + self._cur_idx)
                if cur.epoch is not None:
                    self._consumed[sl].epoch = cur.epoch   # its history, as consumed() does
            out += self._consumed[sl].positions(self.stream, partial)
        return out

    # ------------------------------------------------------------------ cache
    def _next_item(self, deadline: float | None, block: bool = True):
        with self._lock:
            while not self._items:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise ClientClosed("consumer is closed")
                if not block:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._ready.wait(left)
            item = self._items.popleft()
            if type(item) is ChunkItem:
                self._cached_chunks -= 1
                if self._fetcher_waiting:
                    self._fetcher_waiting = False
                    self._wake()
            return item

    def _push(self, items: list) -> None:
        """Called by the request thread."""
        with self._lock:
            self._items.extend(items)
            self._cached_chunks += sum(1 for it in items if type(it) is ChunkItem)
            self._ready.notify_all()

    def _apply(self, item) -> None:
        if type(item) is LowItem:
            self._consumed[item.streamlet].finished_below(item.low)
        elif type(item) is ResetItem:
            self._consumed[item.streamlet] = ConsumedCursor(item.streamlet, item.low,
                                                            item.offsets, item.epoch)
        elif type(item) is ErrorItem:
            self._error = item.error
            raise item.error

    def _finish_current(self) -> None:
        cur = self._cur
        self._consumed[cur.streamlet].consumed(cur.group, cur.end, cur.epoch)
        self._cur = None
        self._cur_lists = None
        self._cur_idx = 0

    def _wake(self) -> None:
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._stopping = True
            self._ready.notify_all()
        self._wake()
        self._fetcher.join(self.request_timeout_s + 5)
        self._meta.close()
        with self._lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stats(self) -> dict:
        with self._lock:
            return {"records_consumed": self.records_consumed, "cached_chunks": self._cached_chunks}


def _assigned(total: int, streamlets, member, members) -> list[int]:
    if streamlets is not None and (member is not None or members is not None):
        raise BadRequest("give either streamlets or member/members, not both")
    if streamlets is not None:
        chosen = sorted(set(int(s) for s in streamlets))
        bad = [s for s in chosen if not 0 <= s < total]
        if bad:
            raise BadRequest(f"stream has {total} streamlets; no streamlet {bad[0]}")
        return chosen
    if member is not None or members is not None:
        if member is None or members is None or members < 1 or not 0 <= member < members:
            raise BadRequest(f"member must be in [0, members): member={member}, members={members}")
        return [sl for sl in range(total) if sl % members == member]
    return list(range(total))
