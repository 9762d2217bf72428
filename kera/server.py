"""The thin I/O shell every daemon shares: a ROUTER socket, outgoing peers, timers, one loop.

The daemon's logic lives in a sans-IO core; its server module registers handlers here. A handler
gets a Request and returns the reply (`dict` of fields, or `(fields, frames)`), or DEFERRED when
it will answer later through `Server.reply` / `Server.fail`. This module is the one error
boundary: a KeraError becomes an error reply, any other exception is logged and becomes an
`internal` error reply, and the loop goes on.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from kera import wire
from kera.errors import BadRequest, KeraError, Timeout

log = logging.getLogger(__name__)

DEFERRED = object()
# Messages drained from the ROUTER socket before the after-batch hook runs: batching many
# producer requests into one replication round is what the virtual log is for.
MAX_BATCH_MESSAGES = 256


@dataclass(slots=True)
class Request:
    identity: bytes
    id: object
    op: str
    fields: wire.Fields
    frames: list
    received_at: float = field(default_factory=time.monotonic)


class Peer:
    """An outgoing DEALER connection to another daemon, with per-request callbacks and deadlines."""

    def __init__(self, server: "Server", address: str):
        self.address = address
        self.sock = server.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(f"tcp://{address}")
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 16)
        self.pending: dict[int, tuple[float, Callable]] = {}
        # Messages the socket would not take yet (not connected: IMMEDIATE refuses to queue);
        # retried on every loop turn until sent or their request's deadline passes.
        self.unsent: collections.deque = collections.deque()

    def request(self, op: str, fields: dict | None, frames, timeout_s: float,
                callback: Callable[[dict | None, list | None, KeraError | None], None]) -> int:
        """Send a request; `callback(header, frames, error)` runs exactly once: on the reply, on
        an error reply (error set), or on timeout."""
        req_id = next(self._ids)
        self.pending[req_id] = (time.monotonic() + timeout_s, callback)
        self.unsent.append((req_id, [wire.request(op, req_id, fields), *frames]))
        self.send_unsent()
        return req_id

    def send_unsent(self) -> None:
        while self.unsent:
            req_id, parts = self.unsent[0]
            if req_id not in self.pending:  # timed out before it could be sent
                self.unsent.popleft()
                continue
            try:
                self.sock.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return  # not connected yet, or queue full: next loop turn
            self.unsent.popleft()

    def on_readable(self) -> None:
        for _ in range(MAX_BATCH_MESSAGES):
            try:
                parts = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header = wire.unpack_header(parts[0].buffer)
            except BadRequest:
                log.warning("dropping an unreadable reply from %s", self.address)
                continue
            entry = self.pending.pop(header.get("id"), None)
            if entry is None:
                continue  # late reply to a request already timed out
            callback = entry[1]
            if header.get("ok") is True:
                callback(header, parts[1:], None)
            else:
                try:
                    wire.raise_for_reply(header)
                except KeraError as err:
                    callback(None, None, err)

    def expire(self, now: float) -> None:
        self.send_unsent()
        if not self.pending:
            return
        late = [rid for rid, (deadline, _) in self.pending.items() if deadline <= now]
        for rid in late:
            _, callback = self.pending.pop(rid)
            callback(None, None, Timeout(f"no reply from {self.address}"))
        if not self.pending:
            self.unsent.clear()

    def close(self) -> None:
        for _, callback in self.pending.values():
            callback(None, None, Timeout(f"connection to {self.address} closed"))
        self.pending.clear()
        self.unsent.clear()
        self.sock.close(linger=0)


class Server:
    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0):
        self.name = name
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        self.router.setsockopt(zmq.RCVHWM, 100_000)
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        if port:
            self.router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.handlers: dict[str, Callable[[Request], object]] = {}
        self.after_batch: list[Callable[[], None]] = []
        self.peers: dict[str, Peer] = {}
        self._timers: list = []
        self._timer_seq = itertools.count()
        self._stopping = False
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ registration
    def on(self, op: str, handler: Callable[[Request], object]) -> None:
        self.handlers[op] = handler

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + interval_s, next(self._timer_seq), fn, interval_s))

    def peer(self, address: str) -> Peer:
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = Peer(self, address)
            self.poller.register(peer.sock, zmq.POLLIN)
        return peer

    def drop_peer(self, address: str) -> None:
        peer = self.peers.pop(address, None)
        if peer is not None:
            self.poller.unregister(peer.sock)
            peer.close()

    # ------------------------------------------------------------------ replies
    def reply(self, req: Request, fields: dict | None = None, frames=()) -> None:
        self._send(req.identity, wire.ok_reply(req.id, fields), frames)

    def fail(self, req: Request, err: KeraError) -> None:
        self._send(req.identity, wire.error_reply(req.id, err), ())

    def _send(self, identity: bytes, header: bytes, frames) -> None:
        try:
            self.router.send_multipart([identity, header, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: reply dropped, client queue full", self.name)

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stopping = True

    def run(self) -> None:
        log.info("%s serving on %s", self.name, self.address)
        try:
            while not self._stopping:
                self.run_once()
        finally:
            self.close()

    def run_once(self, max_wait_s: float = 0.05) -> None:
        now = time.monotonic()
        wait = max_wait_s
        if self._timers:
            wait = max(0.0, min(wait, self._timers[0][0] - now))
        if any(peer.unsent for peer in self.peers.values()):
            wait = min(wait, 0.002)  # a connection is coming up: retry its first sends soon
        events = dict(self.poller.poll(int(wait * 1000)))
        if self.router in events:
            self._drain_router()
        for peer in list(self.peers.values()):
            if peer.sock in events:
                peer.on_readable()
        now = time.monotonic()
        for peer in list(self.peers.values()):
            peer.expire(now)
        self._run_timers(now)

    def _drain_router(self) -> None:
        for _ in range(MAX_BATCH_MESSAGES):
            try:
                parts = self.router.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._dispatch(parts)
        for hook in self.after_batch:
            self._guarded(hook)

    def _dispatch(self, parts: list) -> None:
        if len(parts) < 2:
            return  # no header frame: nothing to answer
        identity = parts[0].bytes
        req_id = None
        try:
            if len(parts) - 2 > wire.MAX_FRAMES:
                raise BadRequest(f"{len(parts) - 2} payload frames exceed {wire.MAX_FRAMES}")
            header = wire.unpack_header(parts[1].buffer)
            req_id = header.get("id")
            if not isinstance(req_id, int) or isinstance(req_id, bool):
                raise BadRequest("missing or non-integer request id")
            fields = wire.Fields(header)
            if fields.int("v", lo=0, hi=255) != wire.PROTOCOL_VERSION:
                raise BadRequest(f"protocol version {header['v']} is not {wire.PROTOCOL_VERSION}")
            op = fields.str("op", hi=64)
            handler = self.handlers.get(op)
            if handler is None:
                raise BadRequest(f"unknown op '{op}'")
            req = Request(identity, req_id, op, fields, parts[2:])
            result = handler(req)
        except KeraError as err:
            self._send(identity, wire.error_reply(req_id, err), ())
            return
        except Exception as exc:  # the error boundary: log, answer, keep serving
            log.exception("%s: internal error handling a request", self.name)
            self._send(identity, wire.error_reply(req_id, KeraError(f"internal error: {exc.__class__.__name__}: {exc}")), ())
            return
        if result is DEFERRED:
            return
        if isinstance(result, tuple):
            self.reply(req, result[0], result[1])
        else:
            self.reply(req, result)

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, fn, interval = heapq.heappop(self._timers)
            self._guarded(fn)
            heapq.heappush(self._timers, (now + interval, next(self._timer_seq), fn, interval))

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("%s: error in %s", self.name, getattr(fn, "__qualname__", fn))

    def close(self) -> None:
        for address in list(self.peers):
            self.drop_peer(address)
        self.router.close(linger=0)
