"""The consumer's request thread: fetches from every broker into the consumer's bounded cache,
and drives the consumer's extra tasks (kera.consumer.tasks: group membership).

It owns one kera.rpc.Connection per address (zmq sockets are not thread-safe) whatever the
number of streams read, keeps one fetch in flight per broker carrying every part read there,
and stops fetching while the cache holds `cache_chunks_max` chunks (the caller wakes it through
the pipe when it makes room). The bookkeeping is FetchState's and TaskRunner's; both are used
under the consumer's state lock, which seek/assign also take.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from kera import rpc
from kera.consumer.cursor import ErrorItem
from kera.errors import BadRequest, KeraError, Timeout, UnknownStream

log = logging.getLogger(__name__)

SEND_WAIT_S = 0.5
IDLE_POLL_MS = 200
METADATA_REFRESH_INTERVAL_S_MIN = 0.05


class Fetcher(threading.Thread):
    def __init__(self, consumer):
        super().__init__(name=f"kera-consumer-{consumer.stream or 'streams'}", daemon=True)
        self.c = consumer
        self.conns: dict[str, rpc.Connection] = {}
        self.poller = zmq.Poller()
        self.poller.register(consumer._wake_r, zmq.POLLIN)

    def run(self) -> None:
        c = self.c
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the caller sees it on its next poll
            log.exception("consumer request thread failed")
            c._push([ErrorItem(KeraError(f"consumer request thread died: {exc!r}"))])
        finally:
            for conn in self.conns.values():
                conn.close()

    def _loop(self) -> None:
        c = self.c
        while not c._stopping:
            if c._fetch.want_refresh:
                self._refresh()
            with c._state_lock:
                self._send_fetches()
                self._send_tasks()
                wake = min((t for t in (c._fetch.next_wake(time.monotonic()),
                                        c._tasks.next_wake(time.monotonic())) if t is not None),
                           default=None)
            timeout_ms = IDLE_POLL_MS if wake is None else \
                max(0, min(IDLE_POLL_MS, int((wake - time.monotonic()) * 1000) + 1))
            events = dict(self.poller.poll(timeout_ms))
            if events.pop(c._wake_r, None):
                try:
                    os.read(c._wake_r, 4096)
                except BlockingIOError:
                    pass
            if events:
                self._receive(events)
            if c._fetch.fatal:
                return

    def _send_fetches(self) -> None:
        c, state = self.c, self.c._fetch
        now = time.monotonic()
        state.expire(now)
        with c._lock:
            room = c.cache_chunks_max - c._cached_chunks
            c._fetcher_waiting = room <= 0
        requests = state.build(now, c._meta.address_of) if room > 0 else []
        for broker, reads, parts in requests:
            try:
                req_id = self._conn(broker).send("fetch", {"reads": reads}, timeout_s=SEND_WAIT_S)
            except Timeout:
                state.send_failed(broker, parts, time.monotonic())
            else:
                state.sent(broker, req_id, parts, time.monotonic())

    def _send_tasks(self) -> None:
        runner = self.c._tasks
        runner.expire(time.monotonic())
        for task, address, op, fields in runner.requests(time.monotonic()):
            try:
                req_id = self._conn(address).send(op, fields, timeout_s=SEND_WAIT_S)
            except KeraError as err:   # Timeout, or an address zmq cannot use
                runner.send_failed(task, err, time.monotonic())
            else:
                runner.sent(task, address, req_id, time.monotonic())

    def _conn(self, address: str) -> rpc.Connection:
        conn = self.conns.get(address)
        if conn is None:
            conn = self.conns[address] = rpc.Connection(address, timeout_s=self.c.request_timeout_s,
                                                          key_file=self.c.key_file)
            self.poller.register(conn.sock, zmq.POLLIN)
        return conn

    def _receive(self, events: dict) -> None:
        c = self.c
        for address, conn in self.conns.items():
            if conn.sock not in events:
                continue
            while conn.sock.poll(0, zmq.POLLIN):
                try:
                    header, frames = conn.recv(0)
                except BadRequest as err:
                    log.warning("dropping a garbled reply from %s: %s", address, err)
                    continue
                except Timeout:
                    break
                # Under the state lock until pushed: a seek cannot slip between a reply's
                # bookkeeping and its items reaching the cache.
                with c._state_lock:
                    now = time.monotonic()
                    if c._tasks.on_reply(address, header, frames, now):
                        continue
                    items = c._fetch.on_reply(address, header, frames, now)
                    if items:
                        c._push(items)

    def _refresh(self) -> None:
        c, state = self.c, self.c._fetch
        with c._state_lock:
            streams, state.want_refresh = state.want_refresh, set()
        for stream in sorted(streams):
            try:
                info = c._meta.refresh(stream, interval_s_min=METADATA_REFRESH_INTERVAL_S_MIN)
            except UnknownStream:
                gone = True
            except KeraError as err:  # coordinator unreachable: keep retrying the reads
                log.info("metadata refresh of '%s' failed: %s", stream, err)
                continue
            else:
                gone = info.id != state.stream_ids.get(stream)
            if gone:
                state.fatal = True
                c._push([ErrorItem(UnknownStream(f"stream '{stream}' (id "
                                                 f"{state.stream_ids.get(stream)}) no longer exists"))])
                return
