"""The simulated network: directed channels between node addresses, with seeded faults.

A message is `[header, *frames]` as bytes, exactly what a zmq socket carries. Each directed
channel (src -> dst) is FIFO, like one TCP connection: a message is never delivered before one
sent earlier on the same channel. Messages on different channels race freely, so requests and
replies of different connections reorder. Faults: random loss, slow messages (delays past the
daemons' timeouts), cut links (partitions, one or both directions) and crashed nodes (a message
to a node that is down, or that restarted since the message was sent, is lost, as on a reset
TCP connection).
"""

from __future__ import annotations

import random
import struct
import zlib

from kera.codec import wire

from tests.sim.scheduler import Scheduler

BASE_DELAY_S = (0.00005, 0.001)   # a message on a healthy link
SLOW_DELAY_S = (0.01, 3.0)        # a slow one: may outlast a timeout
_TIME = struct.Struct("<d")


class Node:
    """A process with an address that receives messages. A restart is a new Node at the same
    address with the next incarnation; the old one is down for good."""

    def __init__(self, net: "Network", address: str):
        self.net = net
        self.sched = net.sched
        self._address = address
        old = net.nodes.get(address)
        if old is not None:
            old.up = False
        self.incarnation = net.incarnations[address] = net.incarnations.get(address, 0) + 1
        self.up = True
        net.nodes[address] = self

    @property
    def address(self) -> str:
        return self._address

    def receive(self, src: str, src_inc: int, parts: list) -> None:
        raise NotImplementedError


class Network:
    def __init__(self, sched: Scheduler, rng: random.Random, trace: list | None = None):
        self.sched = sched
        self.rng = rng
        self.nodes: dict[str, Node] = {}
        self.incarnations: dict[str, int] = {}
        self.loss = 0.0              # probability a message is lost
        self.slow = 0.0              # probability a message is slow
        self.cuts: dict[tuple[str, str], float] = {}   # (src, dst) -> cut until
        self._free_at: dict[tuple[str, str], float] = {}
        self.sent = 0
        self.lost = 0
        self.trace = trace           # a list to append "t src>dst op" lines to, or None
        self.drop_if = None          # drop_if(src, dst, parts) -> True: lose that message (tests)
        self.digest = 0              # CRC32 over every delivery: equal runs give equal digests
        self.delivered_at: dict[tuple[str, str], float] = {}   # (src, dst) -> last delivery

    def healthy(self) -> None:
        self.loss = 0.0
        self.slow = 0.0
        self.cuts.clear()

    def cut(self, a: str, b: str, until: float, both: bool = True) -> None:
        self.cuts[(a, b)] = until
        if both:
            self.cuts[(b, a)] = until

    def send(self, src: str, src_inc: int, dst: str, dst_inc: int | None, parts: list) -> None:
        """Send `parts` from (src, src_inc) to dst; `dst_inc` pins the receiving incarnation
        (a reply goes to the process that asked, never to its successor)."""
        self.sent += 1
        node = self.nodes.get(dst)
        now = self.sched.now
        if node is None or not node.up or (dst_inc is not None and dst_inc != node.incarnation):
            self.lost += 1
            return
        until = self.cuts.get((src, dst))
        if until is not None:
            if until > now:
                self.lost += 1
                return
            del self.cuts[(src, dst)]
        rng = self.rng
        if (self.loss and rng.random() < self.loss) or (self.drop_if and self.drop_if(src, dst, parts)):
            self.lost += 1
            return
        if self.slow and rng.random() < self.slow:
            delay = rng.uniform(*SLOW_DELAY_S)
        else:
            delay = rng.uniform(*BASE_DELAY_S)
        key = (src, dst)
        t = max(now + delay, self._free_at.get(key, 0.0))
        self._free_at[key] = t
        self.sched.at(t, self._deliver, node, node.incarnation, src, src_inc, parts)

    def _deliver(self, node: Node, inc: int, src: str, src_inc: int, parts: list) -> None:
        if not node.up or node.incarnation != inc:
            self.lost += 1
            return
        self.digest = zlib.crc32(parts[0], zlib.crc32(_TIME.pack(self.sched.now), self.digest))
        self.delivered_at[(src, node.address)] = self.sched.now
        if self.trace is not None:
            self.trace.append(f"{self.sched.now:.6f} {src} > {node.address} {_describe(parts)}")
        node.receive(src, src_inc, parts)


def _describe(parts: list) -> str:
    """A delivery for the trace: op or outcome, id, a few fields, payload frames."""
    try:
        h = wire.unpack_header(parts[0])
    except Exception:
        return f"<unreadable header {bytes(parts[0][:16])!r}>"
    if "op" in h:
        what = f"{h.get('op')} #{h.get('id')}"
    elif h.get("ok") is True:
        what = f"ok #{h.get('id')}"
    else:
        what = f"error #{h.get('id')} {h.get('code')}: {str(h.get('message'))[:60]}"
    fields = {k: v for k, v in h.items() if k not in ("v", "op", "id", "ok", "code", "message",
                                                       "retriable", "stats")}
    text = repr(fields)
    if len(text) > 100:
        text = text[:97] + "..."
    frames = f" +{len(parts) - 1} frames" if len(parts) > 1 else ""
    return f"{what} {text}{frames}"
