"""Outgoing requests that wait for their peer's connection.

kera.server.Peer sockets use ZMQ_IMMEDIATE, so a request sent before the TCP connection is up
is dropped and only reported when its deadline passes. A broker talks to backups it has just
heard of, and the first write to each would be lost that way (and the backup wrongly replaced).
Requests to a peer that is not writable yet are held here, in order, and sent as soon as it is;
one still held at its deadline gets the Timeout its callback would have got anyway.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import zmq

from kera.errors import Timeout
from kera.server import Server

# Requests held per peer; beyond this the oldest are failed (bounded memory when a peer never
# connects).
HELD_PER_PEER_MAX = 1024


class Outbox:
    def __init__(self, server: Server):
        self.server = server
        self._held: dict[str, deque] = {}

    def request(self, address: str, op: str, fields: dict, frames, timeout_s: float,
                callback: Callable, now: float, wanted: Callable[[], bool] | None = None) -> None:
        """Send now if the peer is connected (and nothing is held before it), else hold.
        `wanted()` false when a held request comes up drops it silently (its caller gave up)."""
        peer = self.server.peer(address)
        held = self._held.get(address)
        if not held and peer.sock.poll(0, zmq.POLLOUT):
            peer.request(op, fields, frames, timeout_s, callback)
            return
        if held is None:
            held = self._held[address] = deque()
        held.append((now + timeout_s, op, fields, frames, callback, wanted))
        if len(held) > HELD_PER_PEER_MAX:
            _, op0, _, _, cb0, _ = held.popleft()
            cb0(None, None, Timeout(f"{address} not connected ({op0} dropped, queue full)"))

    def flush(self, now: float) -> None:
        """Send what the now-connected peers were waiting for; time out what waited too long."""
        for address in [a for a, q in self._held.items() if q]:
            held = self._held[address]
            peer = self.server.peer(address)
            while held:
                deadline, op, fields, frames, callback, wanted = held[0]
                if wanted is not None and not wanted():
                    held.popleft()
                    continue
                if deadline <= now:
                    held.popleft()
                    callback(None, None, Timeout(f"{address} did not connect ({op})"))
                    continue
                if not peer.sock.poll(0, zmq.POLLOUT):
                    break
                held.popleft()
                peer.request(op, fields, frames, deadline - now, callback)
        for address in [a for a, q in self._held.items() if not q]:
            del self._held[address]

    def connect(self, address: str) -> None:
        """Open the connection ahead of the first request."""
        self.server.peer(address)

    def held_count(self) -> int:
        return sum(len(q) for q in self._held.values())
