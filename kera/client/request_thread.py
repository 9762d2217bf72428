"""The one request-thread shell under every client: producer, consumer, and Spark's reader and
sink through them.

A client's application threads hand work to one RequestThread through the client's sans-IO
bookkeeping (producer/pipeline.py, consumer/fetching.py, consumer/tasks.py) and wake it with a
byte on its Waker pipe. The thread owns one kera.net.rpc.Connection per address (zmq sockets are not
thread-safe) whatever the number of streams, sleeps in one zmq poll over them and the pipe, and
keeps the client's stream descriptors fresh: a subclass says which streams need asking about
again (`want_describe`), the shell sends `describe_stream` to the coordinator on its own
connection as kera.client.stream_cache.StreamCache allows and hands the answers to `on_stream`.

A subclass supplies one loop turn (`turn`: build and send requests, return when it next wants to
run), the replies (`on_replies`), what a stream refresh found (`on_stream`), when to stop, and
what to do if the thread dies.
"""

from __future__ import annotations

import logging
import os
import threading

import zmq

from kera.client.env import ClientEnv, Transport
from kera.errors import BadRequest, KeraError, Timeout
from kera.client.metadata import Metadata
from kera.codec.schema import StreamInfo

log = logging.getLogger(__name__)

# How long a send may wait for a connection to accept a request (a new connection needs a
# moment for its handshake; a dead peer must not stall the other peers' requests long).
SEND_WAIT_S = 0.5


class Waker:
    """A pipe an application thread writes a byte to, to end the request thread's poll early."""

    def __init__(self):
        self.fd_r, self.fd_w = os.pipe()
        os.set_blocking(self.fd_r, False)
        os.set_blocking(self.fd_w, False)

    def wake(self) -> None:
        if self.fd_w < 0:
            return
        try:
            os.write(self.fd_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # full (wake-ups already pending) or closed

    def drain(self) -> None:
        try:
            os.read(self.fd_r, 4096)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        fds, self.fd_r, self.fd_w = (self.fd_r, self.fd_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


class RequestThread(threading.Thread):
    def __init__(self, name: str, meta: Metadata, waker: Waker, *, request_timeout_s: float,
                 key_file: str | None, idle_poll_ms: int, env: ClientEnv | None = None):
        super().__init__(name=name, daemon=True)
        self.env = env = env or ClientEnv()
        self.clock = env.clock
        self.meta = meta
        self.waker = waker
        self.request_timeout_s = request_timeout_s
        self.key_file = key_file
        self.idle_poll_ms = idle_poll_ms   # nothing to wait for: look around this often anyway
        self.conns: dict[str, Transport] = {}
        self.poller = zmq.Poller()
        if getattr(waker, "fd_r", None) is not None:
            self.poller.register(waker.fd_r, zmq.POLLIN)

    # ------------------------------------------------------------------ subclass hooks
    def turn(self, now: float) -> float | None:
        """Do one turn of work (build and send requests); return when to run again, or None."""
        raise NotImplementedError

    def on_replies(self, replies: list[tuple[str, dict, list]]) -> None:
        """Replies (address, header, frames) that are not the shell's own."""
        raise NotImplementedError

    def on_stream(self, name: str, result: StreamInfo | KeraError) -> None:
        """What the coordinator said of a stream `want_describe` asked about."""

    def stopping(self) -> bool:
        raise NotImplementedError

    def on_crash(self, exc: BaseException) -> None:
        """The loop raised: tell the application threads (the thread then exits)."""

    def on_exit(self) -> None:
        """The loop ended (stopped or crashed); the connections are closed after this."""

    # ------------------------------------------------------------------ the loop
    def start_engine(self) -> None:
        """Start the loop the way the environment runs it (a thread, or a simulated process
        that calls `step` and `deliver`)."""
        self.env.start(self)

    def step(self) -> float | None:
        """One turn, then the describe requests due: when the next turn is wanted (or None)."""
        wake = self.turn(self.clock())
        return _earliest(wake, self._send_describes(self.clock()))

    def run(self) -> None:
        try:
            while not self.stopping():
                self._sleep_and_receive(self.step())
        except BaseException as exc:  # noqa: BLE001 - reported to the application threads
            log.exception("%s failed", self.name)
            self.on_crash(exc)
        finally:
            try:
                self.on_exit()
            finally:
                for conn in self.conns.values():
                    conn.close()

    def _sleep_and_receive(self, wake: float | None) -> None:
        if wake is None:
            timeout_ms = self.idle_poll_ms
        else:
            timeout_ms = max(0, min(self.idle_poll_ms, int((wake - self.clock()) * 1000) + 1))
        events = dict(self.poller.poll(timeout_ms))
        if events.pop(self.waker.fd_r, None):
            self.waker.drain()
        if events:
            self._receive(events)

    # ------------------------------------------------------------------ connections
    def conn(self, address: str) -> Transport:
        conn = self.conns.get(address)
        if conn is None:
            conn = self.conns[address] = self.env.connect(address, self.request_timeout_s,
                                                          self.key_file)
            if getattr(conn, "sock", None) is not None:   # a real socket: polled by `run`
                self.poller.register(conn.sock, zmq.POLLIN)
        return conn

    def send(self, address: str, op: str, fields: dict | None = None, frames=()) -> int:
        """Send a request; its reply comes to `on_replies`. Raises Timeout when the peer does
        not take it within SEND_WAIT_S (or KeraError for an address zmq cannot use)."""
        return self.conn(address).send(op, fields, frames, timeout_s=SEND_WAIT_S)

    def _receive(self, events: dict) -> None:
        replies = []
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
                replies.append((address, header, frames))
        self.deliver(replies)

    def deliver(self, replies: list[tuple[str, dict, list]]) -> None:
        """Replies received: the shell's own describe replies, the rest to `on_replies`."""
        coordinators = self.meta.coordinators.addresses
        rest = [r for r in replies if r[0] not in coordinators or not self._on_describe(r[1])]
        if rest:
            self.on_replies(rest)

    # ------------------------------------------------------------------ stream descriptors
    def want_describe(self, names) -> None:
        """Ask the coordinator about these streams again (throttled by the cache)."""
        now = self.clock()
        with self.meta.lock:
            for name in names:
                self.meta.cache.want(name, now)

    def _send_describes(self, now: float) -> float | None:
        meta = self.meta
        with meta.lock:
            reqs = meta.cache.requests(now)
        for req in reqs:
            try:
                req_id = self.send(req.address, "describe_stream", req.fields)
            except KeraError as err:   # coordinator unreachable: asked again later
                log.info("cannot ask %s about stream '%s': %s", req.address, req.name, err)
                with meta.lock:
                    meta.cache.failed(req, now)
            else:
                with meta.lock:
                    meta.cache.sent(req, req_id, now)
        with meta.lock:
            return meta.cache.next_wake(now)

    def _on_describe(self, header: dict) -> bool:
        with self.meta.lock:
            found = self.meta.cache.on_reply(header, self.clock())
        if found is None:
            return False
        name, result = found
        if isinstance(result, KeraError) and result.retriable:
            log.info("describe_stream '%s' failed: %s; asking again", name, result)
        self.on_stream(name, result)
        return True


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
