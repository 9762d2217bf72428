"""One Kafka client connection: length-prefixed requests in, responses out in request order.

Kafka answers a connection's requests in the order they came, even when a later one (a
metadata request) is ready before an earlier one (a produce waiting for replication): each
request takes a slot in the connection's reply queue when it arrives, and replies leave from
the head of the queue only. Memory is bounded from both sides: a request's size is checked
from its length prefix before its bytes are kept, and a connection stops being read while it
has `REQUESTS_IN_FLIGHT_MAX` requests unanswered or `REPLY_BYTES_QUEUED_MAX` bytes of replies
its client has not taken (a slow reader slows itself, not the broker).

With a TLS context (a secure cluster's SASL_SSL listener) the socket is wrapped, and its
handshake runs on the loop like any other read or write: it asks for whichever readiness
OpenSSL wants next and never blocks; the listener closes a connection whose handshake and
SASL login are not done within its bound (kera.broker.kafka.listener).
"""

from __future__ import annotations

import collections
import errno
import logging
import socket
import ssl
import struct

import zmq

from kera.codec.chunk import MAX_CHUNK_BYTES

log = logging.getLogger(__name__)

# Kafka's socket.request.max.bytes: a request larger is refused from its length prefix. One
# chunk (kera.codec.chunk.MAX_CHUNK_BYTES) plus room for the request's own fields: no larger
# Produce could be stored anyway.
REQUEST_BYTES_MAX = MAX_CHUNK_BYTES + (1 << 20)
# Requests of one connection read and not yet answered; past it the socket is not read (Kafka
# clients keep at most 5 in flight by default, max.in.flight.requests.per.connection).
REQUESTS_IN_FLIGHT_MAX = 64
# Reply bytes a connection's client has not taken yet; past it the socket is not read.
REPLY_BYTES_QUEUED_MAX = 64 << 20
# Bytes taken from the socket per readiness event: one large produce in a few reads, and no
# connection holds the loop long.
READ_BYTES = 1 << 20
# Bytes handed to one TLS write: OpenSSL retries a write that would block with the same bytes,
# so each attempt takes a bounded slice of the head of the queue (16 TLS records).
TLS_SEND_BYTES = 256 << 10
# Buffers handed to one plain sendmsg (scatter/gather): the queued replies, a Fetch's records
# among them, go out without being copied into one buffer first; Linux takes up to 1024
# (IOV_MAX), and 64 small replies fill a write anyway.
SEND_BUFFERS_MAX = 64
# What a non-blocking socket raises when it cannot go on now; TLS adds OpenSSL's two, which
# also come from a read that needs a write (a key update) and the reverse.
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_SIZE = struct.Struct(">i")
PENDING = None   # a reply slot whose answer is not ready yet
SILENT = b""     # a request answered with nothing (a Produce with acks=0)


class Framer:
    """Sans-IO: bytes in, whole request frames out; ValueError for a length prefix that is
    negative or over `REQUEST_BYTES_MAX`."""

    def __init__(self, request_bytes_max: int = REQUEST_BYTES_MAX):
        self.request_bytes_max = request_bytes_max
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        frames = []
        while len(self.buf) >= 4:
            size = _SIZE.unpack_from(self.buf, 0)[0]
            if size < 0 or size > self.request_bytes_max:
                raise ValueError(f"request of {size} bytes: at most {self.request_bytes_max} "
                                 f"(socket.request.max.bytes)")
            if len(self.buf) < 4 + size:
                break
            frames.append(bytes(self.buf[4:4 + size]))
            del self.buf[:4 + size]
        return frames


class Slot:
    """A request's place in its connection's reply queue."""
    __slots__ = ("reply",)

    def __init__(self):
        self.reply: bytes | list | None = PENDING   # bytes, or buffers to send in order


class Outbox:
    """Sans-IO: reply bytes not sent yet, as a queue of buffers kept by reference (a reply's
    parts, kera.broker.kafka.messages.encode_parts), taken from the head as they are sent."""
    __slots__ = ("buffers", "size")

    def __init__(self):
        self.buffers: collections.deque[memoryview] = collections.deque()
        self.size = 0       # bytes queued

    def __len__(self) -> int:
        return self.size

    def add(self, reply: bytes | list) -> None:
        for part in ((reply,) if isinstance(reply, (bytes, bytearray)) else reply):
            if len(part):
                self.buffers.append(memoryview(part))
                self.size += len(part)

    def head(self, count: int) -> list[memoryview]:
        """The first `count` buffers at most."""
        return [self.buffers[i] for i in range(min(count, len(self.buffers)))]

    def sent(self, n: int) -> None:
        """Drop the first `n` bytes, sent."""
        self.size -= n
        while n:
            first = self.buffers[0]
            if n < len(first):
                self.buffers[0] = first[n:]
                return
            n -= len(first)
            self.buffers.popleft()


class Connection:
    """The shell of one accepted socket, served on the broker's loop (kera.net.server.Server.watch)."""

    def __init__(self, sock: socket.socket, peer: str, server, on_frame, on_close,
                 tls: ssl.SSLContext | None = None):
        sock.setblocking(False)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        self.sock = sock
        self.tls = tls is not None
        self.handshaking = self.tls     # the TLS handshake is not done yet
        self.peer = peer                # "host:port" of the client
        self.server = server
        self.on_frame = on_frame        # (connection, frame bytes) -> None
        self.on_close = on_close        # (connection) -> None
        self.framer = Framer()
        self.slots: collections.deque[Slot] = collections.deque()
        self.out = Outbox()
        self.closed = False
        self.finishing: str | None = None   # why it closes once its replies are sent
        self.state: dict = {}           # what the protocol keeps per connection (SASL, producer ids)
        self._events = zmq.POLLIN
        server.watch(sock.fileno(), self.on_event, self._events)

    def reserve(self) -> Slot:
        slot = Slot()
        self.slots.append(slot)
        return slot

    def fill(self, slot: Slot, reply: bytes | list) -> None:
        """Answer a slot (SILENT: no bytes; a list: buffers sent in order, kept by reference)
        and send what the queue's head allows."""
        slot.reply = reply
        if not self.closed:
            self._flush()

    def close_after_replies(self, why: str) -> None:
        """Read no more; close once every reply queued so far is sent (a refused login: the
        client reads why before the connection goes)."""
        self.finishing = why
        self._flush()

    def on_event(self, mask: int) -> None:
        if self.closed:
            return
        if self.handshaking:
            self._handshake()
            return
        if mask & zmq.POLLOUT:
            self._send_out()
            self._finish_if_sent()
        if mask & zmq.POLLIN and not self.closed and self.finishing is None:
            self._read()
        self._update_events()

    def _handshake(self) -> None:
        """One step of the TLS handshake: on, or waiting for what OpenSSL asks for."""
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(zmq.POLLIN)
            return
        except ssl.SSLWantWriteError:
            self._watch(zmq.POLLOUT)
            return
        except (ssl.SSLError, OSError) as exc:
            self.close(f"TLS handshake failed: {exc}")
            return
        self.handshaking = False
        self._read()    # the first request may have come with the handshake's last message
        self._update_events()

    def _recv(self) -> bytes:
        """Up to READ_BYTES (b"": closed by the client); raises one of _WOULD_BLOCK when
        nothing is there yet. TLS gives one record (16 KiB) a call: read on while records are,
        and always to the end of the last one, whose rest OpenSSL would hold where no poll
        sees it."""
        data = self.sock.recv(READ_BYTES)
        if not self.tls or not data:
            return data
        parts = [data]
        size = len(data)
        while True:
            want = READ_BYTES - size if size < READ_BYTES else self.sock.pending()
            if want <= 0:
                break
            try:
                more = self.sock.recv(want)
            except _WOULD_BLOCK:
                break
            if not more:
                break
            parts.append(more)
            size += len(more)
        return b"".join(parts)

    def _read(self) -> None:
        try:
            data = self._recv()
        except _WOULD_BLOCK:
            return
        except OSError as exc:   # ssl.SSLError included: a broken or forged record
            self.close(f"read failed: {exc}")
            return
        if not data:
            self.close("closed by the client")
            return
        try:
            frames = self.framer.feed(data)
        except ValueError as exc:
            self.close(str(exc))
            return
        for frame in frames:
            if self.closed or self.finishing is not None:
                return
            self.on_frame(self, frame)

    def _flush(self) -> None:
        while self.slots and self.slots[0].reply is not PENDING:
            self.out.add(self.slots.popleft().reply)
        self._send_out()
        self._finish_if_sent()
        self._update_events()

    def _finish_if_sent(self) -> None:
        if self.finishing is not None and not self.slots and not self.out:
            self.close(self.finishing)

    def _send_out(self) -> None:
        while self.out:
            try:
                if self.tls:
                    sent = self.sock.send(self.out.head(1)[0][:TLS_SEND_BYTES])
                else:
                    sent = self.sock.sendmsg(self.out.head(SEND_BUFFERS_MAX))
            except _WOULD_BLOCK:
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self.close(f"write failed: {exc}")
                return
            self.out.sent(sent)

    def _update_events(self) -> None:
        if self.closed or self.handshaking:
            return
        events = zmq.POLLOUT if self.out else 0
        if len(self.slots) < REQUESTS_IN_FLIGHT_MAX and len(self.out) < REPLY_BYTES_QUEUED_MAX \
                and self.finishing is None:
            events |= zmq.POLLIN
        self._watch(events)

    def _watch(self, events: int) -> None:
        if events != self._events:
            self._events = events
            self.server.watch(self.sock.fileno(), self.on_event, events)

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        log.debug("kafka connection from %s closed: %s", self.peer, why)
        self.server.unwatch(self.sock.fileno())
        self.sock.close()
        self.slots.clear()
        self.on_close(self)
