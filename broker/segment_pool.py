"""Segment memory kept for reuse: the buffers of segments that left memory (retention deleted
their group, tiering wrote them to disk, their stream was deleted) serve the next new segments.

A fresh anonymous buffer costs a page fault per 4 KiB on its first write; on this project's
machine copying a 64 KiB chunk into fresh memory took 45 us, into reused memory 2 us. A broker
in steady state (retention or tiering freeing what appends fill) then appends without faulting.

A buffer given back may still be read: a reply or replication frame that zmq has not sent yet
holds a view of it. It is reused only once no view is left. Python has no call for "is this
buffer exported"; `mmap.resize` refuses, changing nothing, while it is (and to the same size it is
a no-op otherwise), so that is the test. Reused memory keeps its old bytes: a segment only ever
exposes the chunks it indexes, each copied over in full before it is indexed.
"""

from __future__ import annotations

import mmap
from collections import deque

from kera.broker.segment import anonymous_buffer
from kera.config import MiB

# Memory kept for reuse per broker: one default group (16 segments of 8 MiB), because retention
# deletes a whole group at once and the next group can then reuse all of it. The pool's buffers
# are resident memory the broker holds on top of its segments.
SEGMENT_POOL_BYTES = 128 * MiB


def in_use(buf: mmap.mmap) -> bool:
    """True while some view of `buf` (a memoryview slice, a zmq frame) is alive."""
    try:
        buf.resize(len(buf))
    except BufferError:
        return True
    return False


class SegmentPool:
    """Buffers given back, by capacity, reused by `take` once nothing views them any more."""

    def __init__(self, bytes_max: int = SEGMENT_POOL_BYTES):
        if bytes_max < 0:
            raise ValueError(f"segment pool size must be >= 0 bytes, not {bytes_max}")
        self.bytes_max = bytes_max
        self.bytes = 0                       # held: waiting and free buffers
        self._waiting: deque[mmap.mmap] = deque()   # given back, maybe still viewed
        self._free: deque[mmap.mmap] = deque()      # no view left: ready, oldest first
        self.reused = 0                      # takes served from the pool
        self.fresh = 0                       # takes that mapped new memory

    def take(self, capacity_bytes: int) -> mmap.mmap:
        """A buffer of `capacity_bytes`: a free one of that size, else new memory."""
        return self.take_telling_reuse(capacity_bytes)[0]

    def take_telling_reuse(self, capacity_bytes: int) -> tuple[mmap.mmap, bool]:
        """take(), and whether the buffer is reused (a segment filled it before, so its pages
        are resident and need not be populated again)."""
        self._collect()
        for buf in self._free:
            if len(buf) == capacity_bytes:
                self._free.remove(buf)
                self.bytes -= capacity_bytes
                self.reused += 1
                return buf, True
        self.fresh += 1
        return anonymous_buffer(capacity_bytes), False

    def give(self, buf: mmap.mmap) -> None:
        """Keep `buf` for reuse; when the pool is full the oldest free buffers go to the system
        first, and `buf` itself when that is not enough."""
        size = len(buf)
        while self.bytes + size > self.bytes_max and self._free:
            self.bytes -= len(self._free.popleft())
        if self.bytes + size > self.bytes_max:
            return
        self._waiting.append(buf)
        self.bytes += size

    def _collect(self) -> None:
        """Move the waiting buffers no view holds any more to the free list."""
        for _ in range(len(self._waiting)):
            buf = self._waiting.popleft()
            (self._waiting if in_use(buf) else self._free).append(buf)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "waiting": len(self._waiting), "free": len(self._free),
                "reused": self.reused, "fresh": self.fresh}
