"""The consumer's request thread: fetches from every broker into the consumer's bounded cache,
and drives the consumer's extra tasks (kera.consumer.tasks: group membership).

The shell (one connection per address whatever the number of streams, poll, wake-up pipe,
stream refreshes) is kera.client.request_thread's, shared with the producer. A turn keeps one fetch in
flight per broker carrying every part read there, and stops fetching while the cache holds
`cache_chunks_max` chunks (the caller wakes it through the pipe when it makes room). The
bookkeeping is FetchState's and TaskRunner's; both are used under the consumer's state lock,
which seek/assign also take.
"""

from __future__ import annotations

import logging

from kera.consumer.cursor import ErrorItem
from kera.errors import KeraError, Timeout, UnknownStream
from kera.client.request_thread import RequestThread
from kera.codec.schema import StreamInfo

log = logging.getLogger(__name__)

IDLE_POLL_MS = 200


class Fetcher(RequestThread):
    def __init__(self, consumer):
        super().__init__(f"kera-consumer-{consumer.stream or 'streams'}", consumer._meta,
                         consumer._waker, request_timeout_s=consumer.request_timeout_s,
                         key_file=consumer.key_file, idle_poll_ms=IDLE_POLL_MS,
                         env=consumer._env)
        self.c = consumer

    def stopping(self) -> bool:
        return self.c._stopping or self.c._fetch.fatal

    def on_crash(self, exc: BaseException) -> None:
        self.c._push([ErrorItem(KeraError(f"consumer request thread died: {exc!r}"))])

    def turn(self, now: float) -> float | None:
        c = self.c
        with c._state_lock:
            self._send_fetches()
            self._send_tasks()
            streams, c._fetch.want_refresh = c._fetch.want_refresh, set()
            now = self.clock()
            wake = min((t for t in (c._fetch.next_wake(now), c._tasks.next_wake(now))
                        if t is not None), default=None)
        if streams:
            self.want_describe(streams)
        return wake

    def _send_fetches(self) -> None:
        c, state = self.c, self.c._fetch
        now = self.clock()
        state.expire(now)
        state.probe_stalled(now, c._meta.address_of)
        with c._lock:
            room = c.cache_chunks_max - c._cached_chunks
            c._fetcher_waiting = room <= 0
        requests = state.build(now, c._meta.address_of) if room > 0 else []
        for broker, reads, parts in requests:
            wait_ms = state.wait_ms(parts)
            fields = {"reads": reads, "isolation": c.isolation_level}
            if wait_ms:
                fields["wait_ms"] = wait_ms
            try:
                req_id = self.send(broker, "fetch", fields)
            except Timeout:
                state.send_failed(broker, parts, self.clock())
            else:
                state.sent(broker, req_id, parts, self.clock(), wait_ms)

    def _send_tasks(self) -> None:
        runner = self.c._tasks
        runner.expire(self.clock())
        for task, address, op, fields in runner.requests(self.clock()):
            try:
                req_id = self.send(address, op, fields)
            except KeraError as err:   # Timeout, or an address zmq cannot use
                runner.send_failed(task, err, self.clock())
            else:
                runner.sent(task, address, req_id, self.clock())

    def on_replies(self, replies: list) -> None:
        c = self.c
        for address, header, frames in replies:
            # Under the state lock until pushed: a seek cannot slip between a reply's
            # bookkeeping and its items reaching the cache.
            with c._state_lock:
                now = self.clock()
                if c._tasks.on_reply(address, header, frames, now):
                    continue
                items = c._fetch.on_reply(address, header, frames, now)
                if items:
                    c._push(items)

    def on_stream(self, name: str, result: StreamInfo | KeraError) -> None:
        c, state = self.c, self.c._fetch
        if isinstance(result, KeraError) and not isinstance(result, UnknownStream):
            log.info("metadata refresh of '%s' failed: %s", name, result)
            return   # coordinator unreachable: the reads keep retrying
        with c._state_lock:
            known = state.stream_ids.get(name)
            if known is None or (isinstance(result, StreamInfo) and result.id == known):
                if known is not None:
                    c._grow(result)
                return
            state.fatal = True
        c._push([ErrorItem(UnknownStream(f"stream '{name}' (id {known}) no longer exists"))])
