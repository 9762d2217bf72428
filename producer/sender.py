"""The producer's request thread: seals lingering chunks, sends produce requests, applies replies.

The shell (connections, poll, wake-up pipe, stream refreshes) is kera.client.request_thread's, shared
with the consumer; all bookkeeping is the Pipeline's. This module only says what one turn does
and takes the producer's lock around each Pipeline call.
"""

from __future__ import annotations

import logging

from kera.errors import KeraError, Timeout, UnknownStream
from kera.producer import delivery
from kera.client.request_thread import RequestThread
from kera.codec.schema import StreamInfo

log = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # nothing to wait for: wake up now and then anyway


class Sender(RequestThread):
    def __init__(self, producer):
        super().__init__(f"kera-producer-{producer.producer_id:016x}", producer._meta,
                         producer._waker, request_timeout_s=producer.request_timeout_s,
                         key_file=producer.key_file, idle_poll_ms=IDLE_POLL_MS,
                         env=producer._env)
        self.p = producer
        self.refreshing: dict[str, int] = {}   # stream name -> the id its chunks were built for

    def stopping(self) -> bool:
        with self.p._lock:
            return self.p._stopping

    def on_crash(self, exc: BaseException) -> None:
        with self.p._lock:
            self.p._fatal = exc
            self.p._cond.notify_all()

    def on_exit(self) -> None:
        p = self.p
        with p._lock:  # outcomes of the last loop turn: settle them before exiting
            settled, p._pipe.settled = p._pipe.settled, []
        delivery.settle(settled)

    def turn(self, now: float) -> float | None:
        p, pipe, acc = self.p, self.p._pipe, self.p._acc
        with p._lock:
            p._idle = False
            acc.seal_lingering(now)
            before = len(pipe.incomplete)
            refresh = pipe.expire(now) | pipe.probe_stalled(now, p._meta.address_of)
            out = pipe.build(now, p._meta.address_of)
            refresh |= pipe.want_refresh
            pipe.want_refresh = set()
            if len(pipe.incomplete) != before:
                p._cond.notify_all()
            wake_at = [t for t in (pipe.next_deadline(now), acc.next_linger_deadline()) if t is not None]
            p._idle = True
            settled, pipe.settled = pipe.settled, []
        if settled:
            delivery.settle(settled)
        self._refresh(refresh)
        if out:
            self._send(out)
        return min(wake_at) if wake_at else None

    def _send(self, out: list) -> None:
        p, pipe = self.p, self.p._pipe
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
        with p._lock:
            for o, req_id in sent:
                pipe.sent(o, req_id, now)
            for o in failed:
                refresh |= pipe.on_request_failed(o, Timeout(f"broker {o.broker} is not reachable"), now)
            if failed:
                p._cond.notify_all()
        self._refresh(refresh)

    def on_replies(self, replies: list) -> None:
        p, pipe = self.p, self.p._pipe
        now = self.clock()
        refresh = set()
        with p._lock:
            for address, header, _ in replies:
                refresh |= pipe.on_reply(address, header, now)
            p._cond.notify_all()
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
            self.p._grow(result)
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
        with self.p._lock:
            self.p._stream_gone(name, stream_id, gone)
