"""The consumer's request thread: fetches from every broker into the consumer's bounded cache,
and drives the consumer's extra tasks (kera.consumer.tasks: group membership).

It shares one state object with the consumer (kera.consumer.reading.Reading) and reads
nothing else of it. The shell (one connection per address whatever the number of streams,
poll, wake-up pipe, stream refreshes) is kera.client.request_thread's, shared with the
producer. A turn keeps one fetch in flight per broker carrying every part read there, and stops
fetching while the cache holds `cache_chunks_max` chunks (the caller wakes it through the pipe
when it makes room). The bookkeeping is FetchState's and TaskRunner's; both are used under the
state lock, which seek/assign also take.
"""

from __future__ import annotations

import logging
from typing import Callable

from kera.consumer.cursor import ErrorItem
from kera.errors import KeraError, Timeout, UnknownStream
from kera.client.request_thread import RequestThread
from kera.codec.schema import StreamInfo
from kera.consumer.reading import Reading

log = logging.getLogger(__name__)

IDLE_POLL_MS = 200


class Fetcher(RequestThread):
    """The request thread of a consumer's `reading` (kera.consumer.reading: its fetch state,
    tasks and cache); `on_grow(info)`: a refreshed descriptor of a stream read, under the state
    lock (new streamlets)."""

    def __init__(self, name: str, reading: Reading, meta, waker, *, request_timeout_s: float,
                 key_file: str | None, env, on_grow: Callable[[StreamInfo], None]):
        super().__init__(f"kera-consumer-{name}", meta, waker,
                         request_timeout_s=request_timeout_s, key_file=key_file,
                         idle_poll_ms=IDLE_POLL_MS, env=env)
        self.r = reading
        self.on_grow = on_grow

    def stopping(self) -> bool:
        return self.r.stopping()

    def on_crash(self, exc: BaseException) -> None:
        self.r.cache.push([ErrorItem(KeraError(f"consumer request thread died: {exc!r}"))])

    def turn(self, now: float) -> float | None:
        r = self.r
        with r.lock:
            self._send_fetches()
            self._send_tasks()
            streams, r.fetch.want_refresh = r.fetch.want_refresh, set()
            now = self.clock()
            wake = min((t for t in (r.fetch.next_wake(now), r.tasks.next_wake(now))
                        if t is not None), default=None)
        if streams:
            self.want_describe(streams)
        return wake

    def _send_fetches(self) -> None:
        state = self.r.fetch
        now = self.clock()
        state.expire(now)
        state.probe_stalled(now, self.meta.address_of)
        room = self.r.cache.room()
        requests = state.build(now, self.meta.address_of) if room > 0 else []
        for broker, reads, parts in requests:
            wait_ms = state.wait_ms(parts)
            fields = {"reads": reads, "isolation": self.r.isolation_level}
            if wait_ms:
                fields["wait_ms"] = wait_ms
            try:
                req_id = self.send(broker, "fetch", fields)
            except Timeout:
                state.send_failed(broker, parts, self.clock())
            else:
                state.sent(broker, req_id, parts, self.clock(), wait_ms)

    def _send_tasks(self) -> None:
        runner = self.r.tasks
        runner.expire(self.clock())
        for task, address, op, fields in runner.requests(self.clock()):
            try:
                req_id = self.send(address, op, fields)
            except KeraError as err:   # Timeout, or an address zmq cannot use
                runner.send_failed(task, err, self.clock())
            else:
                runner.sent(task, address, req_id, self.clock())

    def on_replies(self, replies: list) -> None:
        r = self.r
        for address, header, frames in replies:
            # Under the state lock until pushed: a seek cannot slip between a reply's
            # bookkeeping and its items reaching the cache.
            with r.lock:
                now = self.clock()
                if r.tasks.on_reply(address, header, frames, now):
                    continue
                items = r.fetch.on_reply(address, header, frames, now)
                if items:
                    r.cache.push(items)

    def on_stream(self, name: str, result: StreamInfo | KeraError) -> None:
        r, state = self.r, self.r.fetch
        if isinstance(result, KeraError) and not isinstance(result, UnknownStream):
            log.info("metadata refresh of '%s' failed: %s", name, result)
            return   # coordinator unreachable: the reads keep retrying
        with r.lock:
            known = state.stream_ids.get(name)
            if known is None or (isinstance(result, StreamInfo) and result.id == known):
                if known is not None:
                    self.on_grow(result)
                return
            state.fatal = True
        r.cache.push([ErrorItem(UnknownStream(f"stream '{name}' (id {known}) no longer exists"))])
