"""The thin I/O shell every daemon shares: a ROUTER socket, outgoing peers, timers, one loop.

The daemon's logic lives in a sans-IO core; its server module holds a Server (built by its
kera.daemon.env.DaemonEnv) and registers handlers and hooks on it. A handler
gets a Request and returns the reply (`dict` of fields, or `(fields, frames)`), or DEFERRED when
it will answer later through `Server.reply` / `Server.fail`. This module is the one error
boundary, for handlers, timers, after-batch hooks and peer callbacks alike: a KeraError becomes
an error reply (or is logged, where there is nobody to answer); any other exception is a bug,
so the daemon logs it with its stack and stops (`Server.failure` is set and the daemon's
process exits non-zero) rather than serve on with state the bug may have broken.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from kera.net import keys

from kera.codec import wire
from kera.net.access import Guard
from kera.net.inflow import CHECK_INTERVAL_S, UNREAD_SLACK_BYTES, InflowWatch
from kera.errors import BadRequest, KeraError, NotAuthorized, PeerUnreachable, Throttled, Timeout
from kera.net.keys import Principal
from kera.net.security import Security, ZapHandler, key_of, principal_of, warn_if_open

log = logging.getLogger(__name__)

DEFERRED = object()
# Messages drained from the ROUTER socket before the after-batch hook runs: batching many
# producer requests into one replication round is what the virtual log is for.
MAX_BATCH_MESSAGES = 256
# Whole messages (not frames) zmq queues per connection each way. Clients keep a handful of
# requests in flight (producers 4 per broker), so this is far above need, and it bounds what a
# flooding client can park in the daemon to HWM x wire.MESSAGE_BYTES_MAX.
ROUTER_HWM_MESSAGES = 1000
# How long a connection may take to finish its CURVE handshake before the daemon closes it.
# The handshake is four short messages (well under a second even across regions); until it
# completes a connection is unauthenticated yet holds a descriptor, for zmq's default 30 s,
# which let one host park thousands of silent connections.
CURVE_HANDSHAKE_MS = 5000
PEER_HWM_MESSAGES = 1000
# Outgoing connections a daemon keeps at once. A broker talks to the coordinator and to the
# backups of its virtual logs; each connection costs file descriptors and zmq buffers, so an
# unbounded number of registered backup addresses must not exhaust the process's sockets.
# Beyond this the least recently used idle peer is closed (or the new one is refused).
PEERS_MAX = 256
# Bytes of requests waiting in one peer's queue for their connection: beyond this a request is
# refused with `throttled` instead of growing the daemon's memory behind a slow or dead peer.
PEER_UNSENT_BYTES_MAX = 256 * 1024 * 1024
# Frames at least this long leave zero-copy (zmq keeps a reference to the buffer until sent);
# shorter ones are copied. pyzmq's default threshold is 64 KiB, so a chunk of up to 64 KiB, the
# largest size producers build, was copied into fresh zmq memory on every replication write and
# fetch reply: 30-45 us per 64 KiB frame on this 2-core VM against 12-15 us zero-copy, while a
# 4 KiB frame copies in 7-10 us and costs 15-28 us zero-copy (bench/test_send_frames.py).
# Safe for daemons: every frame they send is immutable once sent (stamped segment bytes,
# received frames, file reads) and the reference keeps a released segment's memory alive.
ZERO_COPY_MIN_BYTES = 32 * 1024
# Send flags as plain ints (see send_frames).
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)

# When a bug stops the daemon, the error reply to the request that hit it gets this long to
# leave (best effort) so its client hears why instead of timing out. 500 ms once lost the reply
# on this 2-core machine under a full test run; the daemon is stopping anyway.
FAILURE_REPLY_LINGER_MS = 2_000


def send_frames(sock: zmq.Socket, parts: list) -> None:
    """`sock.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)` without its per-frame enum
    arithmetic (`SNDMORE | flags` builds a Flag member for every frame: 3% of a broker's loop
    samples at 4 KiB chunks). Raises zmq.Again, with nothing sent, when the socket would not
    take the message: zmq queues a multipart message whole or not at all, deciding at its first
    frame, as it does under send_multipart."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        sock.send(part, _NOBLOCK_MORE if i < last else _NOBLOCK, copy=False)


def share_payloads(payloads: list[list]) -> list[list]:
    """`payloads` (frame lists, one per outgoing message) with each list that appears more than
    once, by identity, made into zmq Frames once: zmq then sends every copy of a Frame by
    reference, so a payload sent to N peers costs one zero-copy hand-off (one wake-up of
    pyzmq's collector thread when all are sent), or one copy below ZERO_COPY_MIN_BYTES, not N.
    A broker sends each replication payload to every backup of the segment (R-1 of them).
    Sending a payload to 2 peers cost the sender 8-12% less CPU this way with 64 KiB frames,
    15-19% with 16 KiB ones (side by side, bench/test_send_frames.py); the throughput preset
    at 64 KiB chunks, R=3, showed no change (1.00x, rounds 0.89-1.13x)."""
    seen: dict[int, list | None] = {}
    for frames in payloads:
        key = id(frames)
        seen[key] = frames if key in seen else None
    shared = {key: [zmq.Frame(f, copy=len(f) < ZERO_COPY_MIN_BYTES) for f in frames]
              for key, frames in seen.items() if frames is not None}
    return [shared.get(id(frames), frames) for frames in payloads]


@dataclass(slots=True)
class Request:
    identity: bytes
    id: object
    op: str
    fields: wire.Fields
    frames: list
    principal: Principal | None = None   # who sent it (secure daemons); None in plaintext


class Peer:
    """An outgoing DEALER connection to another daemon, with per-request callbacks and deadlines.

    Callbacks run inside the server's error boundary (`Server.guarded`)."""

    def __init__(self, server: "Server", address: str, refused: str | None = None):
        self.address = address
        self.server = server
        # Set when zmq refuses the address (it cannot parse or resolve it) or the socket (out
        # of sockets), or the server has no room for it (`refused`): every request then fails
        # with PeerUnreachable through its callback, as for a daemon that never answers.
        self.broken: str | None = refused
        self.sock = None
        if refused is None:
            try:
                self.sock = _dealer(server.ctx, address, server.security)
            except zmq.ZMQError as exc:
                self.broken = f"cannot connect to {address!r}: {exc}"
        if self.broken is not None:
            log.warning("%s: %s", server.name, self.broken)
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 16)
        self.pending: dict[int, tuple[float, Callable]] = {}
        # Messages the socket would not take yet (not connected: IMMEDIATE refuses to queue);
        # retried on every loop turn until sent or their request's deadline passes.
        self.unsent: collections.deque = collections.deque()
        self.unsent_bytes = 0
        self.refused: list[Callable] = []   # over the byte budget: failed on the next turn
        self.last_used = time.monotonic()

    @property
    def closed(self) -> bool:
        return self.sock is not None and self.sock.closed

    @property
    def idle(self) -> bool:
        return not self.pending and not self.refused

    def request(self, op: str, fields: dict | None, frames, timeout_s: float,
                callback: Callable[[dict | None, list | None, KeraError | None], None]) -> int:
        """Send a request; `callback(header, frames, error)` runs exactly once, from the loop:
        on the reply, on an error reply (error set), on timeout, or when refused."""
        if self.closed:   # dropped or evicted since the caller got it: use the current one
            return self.server.peer(self.address).request(op, fields, frames, timeout_s, callback)
        req_id = next(self._ids)
        self.last_used = time.monotonic()
        parts = [wire.request(op, req_id, fields), *frames]
        size = sum(map(len, parts))
        if self.broken is not None or self.unsent_bytes + size > PEER_UNSENT_BYTES_MAX:
            self.refused.append(callback)   # not now: callers do not expect a re-entrant call
            return req_id
        self.pending[req_id] = (self.last_used + timeout_s, callback)
        self.unsent.append((req_id, parts, size))
        self.unsent_bytes += size
        self.send_unsent()
        return req_id

    def send_unsent(self) -> None:
        while self.unsent:
            req_id, parts, size = self.unsent[0]
            if req_id in self.pending:  # else timed out before it could be sent
                try:
                    send_frames(self.sock, parts)
                except zmq.Again:
                    return  # not connected yet, or queue full: next loop turn
            self.unsent.popleft()
            self.unsent_bytes -= size

    def on_readable(self) -> None:
        for _ in range(MAX_BATCH_MESSAGES):
            if self.closed:   # by a callback of the previous reply
                return
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
            if header.get("ok") is True:
                self.server.guarded(entry[1], header, parts[1:], None)
            else:
                try:
                    wire.raise_for_reply(header)
                except KeraError as err:
                    self.server.guarded(entry[1], None, None, err)

    def expire(self, now: float) -> None:
        self.send_unsent()
        refused, self.refused = self.refused, []
        for callback in refused:
            self.server.guarded(callback, None, None, self._refusal())
        if not self.pending:
            return
        late = [rid for rid, (deadline, _) in self.pending.items() if deadline <= now]
        for rid in late:
            entry = self.pending.pop(rid, None)   # None: a callback closed this peer
            if entry is None:
                continue
            callback = entry[1]
            self.server.guarded(callback, None, None, Timeout(f"no reply from {self.address}"))
        if not self.pending:
            self.unsent.clear()
            self.unsent_bytes = 0

    def _refusal(self) -> KeraError:
        if self.broken is not None:
            return PeerUnreachable(self.broken)
        return Throttled(f"more than {PEER_UNSENT_BYTES_MAX} bytes already wait for {self.address}")

    def close(self) -> None:
        callbacks = [cb for _, cb in self.pending.values()] + self.refused
        self.pending.clear()
        self.refused = []
        self.unsent.clear()
        self.unsent_bytes = 0
        if self.sock is not None:
            self.sock.close(linger=0)
        for callback in callbacks:
            self.server.guarded(callback, None, None, Timeout(f"connection to {self.address} closed"))


def _dealer(ctx: zmq.Context, address: str, security: Security | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    try:
        if security is not None:
            keys.secure_client(sock, security.identity, security.server.public)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, PEER_HWM_MESSAGES)
        sock.setsockopt(zmq.RCVHWM, PEER_HWM_MESSAGES)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        sock.copy_threshold = ZERO_COPY_MIN_BYTES
        sock.connect(f"tcp://{address}")
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


class Server:
    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0,
                 security: Security | None = None,
                 frame_bytes_max: int = wire.MAX_FRAME_BYTES):
        """`frame_bytes_max`: the largest frame a peer may send before zmq drops it; a daemon
        that takes no chunks (the coordinator) sets it far below a broker's, and then no
        request of it is larger either (`message_bytes_max`)."""
        self.name = name
        self.security = security
        # A secure daemon has a context of its own: ZeroMQ allows one ZAP handler per context.
        self.ctx = zmq.Context() if security else zmq.Context.instance()
        self.zap: ZapHandler | None = None
        # Who may call what (kera.net.access); None in plaintext, where every caller is trusted.
        self.guard: Guard | None = None
        self.router = self.ctx.socket(zmq.ROUTER)
        if security is not None:
            self._secure()
        else:
            warn_if_open(name, host)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, frame_bytes_max)
        self.frame_bytes_max = frame_bytes_max
        # zmq bounds frames, not messages: a connection holding more than a message's worth
        # of an incomplete one is cut (kera.net.inflow).
        self.inflow = InflowWatch(self.router, name, self.message_bytes_max + UNREAD_SLACK_BYTES)
        self.router.setsockopt(zmq.RCVHWM, ROUTER_HWM_MESSAGES)
        self.router.setsockopt(zmq.SNDHWM, ROUTER_HWM_MESSAGES)
        self.router.copy_threshold = ZERO_COPY_MIN_BYTES
        self.port = self._bind(host, port)
        self.inflow.bound(self.port)
        self.host = host
        self.handlers: dict[str, Callable[[Request], object]] = {}
        self.after_batch: list[Callable[[], None]] = []
        # Hooks run at the end of every loop turn, after peer callbacks and timers: a broker acts
        # on replication acks, a backup on its worker threads' completions, without waiting for
        # the next request batch.
        self.after_turn: list[Callable[[], None]] = []
        self.peers: dict[str, Peer] = {}    # in order of last use (least recent first)
        self._timers: list = []
        self._timer_seq = itertools.count()
        # Monotonic times a turn must run by (wake_at): the poll waits no longer.
        self._wakes: list[float] = []
        self._stopping = False
        # How long closing waits for replies still queued (a daemon that fail-stops on purpose
        # raises it so its last error replies reach their callers; 0: drop them).
        self.close_linger_ms = 0
        # The unexpected exception that stopped the daemon (a bug); its process exits non-zero.
        self.failure: BaseException | None = None
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        # Plain sockets served on the same loop (the broker's Kafka listener): fd -> callback
        # taking the poll event mask.
        self._watched: dict[int, Callable[[int], None]] = {}
        if self.zap is not None:
            self.poller.register(self.zap.zap_socket, zmq.POLLIN)
        if self.inflow.monitor is not None:
            self.poller.register(self.inflow.monitor, zmq.POLLIN)

    def _bind(self, host: str, port: int) -> int:
        """Bind the router (to `port`, else a free one); closes what it made when it cannot
        (a standby coordinator retries while the port is still held)."""
        try:
            if port:
                self.router.bind(f"tcp://{host}:{port}")
                return port
            return self.router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self.inflow.close()
            self.router.close(linger=0)
            if self.zap is not None:
                self.zap.stop()
            raise

    def _secure(self) -> None:
        """CURVE on the listening socket, before it binds, with the ZAP handler in place."""
        self.zap = ZapHandler(self.ctx, self.security.keyring())
        self.zap.start()
        keys.secure_server(self.router, self.security.server)
        self.router.setsockopt(zmq.HANDSHAKE_IVL, CURVE_HANDSHAKE_MS)
        self.guard = Guard(daemon=self.name)
        log.info("%s: CURVE on, as %s; callers must hold a key under %s", self.name,
                 self.security.identity.name, self.security.keys_dir)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def message_bytes_max(self) -> int:
        return message_bytes_max(self.frame_bytes_max)

    # ------------------------------------------------------------------ registration
    def on(self, op: str, handler: Callable[[Request], object]) -> None:
        self.handlers[op] = handler

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + interval_s, next(self._timer_seq), fn, interval_s))

    def wake_at(self, t: float) -> None:
        """Run a turn (and so the after_turn hooks) by monotonic time `t`, even if nothing
        arrives: for a deadline a hook acts on (a broker's held fetches)."""
        heapq.heappush(self._wakes, t)

    def watch(self, fd: int, on_event: Callable[[int], None], events: int = zmq.POLLIN) -> None:
        """Serve a plain socket on this loop: `on_event(mask)` runs, guarded, whenever it is
        ready for `events` (zmq.POLLIN, zmq.POLLOUT); called again to change the events."""
        self._watched[fd] = on_event
        self.poller.register(fd, events)

    def unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is not None:
            try:
                self.poller.unregister(fd)
            except KeyError:
                pass   # watched for no events (zmq.Poller.register with 0 unregisters)

    def peer(self, address: str) -> Peer:
        """The connection to `address`, opened on first use. An address zmq rejects gives a
        peer whose requests fail with PeerUnreachable; so does a new address while PEERS_MAX
        peers are all busy."""
        peer = self.peers.pop(address, None)
        if peer is None:
            self._make_room()
            refused = None
            if len(self.peers) >= PEERS_MAX:
                refused = (f"all {PEERS_MAX} connections to other daemons are busy; {address} "
                           f"was not connected (retry once requests complete)")
            peer = Peer(self, address, refused)
            if peer.broken is None:
                self.poller.register(peer.sock, zmq.POLLIN)
        self.peers[address] = peer   # (re)inserted last: the most recently used
        return peer

    def _make_room(self) -> None:
        if len(self.peers) < PEERS_MAX:
            return
        for address, peer in self.peers.items():   # least recently used first
            if peer.idle:
                log.info("%s: closing idle connection to %s (%d peers)", self.name, address, PEERS_MAX)
                self.drop_peer(address)
                return

    def close_idle_peers(self, keep: set[str]) -> None:
        """Close the connections to daemons not in `keep` that nothing waits on (a departed
        daemon's pending requests time out first)."""
        for address, peer in list(self.peers.items()):
            if address not in keep and peer.idle:
                self.drop_peer(address)

    def reconnect(self, address: str, peer) -> None:
        """Close `peer`, the connection to `address` a request went out on, unless it was
        replaced since: the next request to `address` opens a fresh one."""
        if self.peers.get(address) is peer:
            self.drop_peer(address)

    def drop_peer(self, address: str) -> None:
        """Close the connection to a daemon that left; its pending requests time out now."""
        peer = self.peers.pop(address, None)
        if peer is not None:
            if peer.broken is None:
                self.poller.unregister(peer.sock)
            peer.close()

    def share(self, payloads: list[list]) -> list[list]:
        """`payloads` ready to send, the ones sent to several peers made once (share_payloads)."""
        return share_payloads(payloads)

    # ------------------------------------------------------------------ replies
    def reply(self, req: Request, fields: dict | None = None, frames=()) -> None:
        self._send(req.identity, wire.ok_reply(req.id, fields), frames)

    def fail(self, req: Request, err: KeraError) -> None:
        self._send(req.identity, wire.error_reply(req.id, err), ())

    def _send(self, identity: bytes, header: bytes, frames) -> None:
        try:
            send_frames(self.router, [identity, header, *frames])
        except zmq.Again:
            log.warning("%s: reply dropped, client queue full", self.name)

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stopping = True

    @property
    def stopping(self) -> bool:
        """stop() was called (by a signal, the daemon, or a bug): a loop of its own ends."""
        return self._stopping

    def run(self) -> None:
        """Serve until stopped; `failure` tells whether a bug stopped it."""
        log.info("%s serving on %s", self.name, self.address)
        try:
            while not self._stopping:
                self.run_once()
        finally:
            self.close()

    def run_once(self, max_wait_s: float = 0.05) -> None:
        if self.failure is not None:
            return   # a bug: nothing more runs on the state it may have broken
        now = time.monotonic()
        # Connections are checked for incomplete messages often enough to bound what one
        # gathers between checks (kera.net.inflow).
        wait = min(max_wait_s, CHECK_INTERVAL_S) if self.inflow.conns else max_wait_s
        if self._timers:
            wait = max(0.0, min(wait, self._timers[0][0] - now))
        wakes = self._wakes
        while wakes and wakes[0] <= now:
            heapq.heappop(wakes)
        if wakes:
            wait = max(0.0, min(wait, wakes[0] - now))
        if any(peer.unsent or peer.refused for peer in self.peers.values()):
            wait = min(wait, 0.002)  # a connection is coming up: retry its first sends soon
        events = dict(self.poller.poll(int(wait * 1000)))
        if self.zap is not None and self.zap.zap_socket in events:
            self.guarded(self.zap.on_readable)
        inflow = self.inflow
        if inflow.monitor is not None and inflow.monitor in events:
            inflow.on_events()
        if self.router not in events or self._drain_router():
            inflow.check(time.monotonic())
        for fd, mask in events.items() if self._watched else ():
            on_event = self._watched.get(fd) if type(fd) is int else None
            if on_event is not None:
                self.guarded(on_event, mask)
        if self.failure is not None:
            return   # a bug: nothing more runs on the state it may have broken
        # A callback may drop peers (Server.drop_peer): a closed one is skipped.
        for peer in list(self.peers.values()):
            if peer.broken is None and peer.sock in events and not peer.closed:
                peer.on_readable()
        now = time.monotonic()
        for peer in list(self.peers.values()):
            if not peer.closed:
                peer.expire(now)
        self._run_timers(now)
        for hook in self.after_turn:
            self.guarded(hook)

    def _drain_router(self) -> bool:
        """Read and handle up to MAX_BATCH_MESSAGES; whether every whole message waiting was
        read (so what connections hold now is incomplete messages: kera.net.inflow)."""
        drained = False
        for _ in range(MAX_BATCH_MESSAGES):
            try:
                parts = self._recv_message()
            except zmq.Again:
                drained = True
                break
            if parts is not None:
                self._dispatch(parts)
            if self.failure is not None:
                return False
        for hook in self.after_batch:
            self.guarded(hook)
        return drained

    def _recv_message(self) -> list | None:
        """One whole message, read frame by frame so its size and frame count are checked
        before the rest of it is kept: an over-limit message is read to its end, dropped and
        answered with one error (None returned). Raises zmq.Again when nothing is waiting.

        zmq hands over a multipart message only once all of it has arrived, buffering every
        frame until then: what it holds of one message is bounded by kera.net.inflow (which
        counts the message read here against its connection), not here."""
        frame = self.router.recv(copy=False, flags=zmq.NOBLOCK)
        parts, size, more = [frame], 0, frame.more
        size_max = self.message_bytes_max
        while more:
            frame = self.router.recv(copy=False)   # the rest of a message is already queued
            more = frame.more
            parts.append(frame)
            size += len(frame)
            if len(parts) - 2 > wire.MAX_FRAMES or size > size_max:
                frames_total = len(parts) + self._discard_rest(more)
                self.inflow.read_from(frame)
                self._refuse_oversized(parts, size, frames_total)
                return None
        self.inflow.read_from(frame)
        return parts

    def _discard_rest(self, more: bool) -> int:
        dropped = 0
        while more:
            more = self.router.recv(copy=False).more
            dropped += 1
        return dropped

    def _refuse_oversized(self, parts: list, size: int, frames_total: int) -> None:
        log.warning("%s: refused a message of %d frames (over %d payload frames or %d bytes)",
                    self.name, frames_total, wire.MAX_FRAMES, self.message_bytes_max)
        req_id = None
        try:
            req_id = wire.request_id_of(wire.unpack_header(parts[1].buffer))
        except BadRequest:
            pass
        err = BadRequest(f"message of {frames_total} frames is over the limit of "
                         f"{wire.MAX_FRAMES} payload frames and {self.message_bytes_max} bytes")
        self._send(parts[0].bytes, wire.error_reply(req_id, err), ())

    def _dispatch(self, parts: list) -> None:
        if len(parts) < 2:
            return  # no header frame: nothing to answer
        identity = parts[0].bytes
        req_id = None
        try:
            header = wire.unpack_header(parts[1].buffer, wire.REQUEST_CONTAINERS_MAX)
            req_id = wire.request_id_of(header)
            fields, op, handler = wire.request_envelope(header, self.handlers)
            req = Request(identity, req_id, op, fields, parts[2:])
            if self.guard is not None:
                req.principal = principal_of(parts[1])
                _check_current(self.zap, parts[1], req.principal)
                self.guard.admit(req.principal, op, header)
            result = handler(req)
        except KeraError as err:
            self._send(identity, wire.error_reply(req_id, err), ())
            return
        except Exception as exc:
            self._send(identity, wire.error_reply(req_id, KeraError(
                f"internal error in {self.name}, which is stopping: {exc.__class__.__name__}: {exc}")), ())
            self._fatal(exc, "handling a request")
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
            self.guarded(fn)
            heapq.heappush(self._timers, (now + interval, next(self._timer_seq), fn, interval))

    def guarded(self, fn: Callable, *args) -> None:
        """Run a timer, hook or peer callback inside the error boundary: a KeraError (nobody to
        answer) is logged; anything else is a bug and stops the daemon (after which nothing
        more runs)."""
        if self.failure is not None:
            return
        try:
            fn(*args)
        except KeraError as err:
            log.warning("%s: %s failed: %s: %s", self.name, _name(fn), err.code, err.message)
        except Exception as exc:
            self._fatal(exc, f"in {_name(fn)}")

    def _fatal(self, exc: BaseException, where: str) -> None:
        log.critical("%s: unexpected error %s: stopping (this is a bug)", self.name, where,
                     exc_info=exc)
        if self.failure is None:
            self.failure = exc
        self.stop()

    def close(self) -> None:
        for address in list(self.peers):
            self.drop_peer(address)
        linger_ms = self.close_linger_ms if self.failure is None else FAILURE_REPLY_LINGER_MS
        if self.inflow.monitor is not None:
            self.poller.unregister(self.inflow.monitor)
        self.inflow.close()   # before the router (InflowWatch.close)
        self.router.close(linger=linger_ms)
        if self.zap is not None:
            self.poller.unregister(self.zap.zap_socket)
            self.zap.stop()
            self.zap = None


def message_bytes_max(frame_bytes_max: int) -> int:
    """The largest request a daemon takes, all frames: a daemon whose frames are bounded
    below a chunk takes headers alone (the coordinator), others a replication write."""
    if frame_bytes_max < wire.MAX_FRAME_BYTES:
        return frame_bytes_max
    return wire.MESSAGE_BYTES_MAX


def _check_current(zap: ZapHandler | None, frame, principal) -> None:
    """A connection authenticated by a key since deleted or replaced is served no more."""
    if zap is None or principal is None:
        return
    key = key_of(frame)
    if key is None or not zap.keyring.holds(key, principal):
        raise NotAuthorized(f"the key of {principal} was revoked: this connection is no "
                            f"longer served; connect again with a current key")


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
