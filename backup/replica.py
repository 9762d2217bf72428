"""One replica of a virtual segment: its chunks in memory, what is on disk, and the retry rule.

Byte offsets are replica offsets (0 = first byte the broker wrote). The replica holds the chunks
of `[memory_from, length)` in memory as the received buffers (no copy); `[0, flushed_length)` is
durable on disk. Only flushed bytes ever leave memory, so `memory_from <= flushed_length <=
length` always holds and every byte is in memory, on disk, or both.

Retries: a write that starts before `length` is a retry of something already stored. Its chunks
must repeat the stored chunks exactly (same boundaries, same bytes) up to `length`; that prefix
is acknowledged without being stored again and the rest, if any, is appended. The comparison is
byte for byte while the stored bytes are in memory. Once they have left memory (flushed, then
dropped), only a retry of the replica's last write can still be recognised, by its chunk
headers (each header carries the header and body checksums, both verified on arrival): a broker
whose acknowledgement of a closing write was lost retries exactly that write. A broker that
starts a replica over from offset 0 says so (`reset`, kera.backup.store.ReplicaStore.reset): the
replica is then discarded and rebuilt, never compared.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

from kera.codec.chunk import HEADER_SIZE
from kera.errors import BadRequest

Key = tuple[int, int, int]  # (broker_id, vlog, vseg)


def describe(key: Key) -> str:
    return f"replica broker {key[0]} vlog {key[1]} vseg {key[2]}"


class Fingerprint(NamedTuple):
    """The last write of a replica, kept once its bytes have left memory."""
    offset: int
    headers: tuple[bytes, ...]


class Replica:
    __slots__ = ("key", "length", "closed", "memory_from", "chunks", "ends", "flushed_length",
                 "disk_closed", "on_disk", "flushing", "failed", "retry_at", "failures",
                 "last_write_offset", "fingerprint")

    def __init__(self, key: Key):
        self.key = key
        self.length = 0
        self.closed = False
        self.memory_from = 0
        self.chunks: list[memoryview] = []   # chunks of [memory_from, length), in order
        self.ends: list[int] = []            # end offset of each chunk in `chunks`
        self.flushed_length = 0              # bytes durable on disk (the metadata record says so)
        self.disk_closed = False             # the metadata record on disk says closed
        self.on_disk = False                 # a metadata record exists
        self.flushing = False                # a flush job is in flight
        self.failed: str | None = None       # last flush error, until a flush succeeds
        self.retry_at = 0.0                  # no flush before this time after a failure
        self.failures = 0
        self.last_write_offset = 0
        self.fingerprint: Fingerprint | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def memory_bytes(self) -> int:
        return self.length - self.memory_from

    @property
    def unflushed_bytes(self) -> int:
        return self.length - self.flushed_length

    def needs_flush(self) -> bool:
        return (self.flushed_length < self.length or self.disk_closed != self.closed
                or not self.on_disk)

    def durable(self, end: int, closed: bool) -> bool:
        return self.flushed_length >= end and (self.disk_closed or not closed)

    # ------------------------------------------------------------------ writes
    def repeated(self, offset: int, chunks: list[memoryview]) -> int:
        """How many leading `chunks` repeat stored bytes from `offset` (< length); raises
        BadRequest when they do not repeat them exactly."""
        if offset >= self.memory_from:
            return self._repeated_in_memory(offset, chunks)
        fp = self.fingerprint
        if fp is not None and offset == fp.offset and chunks:
            count = min(len(chunks), len(fp.headers))
            if all(chunks[i][:HEADER_SIZE].tobytes() == fp.headers[i] for i in range(count)):
                return count
        raise BadRequest(f"offset mismatch: {describe(self.key)} holds {self.length} bytes; a write "
                         f"at {offset} does not repeat what is stored there")

    def _repeated_in_memory(self, offset: int, chunks: list[memoryview]) -> int:
        index = self._chunk_at(offset)
        if index is None:
            raise BadRequest(f"offset mismatch: {offset} is not a chunk boundary of "
                             f"{describe(self.key)} ({self.length} bytes)")
        at, count = offset, 0
        while at < self.length and count < len(chunks):
            stored, incoming = self.chunks[index], chunks[count]
            if len(stored) != len(incoming) or stored.tobytes() != incoming.tobytes():
                raise BadRequest(f"offset mismatch: the chunk at {at} of {describe(self.key)} "
                                 f"differs from the retried one")
            at += len(stored)
            index += 1
            count += 1
        return count

    def append(self, chunks: list[memoryview], offset: int) -> int:
        """Store `chunks` at `length`; returns the bytes added. `offset` is where the write
        that carried them began (for the retry fingerprint)."""
        added = 0
        for c in chunks:
            added += len(c)
            self.chunks.append(c)
            self.ends.append(self.length + added)
        self.length += added
        if added:
            self.last_write_offset = offset
            self.fingerprint = None
        return added

    # ------------------------------------------------------------------ memory
    def _chunk_at(self, offset: int) -> int | None:
        """Index in `chunks` of the chunk starting at `offset`, or None if none does."""
        index = bisect_right(self.ends, offset)
        start = self.ends[index - 1] if index else self.memory_from
        if start != offset or index >= len(self.chunks):
            return None
        return index

    def slice(self, offset: int, max_bytes: int) -> list[memoryview]:
        """Whole in-memory chunks from `offset` (a chunk boundary >= memory_from) up to
        `max_bytes`, at least one when any is stored."""
        if offset == self.length:
            return []
        index = self._chunk_at(offset)
        if index is None:
            raise BadRequest(f"offset {offset} is not a chunk boundary of {describe(self.key)}")
        out: list[memoryview] = []
        size = 0
        while index < len(self.chunks):
            c = self.chunks[index]
            if out and size + len(c) > max_bytes:
                break
            out.append(c)
            size += len(c)
            index += 1
        return out

    def drop_flushed(self) -> int:
        """Let go of the in-memory chunks that are on disk; returns the bytes released."""
        count = bisect_right(self.ends, self.flushed_length)
        if not count:
            return 0
        new_from = self.ends[count - 1]
        if self.fingerprint is None and self.memory_from <= self.last_write_offset < new_from:
            self._keep_fingerprint()  # the last write is about to leave memory
        released = new_from - self.memory_from
        del self.chunks[:count]
        del self.ends[:count]
        self.memory_from = new_from
        assert self.memory_from <= self.flushed_length <= self.length
        return released

    def _keep_fingerprint(self) -> None:
        index = self._chunk_at(self.last_write_offset)
        if index is None:
            return
        headers = tuple(c[:HEADER_SIZE].tobytes() for c in self.chunks[index:])
        self.fingerprint = Fingerprint(self.last_write_offset, headers)
