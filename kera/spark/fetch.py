"""Executor side of a read: the records [start, end) of one group, as Arrow record batches.

One `fetch` request at a time carries a cursor for that group alone (`low` = the group, so the
broker serves it even if an earlier group of its slot is still open: the planner already
ordered the slot's groups across batches). The next request goes out before the rows of the
previous reply are handed to Spark, so the broker works while Spark consumes. Rows come from
whole chunks as Arrow views: no Python call per record.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from kera import schema, wire
from kera.chunk import Chunk
from kera.errors import KeraError, OffsetOutOfRange, Timeout
from kera.spark.columns import chunk_rows, concat
from kera.spark.metadata import Metadata
from kera.spark.offsets import DataLoss

log = logging.getLogger(__name__)

EMPTY_PAUSE_S = 0.002      # first pause when a fetch returns nothing yet; doubles up to
EMPTY_PAUSE_MAX_S = 0.1


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
        return {"reads": [[p.stream_id, p.streamlet, cursor, p.fetch_max_bytes]]}

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
        for frame in frames[:n_frames]:
            c = Chunk(frame.buffer if hasattr(frame, "buffer") else frame)
            h = c.header
            if h.stream_id != p.stream_id or h.streamlet != p.streamlet or h.group != p.group:
                continue  # another group the broker served alongside ours
            base, n = h.base_offset, h.record_count
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
            batches.append(chunk_rows(c, self.position - base, hi - base, p.stream, p.streamlet,
                                      p.group, base))
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
    reader = GroupReader(part)
    meta = Metadata(part.bootstrap, part.timeout_s, part.key_file)
    address = part.address
    try:
        pause = EMPTY_PAUSE_S
        progress_at = time.monotonic()
        conn = meta.conn(address)
        req = conn.send("fetch", reader.fetch_fields())
        while True:
            try:
                header, frames = _reply(conn, req, part.timeout_s)
                wire.raise_for_reply(header)
                rows = reader.on_reply(header, frames)
            except (DataLoss, OffsetOutOfRange) as exc:   # the latter: deleted by retention
                if part.fail_on_data_loss:
                    raise

                log.warning("skipping the rest of %s/%d group %d: %s", part.stream,
                            part.streamlet, part.group, exc)
                return
            except KeraError as exc:
                if not exc.retriable:
                    raise
                if time.monotonic() - progress_at > part.timeout_s:
                    raise Timeout(f"reading {part.stream}/{part.streamlet} group {part.group} "
                                  f"made no progress for {part.timeout_s:.0f} s: {exc}") from exc
                log.info("fetch from %s failed (%s); refreshing the owner", address, exc)
                meta.drop(address)
                time.sleep(pause)
                pause = min(EMPTY_PAUSE_MAX_S, pause * 2)
                address = meta.describe(part.stream).owner(part.streamlet)
                conn = meta.conn(address)
                req = conn.send("fetch", reader.fetch_fields())
                continue
            if reader.done:
                if rows is not None:
                    yield rows
                return
            if rows is None:
                # The planner saw these records durable, so they come; wait a little.
                if time.monotonic() - progress_at > part.timeout_s:
                    raise Timeout(f"{part.stream}/{part.streamlet} group {part.group}: no records "
                                  f"past {reader.position} (expected up to {part.end}) within "
                                  f"{part.timeout_s:.0f} s")
                time.sleep(pause)
                pause = min(EMPTY_PAUSE_MAX_S, pause * 2)
                req = conn.send("fetch", reader.fetch_fields())
                continue
            pause = EMPTY_PAUSE_S
            progress_at = time.monotonic()
            req = conn.send("fetch", reader.fetch_fields())  # in flight while Spark takes the rows
            yield rows
    finally:
        meta.close()


def _reply(conn, req_id: int, timeout_s: float) -> tuple[dict, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no fetch reply from {conn.address} within {timeout_s:.0f} s")
        header, frames = conn.recv(left)
        if header.get("id") == req_id:
            return header, frames
