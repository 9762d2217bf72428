"""The Kafka record batch (magic 2): checked, decoded and built as Kafka's wire carries it.

A Kafka client produces one RecordBatch per partition; kera stores it as produced (inside a
chunk flagged kera.codec.chunk.FLAG_KAFKA) and serves it as stored, rewriting only the two
header fields the CRC does not cover (base offset, leader epoch: `with_offset`). Brokers run
`check`, per-batch work alone; readers of the other protocol decode the records (`columns`,
`records`), and a batch is built from kera-native rows with `build`.

Layout (big-endian; the CRC-32C covers bytes 21 to the end)::

     0 i64 base_offset       8 i32 batch_length (bytes after this field)
    12 i32 leader_epoch     16 i8 magic = 2       17 u32 crc
    21 i16 attributes (bits 0-2 codec: 0 none 1 gzip 2 snappy 3 lz4 4 zstd; bit 3
           log-append time; bit 4 transactional; bit 5 control)
    23 i32 last_offset_delta 27 i64 base_timestamp_ms 35 i64 max_timestamp_ms
    43 i64 producer_id      51 i16 producer_epoch  53 i32 base_sequence  57 i32 count
    61 records, one compressed block when the codec is not 0, each:
       length varint | attributes i8 | timestamp delta varlong | offset delta varint |
       key length varint (-1: null) | key | value length varint (-1: null) | value |
       header count varint | per header: key length varint, UTF-8 key, value length
       varint (-1: null), value
    (varints are zigzag-encoded, 7 bits a byte, least significant group first)
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple, Sequence

import crc32c as _crc32c

from kera.errors import CorruptChunk

HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 61
LENGTH_AFTER = 12    # batch_length counts the bytes after base_offset and itself
CRC_AT = 17
CRC_FROM = 21        # the CRC covers attributes to the end
MAGIC = 2
NO_TIMESTAMP_MS = -1   # Kafka's RecordBatch.NO_TIMESTAMP: the times of a batch with no record
_OFFSET = struct.Struct(">q")         # base_offset, bytes 0-7
_EPOCH = struct.Struct(">i")          # leader_epoch, bytes 12-15
EPOCH_AT = 12
_CRC = struct.Struct(">I")

CODEC_MASK = 0x07
CODECS = {0: None, 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
LOG_APPEND_TIME = 0x08
TRANSACTIONAL = 0x10
CONTROL = 0x20

# A batch's records, decompressed, may hold at most this many bytes: they become one kera
# chunk's columns, and a chunk may not exceed kera.codec.chunk.MAX_CHUNK_BYTES (64 MiB, paired
# there by an assert). It bounds what a lying or hostile compressed block can make us allocate.
MAX_PLAIN_BYTES = 64 * 1024 * 1024
# Decompressed in pieces of this many bytes: asking a decoder for the whole bound at once made
# it allocate 64 MiB per batch (20 us a batch, against 1-3 us for a 1 MiB piece).
DECOMPRESS_PIECE_BYTES = 1024 * 1024
# The smallest record: length, attributes, timestamp delta, offset delta, key length, value
# length and header count, one byte each. Bounds the count a batch of n bytes can claim.
RECORD_MIN_BYTES = 7
RECORD_BODY_MIN_BYTES = RECORD_MIN_BYTES - 1   # after its length varint
# A varint (i32) takes at most 5 bytes of 7 bits, a varlong (i64) 10: more is malformed.
VARINT_BYTES_MAX = 5
VARLONG_BYTES_MAX = 10
# Snappy as Java clients write it (xerial's framing): this magic, two i32 (version, compat),
# then blocks of [i32 compressed length][raw snappy block]. librdkafka writes one raw block.
XERIAL_MAGIC = b"\x82SNAPPY\x00"
XERIAL_HEADER_BYTES = 16


class BatchHeader(NamedTuple):
    base_offset: int
    batch_length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp_ms: int
    max_timestamp_ms: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    count: int

    @property
    def size(self) -> int:
        """Bytes of the whole batch."""
        return self.batch_length + LENGTH_AFTER

    @property
    def codec(self) -> int:
        return self.attributes & CODEC_MASK

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & CONTROL)


class KafkaRecord(NamedTuple):
    offset_delta: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


class KafkaColumns(NamedTuple):
    """A batch's records as one list per field (what kera's chunk columns are built from)."""
    offset_deltas: list[int]
    timestamps_ms: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    headers: list[list[tuple[str, bytes | None]]]


# --------------------------------------------------------------------------- checking

def read_header(buf, at: int = 0) -> BatchHeader:
    """The header of the batch at byte `at` of `buf`, unchecked beyond its presence."""
    if len(buf) - at < HEADER_SIZE:
        raise CorruptChunk(f"Kafka batch of {len(buf) - at} bytes is shorter than its "
                           f"{HEADER_SIZE}-byte header")
    return BatchHeader._make(HEADER.unpack_from(buf, at))


def check(buf, control: bool = False) -> BatchHeader:
    """The header of `buf`, which must be exactly one well-formed batch as a producer sends it
    (or, with `control`, a control batch as a broker writes it: kera.codec.txn); CorruptChunk
    says what is wrong. Per-batch work only: the records are not decoded."""
    h = read_header(buf)
    if h.magic != MAGIC:
        raise CorruptChunk(f"Kafka batch magic {h.magic}: only magic {MAGIC} batches are accepted")
    if h.size != len(buf):
        raise CorruptChunk(f"Kafka batch length {h.batch_length} + {LENGTH_AFTER} does not match "
                           f"its {len(buf)} bytes")
    crc = _crc32c.crc32c(memoryview(buf)[CRC_FROM:])
    if crc != h.crc:
        raise CorruptChunk(f"Kafka batch CRC mismatch: 0x{h.crc:08x} stored, 0x{crc:08x} computed")
    _check_fields(h, len(buf), control)
    return h


def _check_fields(h: BatchHeader, size: int, control: bool = False) -> None:
    if h.count < 1 or h.last_offset_delta + 1 != h.count:
        raise CorruptChunk(f"Kafka batch of {h.count} records has last offset delta "
                           f"{h.last_offset_delta}: want count >= 1 and delta count - 1")
    if h.control and not control:
        raise CorruptChunk("Kafka control batches are written by brokers, not produced")
    if h.codec not in CODECS:
        raise CorruptChunk(f"Kafka batch compression codec {h.codec} is unknown")
    room = size - HEADER_SIZE if h.codec == 0 else MAX_PLAIN_BYTES
    if h.count * RECORD_MIN_BYTES > room:
        raise CorruptChunk(f"{h.count} Kafka records cannot fit in {room} bytes")


# --------------------------------------------------------------------------- decoding

def records(buf, control: bool = False) -> list[KafkaRecord]:
    """Every record of the batch `buf` (checked as by `check`), decompressed."""
    return list(map(KafkaRecord._make, zip(*columns(buf, control))))


def columns(buf, control: bool = False) -> KafkaColumns:
    """The records of the batch `buf` (checked as by `check`) as columns; CorruptChunk on a
    malformed record, a bad compressed block or records past MAX_PLAIN_BYTES."""
    h = check(buf, control)
    data = plain_records(buf, h)
    append_ms = h.max_timestamp_ms if h.attributes & LOG_APPEND_TIME else None
    try:
        return _parse(data, h.count, h.base_timestamp_ms, append_ms)
    except IndexError:
        raise CorruptChunk(f"Kafka batch records end inside a record "
                           f"({len(data)} bytes for {h.count} records)") from None


def plain_records(buf, h: BatchHeader) -> bytes:
    """The records section of the batch, decompressed when its codec says so."""
    data = memoryview(buf)[HEADER_SIZE:h.size]
    name = CODECS[h.codec]
    if name is None:
        return bytes(data)
    try:
        return _DECOMPRESS[name](bytes(data))
    except CorruptChunk:
        raise
    except Exception as err:   # each codec library raises its own types for bad input
        raise CorruptChunk(f"Kafka batch {name} records do not decompress: {err}") from None


def _parse(data: bytes, count: int, base_ms: int, append_ms: int | None) -> KafkaColumns:
    """The `count` records of `data` as columns. One loop, the one-byte case of each varint
    inlined and the two-byte case of the two that are often longer (a record's length, its
    value's): a function call per field was over half the time (1.76 -> 1.30 us a record
    of 100-byte values; kafka-python's reader takes 2.9)."""
    zz, varint, size, pos = _ZIGZAG_1, _varint, len(data), 0
    deltas, times, keys, values, headers = [], [], [], [], []
    for i in range(count):
        b = data[pos]
        if b < 0x80:
            length, pos = zz[b], pos + 1
        elif data[pos + 1] < 0x80:
            z = (b & 0x7F) | (data[pos + 1] << 7)
            length, pos = (z >> 1) ^ -(z & 1), pos + 2
        else:
            length, pos = varint(data, pos, VARINT_BYTES_MAX)
        end = pos + length
        if length < RECORD_BODY_MIN_BYTES or end > size:
            raise CorruptChunk(f"Kafka record {i} of {length} bytes does not fit its batch")
        b = data[pos + 1]   # after the record's attributes, which are unused
        if b < 0x80:
            ts, pos = zz[b], pos + 2
        else:
            ts, pos = varint(data, pos + 1, VARLONG_BYTES_MAX)
        b = data[pos]
        if b < 0x80:
            delta, pos = zz[b], pos + 1
        else:
            delta, pos = varint(data, pos, VARINT_BYTES_MAX)
        b = data[pos]
        if b < 0x80:
            n, pos = zz[b], pos + 1
        else:
            n, pos = varint(data, pos, VARINT_BYTES_MAX)
        if n < -1:
            raise CorruptChunk(f"Kafka record {i} has key length {n}")
        keys.append(None if n == -1 else data[pos:pos + n])
        pos += n if n > 0 else 0
        b = data[pos]
        if b < 0x80:
            n, pos = zz[b], pos + 1
        elif data[pos + 1] < 0x80:
            z = (b & 0x7F) | (data[pos + 1] << 7)
            n, pos = (z >> 1) ^ -(z & 1), pos + 2
        else:
            n, pos = varint(data, pos, VARINT_BYTES_MAX)
        if n < -1:
            raise CorruptChunk(f"Kafka record {i} has value length {n}")
        values.append(None if n == -1 else data[pos:pos + n])
        pos += n if n > 0 else 0
        if data[pos] == 0:   # no headers, the usual case
            headers.append([])
            pos += 1
        else:
            pairs, pos = _headers(data, pos, end)
            headers.append(pairs)
        if pos != end:
            raise CorruptChunk(f"Kafka record {i} ends at byte {pos}, its length says {end}")
        deltas.append(delta)
        times.append(base_ms + ts if append_ms is None else append_ms)
    if pos != size:
        raise CorruptChunk(f"{size - pos} stray bytes after the {count} records of a Kafka batch")
    return KafkaColumns(deltas, times, keys, values, headers)


def _headers(data: bytes, pos: int, end: int) -> tuple[list, int]:
    """The headers of the record ending at `end`, from its header count at `pos` (one-byte
    lengths inlined, as in _parse)."""
    zz, varint = _ZIGZAG_1, _varint
    count, pos = varint(data, pos, VARINT_BYTES_MAX)
    if count < 0 or 2 * count > end - pos:   # a header takes at least its two lengths
        raise CorruptChunk(f"a Kafka record claims {count} headers in {end - pos} bytes")
    pairs = []
    for _ in range(count):
        b = data[pos]
        n, pos = (zz[b], pos + 1) if b < 0x80 else varint(data, pos, VARINT_BYTES_MAX)
        if n < 0 or pos + n > end:
            raise CorruptChunk(f"Kafka header key length {n} does not fit its record")
        try:
            key = data[pos:pos + n].decode()
        except UnicodeDecodeError:
            raise CorruptChunk("a Kafka header key is not UTF-8") from None
        pos += n
        b = data[pos]
        n, pos = (zz[b], pos + 1) if b < 0x80 else varint(data, pos, VARINT_BYTES_MAX)
        if n < -1 or pos + n > end:
            raise CorruptChunk(f"Kafka header value length {n} does not fit its record")
        pairs.append((key, None if n == -1 else data[pos:pos + n]))
        pos += n if n > 0 else 0
    return pairs, pos


def _varint(data: bytes, pos: int, bytes_max: int) -> tuple[int, int]:
    """(the zigzag varint at `pos` of at most `bytes_max` bytes, the position after it)."""
    result = shift = 0
    for at in range(pos, pos + bytes_max):
        b = data[at]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return (result >> 1) ^ -(result & 1), at + 1
        shift += 7
    raise CorruptChunk(f"Kafka varint at byte {pos} runs past {bytes_max} bytes")


# Each one-byte varint's value (zigzag: 0 0, 1 -1, 2 1, 3 -2, ...).
_ZIGZAG_1 = tuple((b >> 1) ^ -(b & 1) for b in range(0x80))


# --------------------------------------------------------------------------- decompressing

def _bounded(read_piece, name: str) -> bytes:
    """Everything `read_piece(n)` yields until it returns nothing, refused past MAX_PLAIN_BYTES.
    A truncated block just ends early: parsing then finds the records short."""
    pieces, size = [], 0
    while True:
        piece = read_piece(DECOMPRESS_PIECE_BYTES)
        if not piece:
            return b"".join(pieces)
        size += len(piece)
        if size > MAX_PLAIN_BYTES:
            raise CorruptChunk(f"Kafka batch {name} records decompress past {MAX_PLAIN_BYTES} bytes")
        pieces.append(piece)


def _gunzip(data: bytes) -> bytes:
    d = zlib.decompressobj(zlib.MAX_WBITS | 16)   # | 16: a gzip header and trailer
    pending = [data]
    return _bounded(lambda n: d.decompress(pending.pop() if pending else d.unconsumed_tail, n), "gzip")


def _lz4(data: bytes) -> bytes:
    """Kafka's lz4 is the LZ4 frame format (magic 2; magic 0 and 1 had a broken checksum)."""
    import lz4.frame
    d = lz4.frame.LZ4FrameDecompressor()
    pending = [data]

    def piece(n: int) -> bytes:
        return b"" if d.eof else d.decompress(pending.pop() if pending else b"", max_length=n)
    return _bounded(piece, "lz4")


def _zstd(data: bytes) -> bytes:
    import zstandard
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    return _bounded(reader.read, "zstd")


def _snappy(data: bytes) -> bytes:
    """Raw snappy (librdkafka) or xerial's framed blocks (Java clients)."""
    if data[:len(XERIAL_MAGIC)] != XERIAL_MAGIC:
        return _snappy_blocks([data])
    blocks, at = [], XERIAL_HEADER_BYTES
    while at < len(data):
        if at + 4 > len(data):
            raise CorruptChunk("xerial snappy block length is truncated")
        n, = _BLOCK_LEN.unpack_from(data, at)
        if n < 0 or at + 4 + n > len(data):
            raise CorruptChunk(f"xerial snappy block of {n} bytes runs past its batch")
        blocks.append(data[at + 4:at + 4 + n])
        at += 4 + n
    return _snappy_blocks(blocks)


_BLOCK_LEN = struct.Struct(">i")


def _snappy_blocks(blocks: list) -> bytes:
    """Raw snappy blocks, each checked against its length claim before it is decompressed."""
    from cramjam import snappy
    total = sum(snappy.decompress_raw_len(b) for b in blocks)
    if total > MAX_PLAIN_BYTES:
        raise CorruptChunk(f"Kafka batch snappy records claim {total} bytes, over {MAX_PLAIN_BYTES}")
    return b"".join(bytes(snappy.decompress_raw(b)) for b in blocks)


_DECOMPRESS = {"gzip": _gunzip, "snappy": _snappy, "lz4": _lz4, "zstd": _zstd}


# --------------------------------------------------------------------------- building

def build(rows: Sequence, base_offset: int = 0, producer_id: int = -1, producer_epoch: int = -1,
          base_sequence: int = -1, leader_epoch: int = -1, offset_deltas: Sequence | None = None,
          last_offset_delta: int | None = None, attributes: int = 0) -> bytes:
    """An uncompressed batch (create-time timestamps, CRC set) of `rows`, each (timestamp_ms,
    key bytes or None, value bytes or None, headers: a sequence of (str, bytes or None)).
    `attributes`: TRANSACTIONAL and CONTROL (a broker's control batch, kera.codec.txn); the
    codec bits must stay 0 (nothing is compressed).
    `offset_deltas` (ascending) and `last_offset_delta`: a compacted range's, whose records
    are not every offset it covers (default: 0, 1, ... and the last row's); such a range may
    have no record left, a batch Kafka's consumers step over to its last offset + 1."""
    if not rows and last_offset_delta is None:
        raise ValueError("a Kafka batch holds at least one record")
    if attributes & ~(TRANSACTIONAL | CONTROL):
        raise ValueError(f"batch attributes 0x{attributes:x}: only TRANSACTIONAL and CONTROL")
    base_ms = rows[0][0] if rows else NO_TIMESTAMP_MS
    out = bytearray(HEADER_SIZE)
    _append_records(out, rows, base_ms, offset_deltas)
    last = len(rows) - 1 if last_offset_delta is None else last_offset_delta
    max_ms = max(r[0] for r in rows) if rows else NO_TIMESTAMP_MS
    HEADER.pack_into(out, 0, base_offset, len(out) - LENGTH_AFTER, leader_epoch, MAGIC, 0,
                     attributes, last, base_ms, max_ms, producer_id,
                     producer_epoch, base_sequence, len(rows))
    _CRC.pack_into(out, CRC_AT, _crc32c.crc32c(memoryview(out)[CRC_FROM:]))
    return bytes(out)


def _append_records(out: bytearray, rows: Sequence, base_ms: int,
                    offset_deltas: Sequence | None = None) -> None:
    """Each row as a record (at `offset_deltas`, default 0, 1, ...), appended to `out`; varints
    below VARINT_TABLE_SIZE come from the table (a record's fields are nearly all small),
    others from _encode_varint."""
    vt, top, enc = _VARINTS, VARINT_TABLE_SIZE - 1, _encode_varint
    null, no_headers = vt[0], vt[1]   # -1 (a null key or value), 0 (no headers)
    deltas = range(len(rows)) if offset_deltas is None else offset_deltas
    for i, (ts, key, value, headers) in zip(deltas, rows):
        d = ts - base_ms
        tsv = vt[d + 1] if -1 <= d < top else enc(d)
        offv = vt[i + 1] if i < top else enc(i)
        if key is None:
            kv, key = null, b""
        else:
            kv = vt[len(key) + 1] if len(key) < top else enc(len(key))
        if value is None:
            vv, value = null, b""
        else:
            vv = vt[len(value) + 1] if len(value) < top else enc(len(value))
        hv = _headers_bytes(headers) if headers else no_headers
        n = 1 + len(tsv) + len(offv) + len(kv) + len(key) + len(vv) + len(value) + len(hv)
        out += vt[n + 1] if n < top else enc(n)
        out += b"".join((b"\x00", tsv, offv, kv, key, vv, value, hv))


def _headers_bytes(headers) -> bytes:
    vb = _varint_bytes
    parts = [vb(len(headers))]
    for k, v in headers:
        kb = k.encode()
        parts += (vb(len(kb)), kb, vb(-1)) if v is None else (vb(len(kb)), kb, vb(len(v)), v)
    return b"".join(parts)


def _varint_bytes(v: int) -> bytes:
    return _VARINTS[v + 1] if -1 <= v < VARINT_TABLE_SIZE - 1 else _encode_varint(v)


def _encode_varint(v: int) -> bytes:
    """The zigzag varint of `v` (an i64)."""
    z = (v << 1) ^ (v >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


# Varints of -1 .. VARINT_TABLE_SIZE - 2, at index v + 1, precomputed: every length and delta
# below 8191 zigzags to at most 2 bytes, and looking one up is a tenth of encoding it (the
# table holds 8 Ki small bytes objects, about 300 KiB).
VARINT_TABLE_SIZE = 8192
_VARINTS = tuple(_encode_varint(v) for v in range(-1, VARINT_TABLE_SIZE - 1))


def with_offset(batch_view, base_offset: int, leader_epoch: int = -1) -> bytes:
    """A copy of the stored batch with its base offset and leader epoch set: both lie before
    the bytes its CRC covers, so the CRC stays valid. One copy (the join)."""
    return b"".join(offset_parts(batch_view, base_offset, leader_epoch))


def offset_parts(batch_view, base_offset: int, leader_epoch: int = -1) -> tuple:
    """`with_offset`'s batch as four buffers, two of them views of `batch_view`: a caller
    joining many batches (a Fetch reply) copies each once, in its own join."""
    view = memoryview(batch_view)
    return (_OFFSET.pack(base_offset), view[8:EPOCH_AT], _EPOCH.pack(leader_epoch),
            view[EPOCH_AT + 4:])
