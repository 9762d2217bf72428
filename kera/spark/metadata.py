"""Cluster metadata the connector needs, straight from the wire: stream descriptors from the
coordinator (`describe_stream`), a streamlet's groups from its broker (`offsets`) and its
cursor at a time (`offsets_for_time`), through one retry loop (`_owner_call`).

Every call has a timeout and every retry loop a deadline. A Metadata object owns sockets: it is
created where it is used (driver-side planning, executor-side read/write) and never pickled.
"""

from __future__ import annotations

import logging
import time

from kera.net import rpc
from kera.net.backoff import Backoff

from kera.codec import schema

from kera.codec import wire
from kera.client.coordinator_client import CoordinatorClient
from kera.client.stream_cache import StreamCache
from kera.errors import KeraError, NotReady, Timeout, UnknownStream
from kera.spark.offsets import (ISOLATION, Cursor, GroupInfo, Groups, cursor_from_time,
                                group_infos)

log = logging.getLogger(__name__)

# Waits between attempts of one call (kera.net.backoff): 50 ms doubling to 1 s.
RETRY_BACKOFF = Backoff(first_ms=50, max_ms=1000)


StreamInfo = schema.StreamInfo


def _pause(attempt: int) -> float:
    return RETRY_BACKOFF.delay_s(attempt + 1)


class Metadata:
    def __init__(self, bootstrap: str, timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
                 key_file: str | None = None):
        self.key_file = key_file   # None: $KERA_KEY_FILE, else plaintext
        if not bootstrap or not bootstrap.strip():
            raise ValueError("option 'bootstrap' must name the coordinator, e.g. 127.0.0.1:7000")
        self.timeout_s = timeout_s
        self._conns: dict[str, rpc.Connection] = {}   # brokers
        # The leading coordinator of the bootstrap list (kera.client.coordinator_client), and the
        # clients' one descriptor cache (kera.client.stream_cache): it parses and keeps what the
        # coordinator said; this class adds the retries and the wait for `serving`.
        self.coordinator = CoordinatorClient(bootstrap, timeout_s=timeout_s, key_file=key_file)
        self.cache = StreamCache(self.coordinator.coordinators, timeout_s)

    def conn(self, address: str) -> rpc.Connection:
        c = self._conns.get(address)
        if c is None:
            c = self._conns[address] = rpc.Connection(address, timeout_s=self.timeout_s,
                                                     key_file=self.key_file)
        return c

    def drop(self, address: str) -> None:
        """Forget a connection that timed out: late replies must not reach the next call."""
        c = self._conns.pop(address, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()
        self.coordinator.close()

    def describe(self, name: str) -> StreamInfo:
        """The stream's descriptor once every streamlet has a live owner that knows it."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        last: Exception | None = None
        while True:
            try:
                left = max(0.001, deadline - time.monotonic())
                reply, _ = self.coordinator.call("describe_stream", {"name": name}, timeout_s=left)
                info = self.cache.on_describe(name, reply, time.monotonic())
                if info.serving:
                    return info
                last = NotReady(f"stream {name!r} is not ready on its brokers yet")
            except UnknownStream:
                raise
            except KeraError as exc:
                if not exc.retriable:
                    raise
                last = exc
            attempt += 1
            if time.monotonic() + _pause(attempt) > deadline:
                raise Timeout(f"could not describe stream {name!r} within {self.timeout_s:.0f} s: {last}")
            time.sleep(_pause(attempt))

    def groups(self, info: StreamInfo, streamlet: int) -> tuple[StreamInfo, list[GroupInfo]]:
        """Groups of one streamlet from its owner, following the stream if it moved. Returns
        the (possibly refreshed) descriptor with them."""
        # Each group's end at its stable bound: a batch never ends inside an open transaction
        # (its fetches would wait for the transaction to end).
        info, reply = self._owner_call(info, streamlet, "offsets", {"isolation": ISOLATION})
        fields = wire.Fields(reply)
        infos = Groups(group_infos(fields.list("groups", max_len=1 << 20)))
        infos.first_group = fields.int("first_group", 0, hi=2**32 - 1)  # retention
        epoch = reply.get("epoch")   # the streamlet's history (kera.spark.offsets)
        infos.epoch = None if epoch is None else fields.int("epoch", 0, hi=2**64 - 1)
        return info, infos

    def cursor_at_time(self, info: StreamInfo, streamlet: int, timestamp_us: int) -> Cursor:
        """The cursor at the first record at or after `timestamp_us` in every group of a
        streamlet (its broker's `offsets_for_time`, kera/broker/time_index.py)."""
        _, reply = self._owner_call(info, streamlet, "offsets_for_time",
                                    {"timestamp_us": timestamp_us})
        try:
            c = schema.time_cursor(reply)
        except KeraError as exc:
            raise KeraError(f"malformed offsets_for_time reply for {info.name}/{streamlet}: "
                            f"{exc.message}") from None
        return cursor_from_time(c.low, c.offsets, c.epoch)

    def _owner_call(self, info: StreamInfo, streamlet: int, op: str,
                    extra: dict) -> tuple[StreamInfo, dict]:
        """(descriptor, reply) of `op` (fields sid, sl and `extra`) on the streamlet's owner,
        retried, following the stream if it moved, until the timeout."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            address = info.owner(streamlet)
            try:
                reply, _ = self.conn(address).call(op, {"sid": info.id, "sl": streamlet, **extra})
                return info, reply
            except KeraError as exc:
                if not exc.retriable:
                    raise
                if isinstance(exc, Timeout):
                    self.drop(address)
                attempt += 1
                if time.monotonic() + _pause(attempt) > deadline:
                    raise Timeout(f"no {op} reply for {info.name}/{streamlet} from {address} "
                                  f"within {self.timeout_s:.0f} s: {exc}") from exc
                log.info("%s of %s/%d from %s failed (%s); retrying", op, info.name, streamlet,
                         address, exc)
                time.sleep(_pause(attempt))
                info = self.describe(info.name)
