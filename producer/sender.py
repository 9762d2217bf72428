"""The producer's request thread: seals lingering chunks, sends produce requests, applies replies.

It owns one kera.rpc.Connection per broker (zmq sockets are not thread-safe) and sleeps in one
zmq poll over them and the producer's wake-up pipe. All bookkeeping is the Pipeline's; this
module only moves bytes and takes the producer's lock around each Pipeline call.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from kera import rpc
from kera.producer import delivery
from kera.errors import BadRequest, KeraError, Timeout, UnknownStream

log = logging.getLogger(__name__)

# How long a send may wait for a broker connection to accept a request (a new connection needs
# a moment for its handshake; a dead broker must not stall the other brokers' requests long).
SEND_WAIT_S = 0.5
METADATA_REFRESH_INTERVAL_S_MIN = 0.05
IDLE_POLL_MS = 1000  # nothing to wait for: wake up now and then anyway


class Sender(threading.Thread):
    def __init__(self, producer):
        super().__init__(name=f"kera-producer-{producer.producer_id:016x}", daemon=True)
        self.p = producer
        self.conns: dict[str, rpc.Connection] = {}
        self.poller = zmq.Poller()
        self.poller.register(producer._wake_r, zmq.POLLIN)

    def run(self) -> None:
        p = self.p
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller through flush/send
            log.exception("producer request thread failed")
            with p._lock:
                p._fatal = exc
                p._cond.notify_all()
        finally:
            with p._lock:  # outcomes of the last loop turn: settle them before exiting
                settled, p._pipe.settled = p._pipe.settled, []
            delivery.settle(settled)
            for conn in self.conns.values():
                conn.close()

    def _loop(self) -> None:
        p, pipe, acc = self.p, self.p._pipe, self.p._acc
        while True:
            with p._lock:
                if p._stopping:
                    return
                p._idle = False
                now = time.monotonic()
                acc.seal_lingering(now)
                before = len(pipe.incomplete)
                refresh = pipe.expire(now)
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
            if refresh:
                self._refresh(refresh)
            if out:
                self._send(out)
            if wake_at:
                timeout_ms = max(0, min(IDLE_POLL_MS, int((min(wake_at) - time.monotonic()) * 1000) + 1))
            else:
                timeout_ms = IDLE_POLL_MS
            events = dict(self.poller.poll(timeout_ms))
            if events.pop(p._wake_r, None):
                try:
                    os.read(p._wake_r, 4096)
                except BlockingIOError:
                    pass
            if events:
                self._receive(events)

    def _conn(self, address: str) -> rpc.Connection:
        conn = self.conns.get(address)
        if conn is None:
            conn = self.conns[address] = rpc.Connection(address, timeout_s=self.p.request_timeout_s,
                                                           key_file=self.p.key_file)
            self.poller.register(conn.sock, zmq.POLLIN)
        return conn

    def _send(self, out: list) -> None:
        p, pipe = self.p, self.p._pipe
        sent, failed = [], []
        for o in out:
            try:
                req_id = self._conn(o.broker).send("produce", None, o.frames, timeout_s=SEND_WAIT_S)
            except Timeout:
                failed.append(o)
            else:
                sent.append((o, req_id))
        now = time.monotonic()
        refresh = set()
        with p._lock:
            for o, req_id in sent:
                pipe.sent(o, req_id, now)
            for o in failed:
                refresh |= pipe.on_request_failed(o, Timeout(f"broker {o.broker} is not reachable"), now)
            if failed:
                p._cond.notify_all()
        if refresh:
            self._refresh(refresh)

    def _receive(self, events: dict) -> None:
        p, pipe = self.p, self.p._pipe
        replies = []
        for address, conn in self.conns.items():
            if conn.sock not in events:
                continue
            while conn.sock.poll(0, zmq.POLLIN):
                try:
                    header, _ = conn.recv(0)
                except BadRequest as err:
                    log.warning("dropping a garbled reply from %s: %s", address, err)
                    continue
                except Timeout:
                    break
                replies.append((address, header))
        if not replies:
            return
        now = time.monotonic()
        refresh = set()
        with p._lock:
            for address, header in replies:
                refresh |= pipe.on_reply(address, header, now)
            p._cond.notify_all()
            settled, pipe.settled = pipe.settled, []
        delivery.settle(settled)  # outside the lock: callbacks may send
        if refresh:
            self._refresh(refresh)

    def _refresh(self, streams: set) -> None:
        """Ask the coordinator again about streams whose chunks were refused or timed out."""
        p = self.p
        for name, stream_id in streams:
            try:
                info = p._meta.refresh(name, interval_s_min=METADATA_REFRESH_INTERVAL_S_MIN)
            except UnknownStream:
                gone = UnknownStream(f"stream '{name}' no longer exists")
            except KeraError as err:  # coordinator unreachable: the chunks wait and retry
                log.info("metadata refresh of '%s' failed: %s", name, err)
                continue
            else:
                if info.id == stream_id:
                    continue
                gone = UnknownStream(f"stream '{name}' (id {stream_id}) was deleted")
            with p._lock:
                p._stream_gone(name, stream_id, gone)
