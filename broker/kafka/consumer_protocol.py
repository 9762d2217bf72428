"""Kafka's consumer protocol (protocol type "consumer"): the bytes a member's JoinGroup metadata
(its subscription) and its SyncGroup assignment carry, as Kafka's ConsumerProtocol lays them
out. Sans-IO; read only where kera must know what a group consumes (OffsetDelete refuses a
topic the group is subscribed to; `kera group describe` names each partition's member).

Both start with an int16 version and go on with the same leading fields in every version
(0-3): a subscription with its topics (array of strings), an assignment with its partitions
(array of topic, array of int32). Later fields (user data, owned partitions, rack) are not
read. Anything malformed reads as nothing: the bytes are a client's, and a wrong guess here
only makes a check looser, never a broker fail.
"""

from __future__ import annotations

import struct

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
# Topics of one subscription or assignment read at most (a client subscribed to more is
# treated as subscribed to those only): Kafka bounds a topic name to 249 bytes and a request
# to 100 MiB, so this is far above any real consumer and bounds the work per member.
TOPICS_MAX = 100_000
PARTITIONS_MAX = 1_000_000   # partitions of one assignment read at most, likewise


class _Malformed(Exception):
    """The bytes are not what the consumer protocol lays out."""


class _Reader:
    __slots__ = ("buf", "at")

    def __init__(self, buf: bytes):
        self.buf, self.at = memoryview(buf), 0

    def take(self, fmt: struct.Struct) -> int:
        if self.at + fmt.size > len(self.buf):
            raise _Malformed
        (value,) = fmt.unpack_from(self.buf, self.at)
        self.at += fmt.size
        return value

    def count(self, limit: int) -> int:
        n = self.take(_I32)
        if n < 0 or n > limit:
            raise _Malformed
        return n

    def string(self) -> str:
        n = self.take(_I16)
        if n < 0 or self.at + n > len(self.buf):
            raise _Malformed
        out = bytes(self.buf[self.at:self.at + n]).decode("utf-8", "replace")
        self.at += n
        return out


def subscribed_topics(metadata: bytes | None) -> set[str]:
    """The topics a member's subscription names (empty when malformed or absent)."""
    if not metadata:
        return set()
    r = _Reader(metadata)
    try:
        r.take(_I16)
        return {r.string() for _ in range(r.count(TOPICS_MAX))}
    except _Malformed:
        return set()


def assigned_partitions(assignment: bytes | None) -> list[tuple[str, int]]:
    """The (topic, partition) pairs of a member's assignment (empty when malformed or absent)."""
    if not assignment:
        return []
    r = _Reader(assignment)
    out: list[tuple[str, int]] = []
    try:
        r.take(_I16)
        for _ in range(r.count(TOPICS_MAX)):
            topic = r.string()
            out += [(topic, r.take(_I32)) for _ in range(r.count(PARTITIONS_MAX - len(out)))]
    except _Malformed:
        return []
    return out


def encode_subscription(topics: list[str], version: int = 0) -> bytes:
    """A v0 subscription (no user data): for tests and tools."""
    return _I16.pack(version) + _strings(topics) + _I32.pack(-1)


def encode_assignment(parts: dict[str, list[int]], version: int = 0) -> bytes:
    """A v0 assignment (no user data): for tests and tools."""
    body = _I32.pack(len(parts)) + b"".join(
        _string(t) + _I32.pack(len(ps)) + b"".join(_I32.pack(p) for p in ps)
        for t, ps in parts.items())
    return _I16.pack(version) + body + _I32.pack(-1)


def _strings(values: list[str]) -> bytes:
    return _I32.pack(len(values)) + b"".join(_string(v) for v in values)


def _string(value: str) -> bytes:
    raw = value.encode()
    return _I16.pack(len(raw)) + raw
