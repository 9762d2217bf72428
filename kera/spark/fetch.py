"""Executor side of a read: the records [start, end) of one group, as Arrow record batches.

One `fetch` request at a time carries a cursor for that group alone (`low` = the group, so the
broker serves it even if an earlier group of its slot is still open: the planner already
ordered the slot's groups across batches). GroupReader turns replies into rows (sans-IO);
GroupFetcher runs it on the clients' one request-thread shell (kera.client.request_thread: its
connections, poll and stream-descriptor refreshes, the producer's and consumer's too), reading
a few replies ahead so the broker works while Spark consumes. Rows come from whole chunks as
Arrow views: no Python call per record.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Iterator

import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from kera.codec import schema

from kera.codec import wire
from kera.codec.chunk import Chunk, frame_chunks, offsets_covered
from kera.errors import KeraError, OffsetOutOfRange, Timeout
from kera.spark.columns import chunk_rows, concat
from kera.client.metadata import Metadata
from kera.client.request_thread import RequestThread, Waker
from kera.spark.offsets import ISOLATION, DataLoss

log = logging.getLogger(__name__)

EMPTY_PAUSE_S = 0.002      # first pause when a fetch returns nothing yet; doubles up to
EMPTY_PAUSE_MAX_S = 0.1
# Row batches read ahead of Spark (each at most one fetch reply, fetch_max_bytes): the broker
# works while Spark consumes, in bounded memory.
READ_AHEAD_BATCHES = 4
IDLE_POLL_MS = 200


class GroupRange(InputPartition):
    """Records [start, end) of group `group` of one streamlet: one Spark task."""

    def __init__(self, bootstrap: str, stream: str, stream_id: int, streamlet: int, group: int,
                 start: int, end: int, address: str, fetch_max_bytes: int, timeout_s: float,
                 fail_on_data_loss: bool = True, key_file: str | None = None):
        self.bootstrap = bootstrap
        self.key_file = key_file
        self.stream = stream
        self.stream_id = stream_id
        self.streamlet = streamlet
        self.group = group
        self.start = start
        self.end = end
        self.address = address
        self.fetch_max_bytes = fetch_max_bytes
        self.timeout_s = timeout_s
        self.fail_on_data_loss = fail_on_data_loss

    def __len__(self) -> int:
        return self.end - self.start


class GroupReader:
    """Turns fetch replies for one group into rows; knows nothing of sockets."""

    def __init__(self, part: GroupRange):
        self.part = part
        self.position = part.start
        # Other groups the broker would serve alongside ours (one per slot), placed at their
        # durable end as last reported, so that a reply carries little besides our group.
        self.others: dict[int, int] = {}

    @property
    def done(self) -> bool:
        return self.position >= self.part.end

    def fetch_fields(self) -> dict:
        p = self.part
        cursor = {"low": p.group, "offsets": {**self.others, p.group: self.position}}
        # Spark's Kafka source reads committed data only (a transaction's records once it
        # commits, never aborted ones), as kera's consumer does by default.
        return {"reads": [[p.stream_id, p.streamlet, cursor, p.fetch_max_bytes]],
                "isolation": ISOLATION}

    def on_reply(self, header: dict, frames: list) -> pa.RecordBatch | None:
        """Rows of one fetch reply (None if it held none of ours); raises the read's error."""
        p = self.part
        results = wire.Fields(header).list("results", max_len=1)
        if len(results) != 1 or not isinstance(results[0], list) or len(results[0]) != 3:
            raise KeraError(f"malformed fetch reply from {p.address}")
        error, n_frames, groups = schema.fetch_result(results[0], len(frames))
        if error is not None:
            raise error
        self._check_group(groups)
        batches = []
        # A frame holds one or more chunks back to back.
        for c in (Chunk(view) for frame in frames[:n_frames] for view in frame_chunks(frame)):
            h = c.header
            if h.stream_id != p.stream_id or h.streamlet != p.streamlet or h.group != p.group:
                continue  # another group the broker served alongside ours
            base, n = h.base_offset, offsets_covered(h)   # a compacted chunk covers gaps too
            if base + n <= self.position:
                continue
            if base > self.position:
                lost = (f"{p.stream}/{p.streamlet} group {p.group}: records "
                        f"[{self.position}, {base}) missing from the broker's reply")
                if p.fail_on_data_loss:
                    raise DataLoss(lost)
                log.warning("skipping lost records: %s", lost)
                self.position = min(base, p.end)
                if self.done:
                    break
            hi = min(p.end, base + n)
            lo_i, hi_i = c.records_below(self.position - base), c.records_below(hi - base)
            if hi_i > lo_i:   # a compacted chunk may hold no record in the range
                batches.append(chunk_rows(c, lo_i, hi_i, p.stream, p.streamlet, p.group, base))
            self.position = hi
            if self.done:
                break
        return concat(batches) if batches else None

    def _check_group(self, groups) -> None:
        p = self.part
        if not isinstance(groups, list):
            return
        for entry in groups:
            if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], int)
                    and isinstance(entry[3], int) and entry[3] >= 0):
                continue
            g, durable_end = entry[0], entry[3]
            if g != p.group:
                self.others[g] = durable_end
            elif durable_end < self.position:
                raise DataLoss(f"{p.stream}/{p.streamlet} group {p.group} durable end "
                               f"{durable_end} is behind the read position {self.position}")


def read_group(part: GroupRange) -> Iterator[pa.RecordBatch]:
    """Yield the rows of `part`, following its streamlet to a new owner if it moves."""
    if part is None or not isinstance(part, GroupRange) or part.start >= part.end:
        return
    fetcher = GroupFetcher(part)
    fetcher.start()
    try:
        while True:
            rows = fetcher.take()
            if rows is None:
                return
            yield rows
    finally:
        fetcher.close()


class GroupFetcher(RequestThread):
    """The client request thread (kera.client.request_thread) reading one GroupRange ahead of Spark:
    one fetch in flight, at most READ_AHEAD_BATCHES row batches waiting for Spark."""

    def __init__(self, part: GroupRange):
        self.part = part
        self.reader = GroupReader(part)
        self.address = part.address
        meta = Metadata(part.bootstrap, timeout_s=part.timeout_s, key_file=part.key_file)
        super().__init__(f"kera-spark-read-{part.stream}-{part.streamlet}-{part.group}", meta,
                         Waker(), request_timeout_s=part.timeout_s, key_file=part.key_file,
                         idle_poll_ms=IDLE_POLL_MS)
        self.cond = threading.Condition()
        self.ready: collections.deque = collections.deque()   # row batches for Spark
        self.finished = False        # every row is in `ready` (or the rest was skipped)
        self.error: BaseException | None = None
        self._closing = False
        self.in_flight: tuple[int, float] | None = None       # (request id, deadline)
        self.next_fetch_at = 0.0
        self.pause_s = EMPTY_PAUSE_S
        self.progress_at = time.monotonic()

    # ------------------------------------------------------------------ Spark's side
    def take(self) -> pa.RecordBatch | None:
        """The next row batch; None once all are taken. Raises the read's error."""
        with self.cond:
            while not self.ready and not self.finished and self.error is None:
                if not self.cond.wait(self.part.timeout_s) and not self.is_alive():
                    raise KeraError("the Spark read thread stopped without a result")
            if self.ready:
                rows = self.ready.popleft()
                self.cond.notify_all()
            elif self.error is not None:
                raise self.error
            else:
                return None
        self.waker.wake()   # room for another batch
        return rows

    def close(self) -> None:
        with self.cond:
            self._closing = True
        self.waker.wake()
        self.join(self.part.timeout_s + 5)
        self.meta.close()
        self.waker.close()

    # ------------------------------------------------------------------ the request thread
    def stopping(self) -> bool:
        with self.cond:
            return self._closing or self.finished or self.error is not None

    def on_crash(self, exc: BaseException) -> None:
        self._finish(error=exc)

    def turn(self, now: float) -> float | None:
        if self.in_flight is not None:
            req_id, deadline = self.in_flight
            if now < deadline:
                return deadline
            self.in_flight = None
            self._retry(Timeout(f"no fetch reply from {self.address} within "
                                f"{self.part.timeout_s:.0f} s"), now)
        with self.cond:
            if len(self.ready) >= READ_AHEAD_BATCHES:
                return None   # Spark's take wakes us when it makes room
        if now < self.next_fetch_at:
            return self.next_fetch_at
        try:
            req_id = self.send(self.address, "fetch", self.reader.fetch_fields())
        except KeraError as exc:
            self._retry(exc, now)
            return self.next_fetch_at
        self.in_flight = (req_id, now + self.part.timeout_s)
        return self.in_flight[1]

    def on_replies(self, replies: list) -> None:
        for address, header, frames in replies:
            if self.in_flight is None or address != self.address or header.get("id") != self.in_flight[0]:
                continue   # a late reply to a request that timed out
            self.in_flight = None
            self._on_reply(header, frames, time.monotonic())

    def _on_reply(self, header: dict, frames: list, now: float) -> None:
        p = self.part
        try:
            wire.raise_for_reply(header)
            rows = self.reader.on_reply(header, frames)
        except (DataLoss, OffsetOutOfRange) as exc:   # the latter: deleted by retention
            if p.fail_on_data_loss:
                raise
            log.warning("skipping the rest of %s/%d group %d: %s", p.stream, p.streamlet, p.group, exc)
            self._finish()
            return
        except KeraError as exc:
            if not exc.retriable:
                raise
            self._retry(exc, now)
            return
        if rows is None:
            # The planner saw these records durable, so they come; wait a little.
            self._no_progress_check(now, f"no records past {self.reader.position} (expected up "
                                         f"to {p.end})")
            self._pause(now)
            return
        self.pause_s = EMPTY_PAUSE_S
        self.progress_at = now
        self.next_fetch_at = now
        with self.cond:
            self.ready.append(rows)
            self.cond.notify_all()
        if self.reader.done:
            self._finish()

    def _retry(self, exc: KeraError, now: float) -> None:
        """A retriable failure: ask where the streamlet lives now and fetch again after a pause."""
        p = self.part
        self._no_progress_check(now, f"reading made no progress: {exc}")
        log.info("fetch of %s/%d group %d from %s failed (%s); refreshing the owner", p.stream,
                 p.streamlet, p.group, self.address, exc)
        self.want_describe([p.stream])
        self._pause(now)

    def on_stream(self, name: str, result) -> None:
        if isinstance(result, KeraError):
            if not result.retriable:
                self._finish(error=result)
            return
        address = result.address_of(self.part.streamlet)
        if result.id != self.part.stream_id:
            self._finish(error=DataLoss(f"stream {name!r} was deleted (or recreated) while read"))
        elif address is not None:
            self.address = address

    def _pause(self, now: float) -> None:
        self.next_fetch_at = now + self.pause_s
        self.pause_s = min(EMPTY_PAUSE_MAX_S, self.pause_s * 2)

    def _no_progress_check(self, now: float, what: str) -> None:
        p = self.part
        if now - self.progress_at > p.timeout_s:
            raise Timeout(f"{p.stream}/{p.streamlet} group {p.group}: {what} within "
                          f"{p.timeout_s:.0f} s")

    def _finish(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.finished = True
            self.error = self.error or error
            self.cond.notify_all()
