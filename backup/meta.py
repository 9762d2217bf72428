"""The replica metadata record: the commit record of a replica file on disk.

A replica's `.seg` file may hold a partly written tail after a crash; the `.meta` file says
how many of its bytes are durable and whether the broker closed the replica, so a reader
trusts exactly `length` bytes.

The file has two slots, `SLOT_BYTES` apart so each sits in its own disk sector. A flush writes
its record, numbered one past the newest on file (`seq`), into slot `seq % 2` in place and
fdatasyncs it: no temporary file, rename or directory fsync per flush. A write torn by a crash
damages only the slot it was writing (its checksum fails), and the other slot still holds the
previous record, which names only bytes synced before it. A reader takes the valid slot with
the highest `seq`.

Record layout (little-endian, 48 bytes, version 2)::

     0  4s  magic b"KRBM"        4  u16 version      6  u16 flags (bit 0: closed)
     8  u64 broker_id           16  u32 vlog        20  u64 vseg      (packed, no padding)
    28  u64 length              36  u64 seq         44  u32 crc32c of bytes 0..44

Files written before the slots (version 1) hold one 40-byte record, without `seq`, replaced by
temp file + rename on each flush; they still load: their record counts as slot 0, `seq` 0, and
the next flush writes slot 1 after it.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kera.codec.chunk import crc32c
from kera.errors import StorageError

MAGIC = b"KRBM"
VERSION = 2
VERSION_SINGLE = 1                 # one record per file, no seq: read, never written
FLAG_CLOSED = 0x01
SLOT_BYTES = 512                   # slot stride: a disk sector, so slots never share one
SLOTS = 2
FILE_BYTES_MAX = SLOTS * SLOT_BYTES
_HEAD = struct.Struct("<4sHH")
_BODY = struct.Struct("<4sHHQIQQQ")
_BODY_SINGLE = struct.Struct("<4sHHQIQQ")
_CRC = struct.Struct("<I")
SIZE = _BODY.size + _CRC.size
SIZE_SINGLE = _BODY_SINGLE.size + _CRC.size
assert SIZE == 48 and SIZE_SINGLE == 40


class CorruptMeta(StorageError):
    """A replica metadata record failed its checksum or layout check."""
    retriable = False


class Meta(NamedTuple):
    broker_id: int
    vlog: int
    vseg: int
    length: int
    closed: bool


def encode(meta: Meta, seq: int = 0) -> bytes:
    """The record for slot `slot_offset(seq)`."""
    body = _BODY.pack(MAGIC, VERSION, FLAG_CLOSED if meta.closed else 0, meta.broker_id,
                      meta.vlog, meta.vseg, meta.length, seq)
    return body + _CRC.pack(crc32c(body))


def slot_offset(seq: int) -> int:
    return (seq % SLOTS) * SLOT_BYTES


def decode(buf: bytes) -> Meta:
    """Parse and check one record (either version); raises CorruptMeta on anything off."""
    return decode_numbered(buf)[1]


def decode_numbered(buf: bytes) -> tuple[int, Meta]:
    """(seq, record) of one record; a version-1 record is seq 0. Raises CorruptMeta."""
    body = {SIZE: _BODY, SIZE_SINGLE: _BODY_SINGLE}.get(len(buf))
    if body is None:
        raise CorruptMeta(f"metadata record of {len(buf)} bytes is neither {SIZE} nor "
                          f"{SIZE_SINGLE}")
    (crc,) = _CRC.unpack_from(buf, body.size)
    if crc32c(buf[:body.size]) != crc:
        raise CorruptMeta("metadata record checksum mismatch")
    magic, version, flags, broker_id, vlog, vseg, length, *seq = body.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptMeta(f"bad metadata magic {magic!r}")
    if version != (VERSION if body is _BODY else VERSION_SINGLE):
        raise CorruptMeta(f"unsupported metadata version {version} in a {len(buf)}-byte record")
    if flags & ~FLAG_CLOSED:
        raise CorruptMeta(f"unknown metadata flags 0x{flags:04x}")
    return (seq[0] if seq else 0), Meta(broker_id, vlog, vseg, length, bool(flags & FLAG_CLOSED))


def _slot_record(slot: bytes) -> bytes:
    """The record at the start of a slot, cut to its version's size."""
    if len(slot) < _HEAD.size:
        raise CorruptMeta(f"metadata slot of {len(slot)} bytes holds no record")
    version = _HEAD.unpack_from(slot, 0)[1]
    return slot[:SIZE_SINGLE if version == VERSION_SINGLE else SIZE]


def newest(data: bytes) -> tuple[int, Meta]:
    """(seq, record) of the newest valid slot of a metadata file's bytes (at most
    FILE_BYTES_MAX of them); raises CorruptMeta when no slot holds a valid record."""
    if len(data) > FILE_BYTES_MAX:
        raise CorruptMeta(f"metadata file of {len(data)} bytes is over {FILE_BYTES_MAX}")
    found, errors = [], []
    for at in range(0, max(len(data), 1), SLOT_BYTES):
        try:
            found.append(decode_numbered(_slot_record(data[at:at + SLOT_BYTES])))
        except CorruptMeta as err:
            errors.append(f"slot {at // SLOT_BYTES}: {err.message}")
    if not found:
        raise CorruptMeta("; ".join(errors))
    return max(found, key=lambda numbered: numbered[0])


def decode_file(data: bytes) -> Meta:
    """The record a metadata file's bytes commit (its newest valid slot); raises CorruptMeta."""
    return newest(data)[1]
