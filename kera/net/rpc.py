"""Client side of the wire: one DEALER connection to one daemon, with timeouts on every wait.

A Connection belongs to one thread (zmq sockets are not thread-safe). `call` is a blocking
request/reply; `send` + `recv` let a caller keep a window of requests in flight and match the
replies by id.
"""

from __future__ import annotations

import itertools
import os
import time

import zmq

from kera.net import keys as keyfiles
from kera.codec import wire
from kera.errors import ClientClosed, PeerUnreachable, Timeout
from kera.net.probe import probe

DEFAULT_TIMEOUT_S = 10.0
# Whole messages queued per connection each way: a client keeps a window of a few requests in
# flight (producers 4 per broker, consumers one fetch per broker), so this is far above need.
CLIENT_HWM_MESSAGES = 10_000
# A first contact whose connection is not up after this long is probed over plain TCP
# (kera.net.probe), so a refused port or an unknown host is named in well under a second
# rather than after the whole request timeout. zmq connects to a live daemon in milliseconds.
FIRST_CONTACT_PROBE_AFTER_S = 0.3


def context() -> zmq.Context:
    return zmq.Context.instance()


class Connection:
    """`key_file` (else $KERA_KEY_FILE, else plaintext): connect with CURVE as that key's
    principal, trusting only the cluster key the file names (kera.net.keys)."""

    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 ctx: zmq.Context | None = None, key_file: str | None = None,
                 probe_after_s: float | None = None):
        self.address = address
        # Set for a first contact (a client's bootstrap): a connection not up after this long
        # is probed once, and a refused or unresolvable address raised at once.
        self.probe_after_s = probe_after_s
        self.timeout_s = timeout_s
        keys = keyfiles.client_keys(key_file)
        self.secure = keys is not None
        self.sock = (ctx or context()).socket(zmq.DEALER)
        if keys is not None:
            keyfiles.secure_client(self.sock, keys)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a peer that is not connected: a send to a dead daemon waits for
        # POLLOUT and times out, instead of piling up messages delivered after a restart.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RCVHWM, CLIENT_HWM_MESSAGES)
        self.sock.setsockopt(zmq.SNDHWM, CLIENT_HWM_MESSAGES)
        # A daemon (or anything at that address) cannot make the client buffer a frame larger
        # than any reply has: zmq disconnects instead.
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        try:
            self.sock.connect(f"tcp://{address}")
        except zmq.ZMQError as exc:   # an address zmq cannot parse or resolve
            self.sock.close(linger=0)
            raise PeerUnreachable(f"cannot connect to {address!r}: {exc}") from None
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 16)
        self._closed = False

    def send(self, op: str, fields: dict | None = None, frames=(), timeout_s: float | None = None) -> int:
        """Send one request; returns its id. Raises Timeout if the daemon cannot take it."""
        if self._closed:
            raise ClientClosed(f"connection to {self.address} is closed")
        req_id = next(self._ids)
        wait_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        if not self._writable(wait_ms):
            raise Timeout(f"{self.address} is not accepting requests ({op}) after {wait_ms} ms"
                          f"{self._hint()}")
        self._send_now(op, [wire.request(op, req_id, fields), *frames])
        return req_id

    def _writable(self, wait_ms: int) -> bool:
        """Whether a request can go within wait_ms; PeerUnreachable once a first contact's
        probe finds nothing listening (a request is only queued once connected: IMMEDIATE)."""
        if self.probe_after_s is None:
            return bool(self.sock.poll(wait_ms, zmq.POLLOUT))
        first_ms = min(wait_ms, int(1000 * self.probe_after_s))
        if self.sock.poll(first_ms, zmq.POLLOUT):
            return True
        self.probe_after_s = None   # once: a live daemon that is slow is simply waited for
        probe(self.address)
        return bool(self.sock.poll(wait_ms - first_ms, zmq.POLLOUT))

    def _send_now(self, op: str, msg: list) -> None:
        """Send without waiting. The daemon can go away between POLLOUT and the send (killed,
        or its host cut off); with IMMEDIATE zmq then refuses the message, and rolls back any
        parts it took, so nothing of it is delivered: say the peer is unreachable."""
        try:
            self.sock.send_multipart(msg, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise PeerUnreachable(f"{self.address} went away while {op} was being sent; "
                                  "it was not sent") from None

    def recv(self, timeout_s: float | None = None) -> tuple[dict, list]:
        """The next reply (header, payload frames), or Timeout."""
        wait_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        if not self.sock.poll(wait_ms, zmq.POLLIN):
            raise Timeout(f"no reply from {self.address} within {wait_ms} ms{self._hint()}")
        parts = self.sock.recv_multipart(copy=False)
        return wire.unpack_header(parts[0].buffer, wire.REPLY_CONTAINERS_MAX), parts[1:]

    def call(self, op: str, fields: dict | None = None, frames=(), timeout_s: float | None = None
             ) -> tuple[dict, list]:
        """Request and wait for its reply; raises the KeraError an error reply carries."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        req_id = self.send(op, fields, frames, budget)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no reply from {self.address} to {op} within {budget:.1f} s")
            header, payload = self.recv(left)
            if header.get("id") == req_id:
                return wire.raise_for_reply(header), payload
            # A late reply to an earlier request that timed out: drop it.

    def _hint(self) -> str:
        """A refused CURVE handshake looks like a daemon that never answers: say so."""
        if self.secure:
            return (" (secure connection: if the daemon is up, check that this key's public half"
                    " is in the cluster's keys directory and the key file names its cluster key)")
        return (" (if the cluster runs with CURVE security, pass a key: key_file=, --key-file"
                f" or ${keyfiles.KEY_FILE_ENV})")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def call(address: str, op: str, fields: dict | None = None, frames=(),
         timeout_s: float = DEFAULT_TIMEOUT_S, key_file: str | None = None):
    """One-shot request on a fresh connection."""
    with Connection(address, timeout_s=timeout_s, key_file=key_file) as conn:
        return conn.call(op, fields, frames)
