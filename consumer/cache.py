"""The consumer's cache: what the request thread fetched, handed to the caller record by record
or chunk by chunk, and the exact positions of what was handed out.

The request thread `push`es items (kera.consumer.cursor: ChunkItem, LowItem, ResetItem,
ErrorItem) in fetch order; the caller's `poll` / `poll_batch` take them in that order, so each
part's ConsumedCursor advances only over what the caller was given: `positions()` is what was
consumed, never what was merely fetched. The cache holds at most `chunks_max` chunks: the
request thread asks `room()` before fetching, and is woken (`wake`) when the caller makes room.

Thread use: `push` and `room` from the request thread; everything else from the caller's
threads. All state is under `lock`; a caller that also needs the consumer's state lock
(kera.consumer.reading) takes that one first.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from kera.codec.position import Position, Record
from kera.consumer.batch import Batch
from kera.consumer.cursor import ChunkItem, ConsumedCursor, ErrorItem, LowItem, ResetItem
from kera.errors import ClientClosed, KeraError


class Cache:
    def __init__(self, chunks_max: int, wake: Callable[[], None]):
        self.chunks_max = chunks_max
        self._wake = wake                  # wakes the request thread (room was made)
        self.lock = threading.Lock()
        self._ready = threading.Condition(self.lock)
        self._items: collections.deque = collections.deque()
        self.cached_chunks = 0
        self._fetcher_waiting = False
        self.closed = False
        self._error: KeraError | None = None
        # Each assigned part's cursor of what was handed out.
        self.consumed: dict[tuple, ConsumedCursor] = {}
        # The item being walked record by record: the ChunkItem, its columns as lists (keys,
        # values, timestamps, headers, offsets, numbers: `_walk`) and the next record's index.
        self._cur: ChunkItem | None = None
        self._cur_lists = None
        self._cur_idx = 0
        self.records_consumed = 0
        # Called (under `lock`) as each chunk is handed out: the group notes who it is then.
        self.on_chunk: Callable[[], None] | None = None

    # ------------------------------------------------------------------ the caller's side
    def poll(self, deadline: float | None) -> Record | None:
        """The next record, waiting until `deadline` (monotonic; None: forever)."""
        with self.lock:
            while True:
                cur = self._cur
                if cur is not None:
                    i = self._cur_idx
                    keys, values, stamps, headers, offsets, numbers = self._cur_lists
                    if i < len(values):
                        self._cur_idx = i + 1
                        self.records_consumed += 1
                        if offsets is None:   # an ordinary chunk: dense, `numbers` the first
                            off, num = cur.first + i, None if numbers is None else numbers + i
                        else:                 # a compacted one: at its offset deltas
                            off, num = offsets[i], None if numbers is None else numbers[i]
                        return Record(keys[i], values[i], stamps[i], cur.stream, cur.streamlet,
                                      cur.group, off,
                                      tuple(headers[i]) if headers is not None else (), num)
                    self._finish_current()
                item = self._next_item(deadline)
                if item is None:
                    return None
                if type(item) is ChunkItem:
                    self._walk(item)
                    self._note_chunk()
                else:
                    self._apply(item)

    def _walk(self, item: ChunkItem) -> None:
        """Make `item` the chunk `poll` hands out record by record: its columns as lists, and
        its offsets and numbers as lists for a compacted chunk only (an ordinary one's are
        `first + i`: indexing a range per record cost more than the addition)."""
        chunk, skip = item.chunk, item.skip
        if item.sparse:
            offsets, numbers = item.offsets(), item.numbers()
        else:
            first = chunk.first_number
            offsets, numbers = None, None if first is None else first + skip
        self._cur = item
        self._cur_idx = 0
        self._cur_lists = (chunk.keys()[skip:], chunk.values()[skip:],
                           chunk.timestamps[skip:].tolist(),
                           chunk.headers()[skip:] if chunk.has_headers else None,
                           offsets, numbers)

    def poll_batch(self, deadline: float | None, limit: int) -> list[Batch]:
        """Up to `limit` whole chunks as Batches, waiting until `deadline` for the first."""
        with self.lock:
            out = self._rest_of_current()
            while len(out) < limit:
                item = self._next_item(None if out else deadline, block=not out)
                if item is None:
                    break
                if type(item) is ChunkItem:
                    self._note_chunk()
                    if item.count:   # a compacted chunk may hold no record left to deliver
                        out.append(Batch(item.stream, item.streamlet, item.group, item.first,
                                         item.chunk, item.skip))
                    self.consumed[item.part].consumed(item.group, item.end, item.epoch)
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

    def _rest_of_current(self) -> list[Batch]:
        """What `poll` has not handed out of the chunk it walks, as a Batch (with lock held)."""
        cur, out = self._cur, []
        if cur is not None:
            i = self._cur_idx
            if i < len(self._cur_lists[1]):
                out.append(Batch(cur.stream, cur.streamlet, cur.group, cur.offset_at(i),
                                 cur.chunk, cur.skip + i))
                self.records_consumed += len(self._cur_lists[1]) - i
            self._finish_current()
        return out

    def positions(self, parts=None) -> list[Position]:
        """Exact positions of what was handed out of `parts` (default: every assigned part)."""
        with self.lock:
            return self.positions_locked(sorted(self.consumed) if parts is None else parts)

    def positions_locked(self, parts) -> list[Position]:
        """positions(), with `lock` held."""
        cur = self._cur
        out: list[Position] = []
        for part in parts:
            partial = None
            if cur is not None and cur.part == part:
                partial = (cur.group, cur.offset_at(self._cur_idx))
                if cur.epoch is not None:
                    self.consumed[part].epoch = cur.epoch   # its history, as consumed() does
            out += self.consumed[part].positions(part[0], partial)
        return out

    def consumed_at(self) -> dict[tuple, tuple[int, dict[int, int]]]:
        """{part: (low, offsets)} handed out of every assigned part, the walked chunk included."""
        with self.lock:
            return {part: self._consumed_at(part) for part in self.consumed}

    def _consumed_at(self, part: tuple) -> tuple[int, dict[int, int]]:
        cc = self.consumed[part]
        offsets = dict(cc.offsets)
        cur = self._cur
        if cur is not None and cur.part == part and cur.group >= cc.low:
            offsets[cur.group] = cur.offset_at(self._cur_idx)
        return cc.low, offsets

    def parts(self) -> list[tuple[str, int]]:
        """The assigned parts, sorted."""
        with self.lock:
            return sorted(self.consumed)

    def missing(self, parts) -> list[tuple]:
        """Those of `parts` that are not assigned, sorted."""
        with self.lock:
            return sorted(p for p in parts if p not in self.consumed)

    # ------------------------------------------------------------------ assignment changes
    def restart(self, part: tuple, cursor: ConsumedCursor) -> None:
        """Hand `part` out from `cursor` on; what was fetched of it is dropped (lock held)."""
        self.consumed[part] = cursor
        self._purge(part)

    def remove(self, parts) -> list[Position]:
        """Stop handing out `parts` (lock held); returns the positions of those assigned."""
        gone = [p for p in parts if p in self.consumed]
        out = self.positions_locked(gone)
        for part in gone:
            self._purge(part)
            del self.consumed[part]
        return out

    # ------------------------------------------------------------------ the request thread's side
    def push(self, items: list) -> None:
        """Queue fetched items (the request thread)."""
        with self.lock:
            self._items.extend(items)
            self.cached_chunks += sum(1 for it in items if type(it) is ChunkItem)
            self._ready.notify_all()

    def room(self) -> int:
        """Chunks the cache can take now; at none, the next hand-out wakes the request thread."""
        with self.lock:
            room = self.chunks_max - self.cached_chunks
            self._fetcher_waiting = room <= 0
        return room

    def close(self) -> None:
        """Wake every waiting poll: it raises ClientClosed once the cache is empty."""
        with self.lock:
            self.closed = True
            self._ready.notify_all()

    def stats(self) -> dict:
        with self.lock:
            return {"records_consumed": self.records_consumed,
                    "cached_chunks": self.cached_chunks}

    # ------------------------------------------------------------------ internals (lock held)
    def _next_item(self, deadline: float | None, block: bool = True):
        """The next cache item (waiting releases the lock)."""
        while not self._items:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise ClientClosed("consumer is closed")
            if not block:
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._ready.wait(left)
        item = self._items.popleft()
        if type(item) is ChunkItem:
            self.cached_chunks -= 1
            self._wake_fetcher_for_room()
        return item

    def _note_chunk(self) -> None:
        if self.on_chunk is not None:
            self.on_chunk()

    def _wake_fetcher_for_room(self) -> None:
        if self._fetcher_waiting:
            self._fetcher_waiting = False
            self._wake()

    def _purge(self, part: tuple) -> None:
        """Drop what was fetched of `part` and not handed out."""
        kept = collections.deque(it for it in self._items
                                 if type(it) is ErrorItem or it.part != part)
        self.cached_chunks -= sum(1 for it in self._items
                                  if type(it) is ChunkItem and it.part == part)
        self._items = kept
        if self._cur is not None and self._cur.part == part:
            self._cur, self._cur_lists, self._cur_idx = None, None, 0
        self._wake_fetcher_for_room()

    def _apply(self, item) -> None:
        if type(item) is LowItem:
            self.consumed[item.part].finished_below(item.low)
        elif type(item) is ResetItem:
            self.consumed[item.part] = ConsumedCursor(item.part[1], item.low, item.offsets,
                                                      item.epoch)
        elif type(item) is ErrorItem:
            self._error = item.error
            raise item.error

    def _finish_current(self) -> None:
        cur = self._cur
        self.consumed[cur.part].consumed(cur.group, cur.end, cur.epoch)
        self._cur = None
        self._cur_lists = None
        self._cur_idx = 0
