"""The replica metadata record: the commit record of a replica file on disk.

A replica's `.seg` file may hold a partly written tail after a crash; the `.meta` record says
how many of its bytes are durable and whether the broker closed the replica. It is rewritten
(temp file, fsync, rename) after every flush, so a reader trusts exactly `length` bytes.

Layout (little-endian, 40 bytes)::

     0  4s  magic b"KRBM"        4  u16 version      6  u16 flags (bit 0: closed)
     8  u64 broker_id           16  u32 vlog        20  u64 vseg      (packed, no padding)
    28  u64 length              36  u32 crc32c of bytes 0..36
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kera.chunk import crc32c
from kera.errors import StorageError

MAGIC = b"KRBM"
VERSION = 1
FLAG_CLOSED = 0x01
_BODY = struct.Struct("<4sHHQIQQ")
_CRC = struct.Struct("<I")
SIZE = _BODY.size + _CRC.size
assert SIZE == 40


class CorruptMeta(StorageError):
    """A replica metadata record failed its checksum or layout check."""
    retriable = False


class Meta(NamedTuple):
    broker_id: int
    vlog: int
    vseg: int
    length: int
    closed: bool


def encode(meta: Meta) -> bytes:
    body = _BODY.pack(MAGIC, VERSION, FLAG_CLOSED if meta.closed else 0, meta.broker_id,
                      meta.vlog, meta.vseg, meta.length)
    return body + _CRC.pack(crc32c(body))


def decode(buf: bytes) -> Meta:
    """Parse and check a record; raises CorruptMeta on anything off."""
    if len(buf) != SIZE:
        raise CorruptMeta(f"metadata record of {len(buf)} bytes is not {SIZE}")
    (crc,) = _CRC.unpack_from(buf, _BODY.size)
    if crc32c(buf[:_BODY.size]) != crc:
        raise CorruptMeta("metadata record checksum mismatch")
    magic, version, flags, broker_id, vlog, vseg, length = _BODY.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptMeta(f"bad metadata magic {magic!r}")
    if version != VERSION:
        raise CorruptMeta(f"unsupported metadata version {version}")
    if flags & ~FLAG_CLOSED:
        raise CorruptMeta(f"unknown metadata flags 0x{flags:04x}")
    return Meta(broker_id, vlog, vseg, length, bool(flags & FLAG_CLOSED))
