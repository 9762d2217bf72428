"""The producer's request thread: seals lingering chunks, sends produce requests, applies replies.

The shell (connections, poll, wake-up pipe, stream refreshes) is kera.client.request_thread's, shared
with the consumer; all bookkeeping is the Pipeline's. This module only says what one turn does
and takes the producer's lock around each Pipeline call.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from kera.client.request_thread import RequestThread
from kera.codec.schema import StreamInfo
from kera.errors import KeraError, Timeout, UnknownStream
from kera.producer import delivery
from kera.producer.accumulator import Accumulator
from kera.producer.pipeline import Pipeline

log = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # nothing to wait for: wake up now and then anyway


@dataclass(eq=False, slots=True)
class Shared:
    """What a producer and its request thread share: every field is read and written under
    `lock`; `cond` (on it) wakes the producer's waits (flush, a full buffer) as requests end."""
    lock: threading.Lock
    cond: threading.Condition
    pipe: Pipeline
    acc: Accumulator
    idle: bool = False       # the thread sleeps in its poll: new work must wake it
    stopping: bool = False   # close() asked the thread to finish
    fatal: BaseException | None = None   # why the thread died, if it did


@dataclass(frozen=True)
class StreamHooks:
    """The producer's side of a metadata refresh, called by the request thread."""
    grow: Callable[[StreamInfo], None]                # a stream's new descriptor
    gone: Callable[[str, int, KeraError], None]       # its chunks' stream was deleted (locked)


class Sender(RequestThread):
    def __init__(self, name: str, shared: Shared, meta, waker, hooks: StreamHooks, *,
                 request_timeout_s: float, key_file: str | None, env):
        """`meta`: the producer's kera.client.metadata.Metadata; `waker`: its wake-up pipe."""
        super().__init__(name, meta, waker, request_timeout_s=request_timeout_s,
                         key_file=key_file, idle_poll_ms=IDLE_POLL_MS, env=env)
        self.shared = shared
        self.hooks = hooks
        self.refreshing: dict[str, int] = {}   # stream name -> the id its chunks were built for

    def stopping(self) -> bool:
        with self.shared.lock:
            return self.shared.stopping

    def on_crash(self, exc: BaseException) -> None:
        with self.shared.lock:
            self.shared.fatal = exc
            self.shared.cond.notify_all()

    def on_exit(self) -> None:
        s = self.shared
        with s.lock:  # outcomes of the last loop turn: settle them before exiting
            settled, s.pipe.settled = s.pipe.settled, []
        delivery.settle(settled)

    def turn(self, now: float) -> float | None:
        s = self.shared
        pipe, acc = s.pipe, s.acc
        with s.lock:
            s.idle = False
            acc.seal_lingering(now)
            before = len(pipe.incomplete)
            refresh = pipe.expire(now) | pipe.probe_stalled(now, self.meta.address_of)
            out = pipe.build(now, self.meta.address_of)
            refresh |= pipe.want_refresh
            pipe.want_refresh = set()
            if len(pipe.incomplete) != before:
                s.cond.notify_all()
            wake_at = [t for t in (pipe.next_deadline(now), acc.next_linger_deadline()) if t is not None]
            s.idle = True
            settled, pipe.settled = pipe.settled, []
        if settled:
            delivery.settle(settled)
        self._refresh(refresh)
        if out:
            self._send(out)
        return min(wake_at) if wake_at else None

    def _send(self, out: list) -> None:
        s = self.shared
        pipe = s.pipe
        sent, failed = [], []
        for o in out:
            try:
                req_id = self.send(o.broker, "produce", None, o.frames)
            except Timeout:
                failed.append(o)
            else:
                sent.append((o, req_id))
        now = self.clock()
        refresh = set()
        with s.lock:
            for o, req_id in sent:
                pipe.sent(o, req_id, now)
            for o in failed:
                refresh |= pipe.on_request_failed(o, Timeout(f"broker {o.broker} is not reachable"), now)
            if failed:
                s.cond.notify_all()
        self._refresh(refresh)

    def on_replies(self, replies: list) -> None:
        s = self.shared
        pipe = s.pipe
        now = self.clock()
        refresh = set()
        with s.lock:
            for address, header, _ in replies:
                refresh |= pipe.on_reply(address, header, now)
            s.cond.notify_all()
            settled, pipe.settled = pipe.settled, []
        delivery.settle(settled)  # outside the lock: callbacks may send
        self._refresh(refresh)

    def _refresh(self, streams: set) -> None:
        """Ask the coordinator again about streams whose chunks were refused or timed out."""
        if not streams:
            return
        for name, stream_id in streams:
            self.refreshing[name] = stream_id
        self.want_describe(name for name, _ in streams)

    def on_stream(self, name: str, result: StreamInfo | KeraError) -> None:
        if isinstance(result, StreamInfo):
            self.hooks.grow(result)
        stream_id = self.refreshing.get(name)
        if stream_id is None:
            return
        if isinstance(result, UnknownStream):
            gone = UnknownStream(f"stream '{name}' no longer exists")
        elif isinstance(result, KeraError):  # coordinator trouble: the chunks wait and retry
            log.info("metadata refresh of '%s' failed: %s", name, result)
            if not result.retriable:
                del self.refreshing[name]
            return
        elif result.id == stream_id:
            del self.refreshing[name]
            return   # the new placement is in the cache: the next turn builds with it
        else:
            gone = UnknownStream(f"stream '{name}' (id {stream_id}) was deleted")
        del self.refreshing[name]
        with self.shared.lock:
            self.hooks.gone(name, stream_id, gone)
