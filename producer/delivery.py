"""Delivery results: the future `Producer.send` returns and the metadata it resolves to.

Futures are settled on the producer's request (IO) thread, outside the producer's lock, so a
callback may call `send` again; a callback should be quick, as it delays the thread's next
request. One module-wide condition serves every future: a future is only a few slots, which
keeps `send` near its microsecond cost instead of paying for a lock per record.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple

from kera.errors import KeraError, Timeout

log = logging.getLogger(__name__)
_settled = threading.Condition()


class RecordMetadata(NamedTuple):
    """Where a record (or a send_batch chunk: `count` records from `offset` on) was stored, as
    a consumer sees it. `group`/`offset` are None for a chunk proven stored without its reply
    (a later chunk of its lane was acknowledged first), or stored by a first attempt whose
    retry the broker answered without looking its position up (a retry older than the broker's
    `duplicate_scan_chunks_max` chunks of its slot)."""
    stream: str
    streamlet: int
    group: int | None
    offset: int | None
    count: int = 1
    # The record number of the (first) record, dense in its slot of the streamlet; None when
    # unknown (as `offset`, or a broker that did not say).
    number: int | None = None


class DeliveryFuture:
    """Resolves to a RecordMetadata or a KeraError; `result(timeout)` / `exception(timeout)` /
    `done()` / `add_done_callback(fn)` as concurrent.futures.Future."""

    __slots__ = ("_metadata", "_error", "_done", "_callbacks")

    def __init__(self):
        self._metadata: RecordMetadata | None = None
        self._error: KeraError | None = None
        self._done = False
        self._callbacks: list | None = None

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> RecordMetadata:
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._metadata

    def exception(self, timeout: float | None = None) -> KeraError | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with _settled:
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise Timeout(f"record not acknowledged within {timeout:.1f} s: call "
                                  f"flush() to push it out, or wait longer")
                _settled.wait(left)
        return self._error

    def add_done_callback(self, fn: Callable[["DeliveryFuture"], None]) -> None:
        """`fn(future)` once settled: on the producer's IO thread, or now if already done."""
        with _settled:
            if not self._done:
                self._callbacks = (self._callbacks or []) + [fn]
                return
        fn(self)

    def _set(self, metadata: RecordMetadata | None, error: KeraError | None) -> list:
        """Under _settled: record the outcome; returns the callbacks to run outside it."""
        self._metadata, self._error, self._done = metadata, error, True
        callbacks, self._callbacks = self._callbacks or [], None
        return callbacks


def on_delivery_callback(on_delivery: Callable) -> Callable[[DeliveryFuture], None]:
    """Adapt confluent-kafka's `on_delivery(err, metadata)` to a done-callback."""
    return lambda f: on_delivery(f._error, f._metadata)


def settle(outcomes: list) -> None:
    """Settle (futures, stream, streamlet, result, error) outcomes from the pipeline:
    `futures` is a list of (index in chunk or -1 for the whole chunk, count, future);
    `result` the broker's (group, segment, base_offset[, number]) or None."""
    calls = []
    with _settled:
        for futures, stream, streamlet, result, error in outcomes:
            for index, count, fut in futures:
                md = None
                if error is None:
                    group = None if result is None else result[0]
                    offset = None if result is None else result[2] + max(index, 0)
                    number = None if result is None or len(result) < 4 else result[3] + max(index, 0)
                    md = RecordMetadata(stream, streamlet, group, offset, count, number)
                calls += [(cb, fut) for cb in fut._set(md, error)]
        _settled.notify_all()
    for cb, fut in calls:
        try:
            cb(fut)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the IO thread
            log.exception("delivery callback %r raised", cb)
