"""kera.net.server's shell, simulated: a process's requests, replies, timers and peers on the sim clock.

SimServer is a kera.net.server.Server (so daemon classes built on Server, and code that takes one,
run unchanged on it) that never touches zmq. It mirrors `run_once` turn by turn: a turn takes
every message that arrived since the last one, dispatches the requests (same validation and
error boundary as Server._dispatch), runs the `after_batch` hooks, hands replies to their Peer
callbacks, then runs the `after_turn` hooks (the broker's pump, the backup's collect). Timers and
request deadlines are events of their own, each followed by `after_turn`, as they are in
`run_once`.

One difference is on purpose: where the real shell logs an exception from a handler or a hook
and answers `internal`, the simulation fails the run (guarantee 6: no core raises on a
delivered message). A KeraError from a handler is the designed error path: an error reply.

A process is created with `host=SimHost(net, rng, name)`: its address is "name:port".
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, NamedTuple

from kera.net import server as kera_server
from kera.codec import wire
from kera.errors import BadRequest, KeraError, Timeout

from tests.sim.network import Network, Node

TURN_DELAY_S = (0.00002, 0.0003)   # from a message's arrival to the turn that handles it
DEFERRED = kera_server.DEFERRED


class SimFailure(AssertionError):
    """The run broke a guarantee; the message says which, the runner adds the seed."""


class CoreRaised(SimFailure):
    """A core (or the glue a server runs) raised something other than a KeraError."""


class SimHost(NamedTuple):
    net: Network
    rng: random.Random
    name: str


class Frame:
    """A received payload frame, as zmq.Frame shows it to handlers (`.buffer`, `.bytes`)."""
    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview):
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return bytes(self.buffer)


class SimRequest:
    __slots__ = ("identity", "src_inc", "id", "op", "fields", "frames", "ctx", "principal")

    def __init__(self, identity: str, src_inc: int, req_id, op: str, fields: wire.Fields, frames: list):
        self.identity = identity
        self.src_inc = src_inc
        self.id = req_id
        self.op = op
        self.fields = fields
        self.frames = frames
        self.ctx = None          # what the simulation remembers until the request is answered
        self.principal = None    # plaintext: no authenticated caller


class _Poller:
    def register(self, *args) -> None:   # worker wake-up pipes: the simulation calls back instead
        pass


class SimPeer:
    """kera.net.server.Peer: one outgoing connection with per-request callbacks and deadlines."""

    def __init__(self, server: "SimServer", address: str):
        self.server = server
        self.address = address
        self._ids = server.peer_request_ids   # unique across its connections, as zmq's
        self.pending: dict[int, Callable] = {}  # sockets never mix their replies

    @property
    def idle(self) -> bool:   # as kera.net.server.Peer.idle
        return not self.pending

    def request(self, op: str, fields: dict | None, frames, timeout_s: float, callback: Callable) -> int:
        req_id = next(self._ids)
        self.pending[req_id] = callback
        s = self.server
        s.net.send(s.address, s.incarnation, self.address, None,
                   [wire.request(op, req_id, fields), *[bytes(f) for f in frames]])
        s.schedule(timeout_s, self._expire, req_id)
        return req_id

    def _expire(self, req_id: int) -> None:
        callback = self.pending.pop(req_id, None)
        if callback is not None:
            callback(None, None, Timeout(f"no reply from {self.address}"))

    def on_reply(self, header: dict, frames: list) -> None:
        callback = self.pending.pop(header.get("id"), None)
        if callback is None:
            return  # late reply to a request already timed out
        if header.get("ok") is True:
            callback(header, [Frame(memoryview(f)) for f in frames], None)
        else:
            try:
                wire.raise_for_reply(header)
            except KeraError as err:
                callback(None, None, err)

    def close(self) -> None:
        for callback in self.pending.values():
            callback(None, None, Timeout(f"connection to {self.address} closed"))
        self.pending.clear()


class SimServer(Node, kera_server.Server):
    def __init__(self, name: str, host: SimHost, port: int = 1, security=None,
                 frame_bytes_max: int | None = None):
        assert security is None, "the simulation runs plaintext (no CURVE in SimServer)"
        Node.__init__(self, host.net, f"{host.name}:{port}")
        self.security = None
        self.guard = None
        self.name = f"{name} {host.name}"
        self.rng = host.rng
        self.host = host.name
        self.port = port
        self.handlers: dict[str, Callable] = {}
        self.after_batch: list[Callable] = []
        self.after_turn: list[Callable] = []
        self.peers: dict[str, SimPeer] = {}
        # Addresses whose connection this process closed: a reply still on its way there is
        # dropped, as zmq's ROUTER drops a message to a DEALER that went away (it is not a
        # request to this process's own socket).
        self.closed_peers: set[str] = set()
        self.peer_request_ids = itertools.count(1 << 40)
        self.poller = _Poller()
        self.inbox: list = []
        self._turn_pending = False
        self._stopping = False
        self._conn_ids = itertools.count(1 << 20)

    address = Node.address

    def crash(self) -> None:
        """kill -9: nothing more runs; messages to it are lost."""
        self.up = False
        self.inbox = []

    # ------------------------------------------------------------------ registration
    def on(self, op: str, handler: Callable) -> None:
        self.handlers[op] = handler

    def every(self, interval_s: float, fn: Callable) -> None:
        self.schedule(interval_s, self._every, interval_s, fn)

    def wake_at(self, t: float) -> None:
        """Server.wake_at: an event at `t` that runs the after_turn hooks."""
        self.schedule_at(t, _nothing)

    def _every(self, interval_s: float, fn: Callable) -> None:
        fn()
        self.every(interval_s, fn)

    def peer(self, address: str) -> SimPeer:
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = SimPeer(self, address)
        return peer

    def drop_peer(self, address: str) -> None:
        peer = self.peers.pop(address, None)
        if peer is not None:
            self.closed_peers.add(address)
            peer.close()

    def schedule(self, dt: float, fn: Callable, *args) -> None:
        """Run fn(*args) after dt as an event of this process (dropped once it crashed),
        followed by the after_turn hooks."""
        self.sched.after(dt, self._event, fn, args)

    def schedule_at(self, t: float, fn: Callable, *args) -> None:
        """`schedule` at an absolute time: exactly `t`, where `now + (t - now)` may round
        below it (a wake-up that runs just before its deadline and expires nothing)."""
        self.sched.at(t, self._event, fn, args)

    def _event(self, fn: Callable, args) -> None:
        if not self.up:
            return
        self._guarded(fn, *args)
        for hook in self.after_turn:
            if self.up:
                self._guarded(hook)

    def _guarded(self, fn: Callable, *args, kera_errors_pass: bool = False):
        """Run fn; anything it raises fails the run, except a KeraError from a request
        handler (kera_errors_pass), which the shell turns into an error reply."""
        try:
            return fn(*args)
        except SimFailure:
            raise
        except KeraError as exc:
            if kera_errors_pass:
                raise
            raise CoreRaised(f"{self.name}: {getattr(fn, '__qualname__', fn)} let "
                             f"{exc.__class__.__name__} escape: {exc}") from exc
        except Exception as exc:
            raise CoreRaised(f"{self.name}: {getattr(fn, '__qualname__', fn)} raised "
                             f"{exc.__class__.__name__}: {exc}") from exc

    # ------------------------------------------------------------------ messages
    def receive(self, src: str, src_inc: int, parts: list) -> None:
        self.inbox.append((src, src_inc, parts))
        if not self._turn_pending:
            self._turn_pending = True
            self.schedule(self.rng.uniform(*TURN_DELAY_S), self._turn)

    def _turn(self) -> None:
        self._turn_pending = False
        msgs, self.inbox = self.inbox, []
        replies = []
        requests = 0
        for src, src_inc, parts in msgs:
            try:
                header = wire.unpack_header(parts[0])
            except BadRequest as err:
                header = err
            if not self.handlers or (self._is_peer(src) and isinstance(header, dict) and "ok" in header):
                if isinstance(header, dict):   # an unreadable reply is dropped (Peer.on_readable)
                    replies.append((src, header, parts[1:]))
            else:
                requests += 1
                self._dispatch(src, src_inc, header, parts)
                if not self.up:
                    return
        if requests:
            for hook in self.after_batch:
                self._guarded(hook)
        for src, header, frames in replies:
            peer = self.peers.get(src)
            if peer is not None:
                self._guarded(peer.on_reply, header, frames)
            elif src not in self.closed_peers:
                self._guarded(self.on_client_reply, src, header, frames)

    def _is_peer(self, src: str) -> bool:
        return src in self.peers or src in self.closed_peers

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        """A reply on a client connection (kera.net.rpc.Connection): producers and consumers."""

    def _dispatch(self, src: str, src_inc: int, header, parts: list) -> None:
        """kera.net.server.Server._dispatch, with `parts` = [header, *frames] (no identity frame);
        `header` is the decoded header or the BadRequest decoding it raised."""
        req_id = None
        try:
            if len(parts) - 1 > wire.MAX_FRAMES:
                raise BadRequest(f"{len(parts) - 1} payload frames exceed {wire.MAX_FRAMES}")
            if isinstance(header, BadRequest):
                raise header
            req_id = wire.request_id_of(header)
            fields, op, handler = wire.request_envelope(header, self.handlers)
            req = SimRequest(src, src_inc, req_id, op, fields, [Frame(memoryview(p)) for p in parts[1:]])
            result = self._guarded(handler, req, kera_errors_pass=True)
        except KeraError as err:
            self._send(src, src_inc, wire.error_reply(req_id, err), ())
            return
        if result is DEFERRED:
            return
        if isinstance(result, tuple):
            self.reply(req, result[0], result[1])
        else:
            self.reply(req, result)

    def share(self, payloads: list[list]) -> list[list]:
        return payloads   # the simulated network delivers bytes: no zmq Frames to share

    def reply(self, req: SimRequest, fields: dict | None = None, frames=()) -> None:
        self._send(req.identity, req.src_inc, wire.ok_reply(req.id, fields), frames)

    def fail(self, req: SimRequest, err: KeraError) -> None:
        self._send(req.identity, req.src_inc, wire.error_reply(req.id, err), ())

    def _send(self, dst: str, dst_inc: int, header: bytes, frames) -> None:
        self.net.send(self.address, self.incarnation, dst, dst_inc,
                      [header, *[bytes(f) for f in frames]])

    # ------------------------------------------------------------------ client connections
    def send_request(self, address: str, op: str, fields: dict | None = None, frames=()) -> int:
        """kera.net.rpc.Connection.send: a request whose reply goes to on_client_reply."""
        req_id = next(self._conn_ids)
        self.net.send(self.address, self.incarnation, address, None,
                      [wire.request(op, req_id, fields), *[bytes(f) for f in frames]])
        return req_id

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """The daemon stops itself (a refused identity, a failed disk, a bug): like the real
        process, it exits once the event in hand is done (and the healing phase restarts it)."""
        self._stopping = True
        if self.up:
            self.sched.after(0.0, self._exit, self.incarnation)

    def _exit(self, incarnation: int) -> None:
        if self.up and self.incarnation == incarnation and self._stopping:
            self.crash()

    def run(self) -> None:
        raise RuntimeError("a simulated server is driven by the scheduler")

    run_once = run

    def close(self) -> None:
        self.crash()


def _nothing() -> None:
    """A wake-up's own work: none (the after_turn hooks that follow it do the work)."""
