"""The consumer's request thread: fetches from every broker into the consumer's bounded cache.

It owns one kera.rpc.Connection per broker (zmq sockets are not thread-safe), keeps one fetch
in flight per broker, and stops fetching while the cache holds `cache_chunks_max` chunks (the
caller wakes it through the pipe when it makes room). The bookkeeping is FetchState's.
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
        super().__init__(name=f"kera-consumer-{consumer.stream}", daemon=True)
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
        c, state = self.c, self.c._fetch
        while not c._stopping:
            now = time.monotonic()
            state.expire(now)
            if state.want_refresh:
                self._refresh()
            with c._lock:
                room = c.cache_chunks_max - c._cached_chunks
                c._fetcher_waiting = room <= 0
            requests = state.build(now, c._meta.address_of) if room > 0 else []
            for broker, reads, streamlets in requests:
                try:
                    req_id = self._conn(broker).send("fetch", {"reads": reads}, timeout_s=SEND_WAIT_S)
                except Timeout:
                    state.send_failed(broker, streamlets, time.monotonic())
                else:
                    state.sent(broker, req_id, streamlets, time.monotonic())
            wake = state.next_wake(time.monotonic())
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
            if state.fatal:
                return

    def _conn(self, address: str) -> rpc.Connection:
        conn = self.conns.get(address)
        if conn is None:
            conn = self.conns[address] = rpc.Connection(address, timeout_s=self.c.request_timeout_s)
            self.poller.register(conn.sock, zmq.POLLIN)
        return conn

    def _receive(self, events: dict) -> None:
        c, state = self.c, self.c._fetch
        items = []
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
                items += state.on_reply(address, header, frames, time.monotonic())
        if items:
            c._push(items)

    def _refresh(self) -> None:
        c, state = self.c, self.c._fetch
        state.want_refresh = False
        try:
            info = c._meta.refresh(c.stream, interval_s_min=METADATA_REFRESH_INTERVAL_S_MIN)
        except UnknownStream:
            gone = True
        except KeraError as err:  # coordinator unreachable: keep retrying the reads
            log.info("metadata refresh of '%s' failed: %s", c.stream, err)
            return
        else:
            gone = info.id != state.stream_id
        if gone:
            state.fatal = True
            c._push([ErrorItem(UnknownStream(f"stream '{c.stream}' (id {state.stream_id}) no longer exists"))])
