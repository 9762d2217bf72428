"""The chunk: a producer-built, checksummed, columnar batch of records for one streamlet.

A chunk is the unit of append, replication and fetch. Brokers and backups read only its
64-byte header; producers build its body with a handful of numpy/bytes calls and consumers
read it back as numpy or pyarrow views, never paying a Python call per record unless asked.

Layout (all integers little-endian, fixed width)::

    header (64 bytes)
      0  u16 magic 0x4B45 ("KE")      2  u8 version      3  u8 flags (bit 0: keys present;
                                        version 2 adds bit 1 value nulls, bit 2 headers,
                                        bits 3-4 compression: 1 lz4, 2 zstd)
      4  u32 header_crc  CRC32C of bytes 0..4 then 8..64 (covers body_crc, so the two chain)
      8  u32 body_crc    CRC32C of the body
     12  u32 body_len
     16  u64 producer_id      24 u64 sequence (dense per producer and streamlet)
     32  u64 stream_id        40 u32 streamlet        44 u32 record_count
     48  u32 group            52 u32 segment          56 u64 base_offset
         (group/segment/base_offset are stamped by the broker on append; 0xFFFFFFFF / 2**64-1
          until then. Stamping rewrites only the header CRC: the body CRC never changes.)
     64  u64 number       (version 3: the dense record number of the first record in its
                           ordered unit, the streamlet's slot; stamped on append with the rest)
    body, for n records
      i64[n]    timestamps (microseconds since the epoch)
      u32[n+1]  value offsets into the value bytes
      u32[n+1]  key offsets into the key bytes           (only with keys)
      bytes     value bytes
      bytes     key bytes                                 (only with keys)
      u8[n]     key is null (1) or present (0)            (only with keys)
      u8[n]     value is null (1, a tombstone) or present (0)     (version 2, bit 1)
      u32[n+1]  header index: record i has entries idx[i]..idx[i+1] (version 2, bit 2)
      u32[m+1]  header key offsets, u32[m+1] header value offsets, key bytes, value bytes
                (m = idx[n]; keys are UTF-8)

Version 3 is what this kera writes: version 2's flags and a 72-byte header that carries the
record number (kera.broker.streamlet numbers the records of each slot densely from 0). Versions
1 and 2 (64-byte headers, no numbers: written by kera before record numbers) are still read.
A compressed chunk's stored body is u32 plain length + the lz4 frame or zstd frame of the
plain body above; both checksums are over what is stored (the compressed bytes),
so brokers and backups verify and keep it as-is and only consumers decompress.

Version 3 flag bit 6 (FLAG_KAFKA, alone): the body is exactly one Kafka RecordBatch (magic 2,
kera.codec.kafka_batch) as a Kafka client produced it, compressed by its own codec if at all;
the Kafka listener serves it as stored. Chunk reads it like any other chunk: on first use it
decodes the batch into the plain body above and reads that.

Version 3 flag bit 7 (FLAG_SPARSE): a compacted chunk, written by a broker's compactor only
(docs/COMPACTION.md). It covers a range of record offsets of which it holds some: after the
other columns, u32[n+1] offset deltas (record i is offset base_offset + delta[i]; the last
entry is the span covered) and a 16-byte trailer (the delete horizon of its tombstones, ms).
"""

from __future__ import annotations

import functools
import struct
import time
from typing import Iterator, NamedTuple, Sequence

import crc32c as _crc32c
import numpy as np

from kera.codec import kafka_batch
from kera.errors import CorruptChunk, RecordTooLarge

MAGIC = 0x4B45
VERSION = 1
VERSION_2 = 2  # value nulls, headers, compression
VERSION_3 = 3  # the record number in a 72-byte header
FLAG_KEYS = 0x01
FLAG_VALUE_NULLS = 0x02
FLAG_HEADERS = 0x04
COMPRESSION_SHIFT = 3
COMPRESSION_MASK = 0x18
COMPRESSIONS = {None: 0, "lz4": 1, "zstd": 2}
FLAGS_V2 = FLAG_VALUE_NULLS | FLAG_HEADERS | COMPRESSION_MASK
FLAGS_KNOWN = FLAG_KEYS | FLAGS_V2
# Version 3: a conditional append (kera.services.conditional). Its first record carries the lock ids
# (CONDITION_LOCKS_HEADER: u64 little-endian each) and the writer's high-water mark
# (CONDITION_HWM_HEADER: i64, -1 for none); the broker that owns the streamlet reads them, and
# only them, to check and record the locks (kera.broker.locks).
FLAG_CONDITION = 0x20
# Version 3: the body is one Kafka RecordBatch as produced (the module docstring); no other flag
# may be set with it.
FLAG_KAFKA = 0x40
# Version 3: a compacted chunk (docs/COMPACTION.md), written by a broker's compactor only: it
# covers a range of record offsets of which it holds some. After the other columns, u32[n+1]
# offset deltas (record i is offset base_offset + delta[i], number number + delta[i]; strictly
# increasing; delta[n] is the span, the offsets covered), then SPARSE_TRAILER: the delete
# horizon (ms: when its tombstones were first kept; UNSET_U64 for none) and a reserved u64.
FLAG_SPARSE = 0x80
SPARSE_TRAILER = struct.Struct("<QQ")
# The producer id of compacted chunks: the producer table never records it.
COMPACTED_PRODUCER_ID = 2**64 - 2
# The producer id of a transaction's control chunk (a marker, kera.codec.txn: a FLAG_KAFKA chunk
# holding a Kafka control batch, its sequence the transaction's number), written by a broker on
# its coordinator's order only: the producer table never records it, and a client's chunk that
# claims it is refused.
MARKER_PRODUCER_ID = 2**64 - 3
# Producer ids only a broker writes: a produced chunk naming one is refused.
RESERVED_PRODUCER_IDS = frozenset((COMPACTED_PRODUCER_ID, MARKER_PRODUCER_ID))
# A compacted chunk's sequence field carries what a broker needs from its header alone (brokers
# never look inside chunks; recovery places chunks by offset): the offsets it covers (its span,
# bits 0-31), whether it is the last chunk of its rewrite (bit 32), its place in the rewrite
# (bits 33-48: a 1 GiB segment cut into pieces of at least 16 KiB has fewer) and which rewrite
# of its segment it belongs to (bits 49-63).
SPAN_BITS, PIECE_BITS, GENERATION_BITS = 32, 16, 15
SPAN_MAX = (1 << SPAN_BITS) - 1
PIECE_MAX = (1 << PIECE_BITS) - 1
GENERATION_MAX = (1 << GENERATION_BITS) - 1
FLAGS_KNOWN_V3 = FLAGS_KNOWN | FLAG_CONDITION | FLAG_KAFKA | FLAG_SPARSE
_FLAGS_OF_VERSION = {VERSION: FLAG_KEYS, VERSION_2: FLAGS_KNOWN, VERSION_3: FLAGS_KNOWN_V3}
CONDITION_LOCKS_HEADER = "kera-locks"
CONDITION_HWM_HEADER = "kera-high-water-mark"
# zstd level 3 is the library's default: most of the ratio at a fraction of the CPU of higher levels.
ZSTD_LEVEL = 3
U32 = struct.Struct("<I")   # a little-endian u32 field: offsets, checksums, lengths
PLAIN_LEN = U32              # the plain length before a compressed body
HEADER = struct.Struct("<HBBIIIQQQIIIIQ")
HEADER_SIZE_V1 = HEADER.size   # versions 1 and 2
assert HEADER_SIZE_V1 == 64
NUMBER = struct.Struct("<Q")
NUMBER_AT = 64
HEADER_SIZE = HEADER_SIZE_V1 + NUMBER.size   # version 3: every chunk this kera writes
_HEADER_V3 = struct.Struct(HEADER.format + "Q")   # a version 3 header, its number included
# A version 3 header in the two pieces its checksum covers (magic, version, flags | every
# field after the checksum, the record number last): built and summed without a buffer.
_HEADER_LEAD = struct.Struct("<HBB")
_HEADER_AFTER_CRC = struct.Struct("<IIQQQIIIIQQ")
assert _HEADER_LEAD.size + 4 + _HEADER_AFTER_CRC.size == HEADER_SIZE
ATTRS = struct.Struct("<IIQ")  # group, segment, base_offset
ATTRS_AT = 48
# A version 3 header's attributes and record number, adjacent (48..72): stamped in one call.
_ATTRS_NUMBER = struct.Struct(ATTRS.format + "Q")
assert ATTRS_AT + ATTRS.size == NUMBER_AT
UNSET_U32 = 0xFFFFFFFF
UNSET_U64 = 0xFFFFFFFFFFFFFFFF
_I64 = struct.Struct("<q")   # one timestamp, repeated for a chunk that shares it
# Shapes (records, bytes per record) of fixed-width batches whose offsets columns are kept: a
# producer sends a handful of shapes (a full chunk, the tail of a batch) over and over.
UNIFORM_OFFSETS_CACHED = 64
# One chunk may not exceed this many bytes; it bounds what a producer may build and a
# broker or backup must accept.
MAX_CHUNK_BYTES = 64 * 1024 * 1024
# A Kafka batch's records decode into one chunk's columns: they are bounded alike.
assert kafka_batch.MAX_PLAIN_BYTES == MAX_CHUNK_BYTES

crc32c = _crc32c.crc32c


class ChunkHeader(NamedTuple):
    flags: int
    header_crc: int
    body_crc: int
    body_len: int
    producer_id: int
    sequence: int
    stream_id: int
    streamlet: int
    record_count: int
    group: int
    segment: int
    base_offset: int
    version: int = VERSION_3
    number: int | None = None   # of the first record; None: unstamped, or written before v3

    @property
    def header_size(self) -> int:
        return HEADER_SIZE if self.version == VERSION_3 else HEADER_SIZE_V1

    @property
    def size(self) -> int:
        return self.header_size + self.body_len

    @property
    def has_keys(self) -> bool:
        return bool(self.flags & FLAG_KEYS)


def read_header(buf) -> ChunkHeader:
    """Parse and sanity-check the header; raises CorruptChunk on anything off."""
    return _as_header(_header_fields(buf, 0))


def _header_fields(buf, at: int) -> tuple:
    """The sanity-checked header fields of the chunk at byte `at` of `buf` (magic, version,
    flags, ..., base_offset, number: a version 1/2 header gets UNSET_U64 for the number)."""
    size = len(buf) - at
    if size >= HEADER_SIZE and buf[at + 2] == VERSION_3:   # every chunk this kera writes
        fields = _HEADER_V3.unpack_from(buf, at)
    elif size < HEADER_SIZE_V1:
        raise CorruptChunk(f"chunk of {size} bytes is shorter than its {HEADER_SIZE_V1}-byte header")
    else:
        fields = HEADER.unpack_from(buf, at) + (UNSET_U64,)
    magic, version, flags = fields[0], fields[1], fields[2]
    if magic != MAGIC:
        raise CorruptChunk(f"bad chunk magic 0x{magic:04x}")
    known = _FLAGS_OF_VERSION.get(version)
    if known is None:
        raise CorruptChunk(f"unsupported chunk version {version}: upgrade this kera to read it")
    if flags & ~known:
        raise CorruptChunk(f"unknown flags 0x{flags:02x} in a version {version} chunk")
    if flags & COMPRESSION_MASK == COMPRESSION_MASK:   # code 3: no such codec
        raise CorruptChunk(f"unknown compression code in flags 0x{flags:02x}")
    body_len = fields[5]
    hsize = HEADER_SIZE if version == VERSION_3 else HEADER_SIZE_V1
    if hsize + body_len > size:
        raise CorruptChunk(f"chunk body of {body_len} bytes is truncated to {size - hsize}")
    if flags & FLAG_KAFKA:
        _check_kafka_flags(flags, body_len)
    elif flags & COMPRESSION_MASK:
        if body_len < PLAIN_LEN.size:
            raise CorruptChunk(f"compressed chunk body of {body_len} bytes has no length prefix")
    elif _fixed_columns_size(fields[10], flags) > body_len:
        raise CorruptChunk(f"{fields[10]} records cannot fit a {body_len}-byte body")
    return fields


def _check_kafka_flags(flags: int, body_len: int) -> None:
    if flags != FLAG_KAFKA:
        raise CorruptChunk(f"flags 0x{flags:02x}: a Kafka batch chunk carries no other flag")
    if body_len < kafka_batch.HEADER_SIZE:
        raise CorruptChunk(f"a {body_len}-byte body cannot hold a Kafka batch's "
                           f"{kafka_batch.HEADER_SIZE}-byte header")


def _as_header(fields: tuple) -> ChunkHeader:
    number = fields[14]
    # ChunkHeader's fields are the header's from flags to base_offset, then version and
    # number; tuple.__new__ skips the namedtuple's Python-level constructor.
    return tuple.__new__(ChunkHeader, fields[2:14] + (
        fields[1], None if number == UNSET_U64 else number))


def chunk_size(buf, at: int = 0) -> int:
    """Total size of the chunk starting at `at`, from its header alone."""
    header_size = HEADER_SIZE if buf[at + 2] == VERSION_3 else HEADER_SIZE_V1
    return header_size + struct.unpack_from("<I", buf, at + 12)[0]


def frame_chunks(frame) -> Iterator[memoryview]:
    """The chunks laid back to back in one frame (a fetch reply's frame holds one or more), as
    views, cut by their headers' sizes; their checksums are the caller's to check. Raises
    CorruptChunk on bytes that are not whole chunks."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    end = len(buf)
    if not end:
        raise CorruptChunk("an empty frame holds no chunk")
    at = 0
    while at < end:
        if end - at < HEADER_SIZE_V1:
            raise CorruptChunk(f"{end - at} stray bytes after the chunks of a frame")
        size = chunk_size(buf, at)
        if at + size > end:
            raise CorruptChunk(f"a frame ends {at + size - end} bytes inside its last chunk")
        yield buf[at:at + size]
        at += size


def verify(buf) -> ChunkHeader:
    """Check header sanity and both checksums; returns the header. The pair of checks a
    receiver runs on every chunk before storing it."""
    mv = buf if type(buf) is memoryview else memoryview(buf)
    fields = _header_fields(mv, 0)
    _check_sums(mv, 0, fields)
    return _as_header(fields)


def verified_end(view: memoryview, at: int) -> int:
    """`verify` of the chunk at byte `at` of a flat byte view, returning where it ends: for
    a receiver that cuts a frame of chunks (a backup's replication write) and needs no header
    object (a third less time per 1 KiB chunk than `verify` of a slice)."""
    return _check_sums(view, at, _header_fields(view, at))


def _check_sums(mv: memoryview, at: int, fields: tuple) -> int:
    hsize = HEADER_SIZE if fields[1] == VERSION_3 else HEADER_SIZE_V1
    if crc32c(mv[at + 8:at + hsize], crc32c(mv[at:at + 4])) != fields[3]:   # header_crc, inlined
        raise CorruptChunk("chunk header checksum mismatch")
    end = at + hsize + fields[5]
    if crc32c(mv[at + hsize:end]) != fields[4]:
        raise CorruptChunk("chunk body checksum mismatch")
    return end


def stamp(buf, group: int, segment: int, base_offset: int, number: int | None = None) -> None:
    """Write the broker's append attributes into a writable chunk buffer and re-seal the
    header checksum (the body checksum is untouched). `number` (of the first record) is
    written into version 3 chunks; older ones have no room for it."""
    if number is not None and buf[2] == VERSION_3:
        _ATTRS_NUMBER.pack_into(buf, ATTRS_AT, group, segment, base_offset, number)
    else:
        ATTRS.pack_into(buf, ATTRS_AT, group, segment, base_offset)
    U32.pack_into(buf, 4, header_crc(buf))


def header_crc(buf) -> int:
    """The header checksum: every header byte but the checksum field itself."""
    mv = memoryview(buf)
    end = HEADER_SIZE if mv[2] == VERSION_3 else HEADER_SIZE_V1
    return crc32c(mv[8:end], crc32c(mv[0:4]))


def _fixed_columns_size(count: int, flags: int) -> int:
    size = 8 * count + 4 * (count + 1)
    if flags & FLAG_SPARSE:
        size += _sparse_size(count)
    if flags & FLAG_KEYS:
        size += 4 * (count + 1) + count
    if flags & FLAG_VALUE_NULLS:
        size += count
    if flags & FLAG_HEADERS:
        size += 4 * (count + 1) + 8
    return size


def _sparse_size(count: int) -> int:
    """Bytes of a compacted chunk's offset deltas and trailer (FLAG_SPARSE)."""
    return 4 * (count + 1) + SPARSE_TRAILER.size


class Compacted(NamedTuple):
    """A compacted chunk's place, from its header's sequence field."""
    generation: int
    piece: int
    last: bool
    span: int


def compacted_sequence(generation: int, piece: int, last: bool, span: int) -> int:
    """The sequence field of a compacted chunk (the layout is at SPAN_BITS)."""
    if not (0 < generation <= GENERATION_MAX and 0 <= piece <= PIECE_MAX and 0 < span <= SPAN_MAX):
        raise ValueError(f"compacted chunk generation {generation}, piece {piece}, span {span} "
                         f"out of range")
    return (generation << (SPAN_BITS + 1 + PIECE_BITS) | piece << (SPAN_BITS + 1)
            | int(last) << SPAN_BITS | span)


def compacted(h: ChunkHeader) -> Compacted | None:
    """Where a compacted chunk lies in its rewrite; None for any other chunk."""
    if not h.flags & FLAG_SPARSE:
        return None
    seq = h.sequence
    return Compacted(seq >> (SPAN_BITS + 1 + PIECE_BITS), (seq >> (SPAN_BITS + 1)) & PIECE_MAX,
                     bool(seq >> SPAN_BITS & 1), seq & SPAN_MAX)


def offsets_covered(h: ChunkHeader) -> int:
    """Record offsets (and numbers) a stored chunk covers, from its header: its record count,
    but a compacted chunk's span, which covers its gaps too."""
    return h.sequence & SPAN_MAX if h.flags & FLAG_SPARSE else h.record_count


def compression_name(flags: int) -> str | None:
    code = (flags & COMPRESSION_MASK) >> COMPRESSION_SHIFT
    for name, c in COMPRESSIONS.items():
        if c == code:
            return name
    raise CorruptChunk(f"unknown compression code {code}")


def compress(plain: bytes, compression: str | None) -> bytes:
    """The stored body for `plain` under `compression` (None: `plain` itself). The frames
    carry their own content checksum so a body damaged before sealing is still refused."""
    if compression is None:
        return plain
    if compression == "lz4":
        import lz4.frame
        packed = lz4.frame.compress(plain, content_checksum=True)
    elif compression == "zstd":
        import zstandard
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(plain)
    else:
        raise ValueError(f"compression must be one of {sorted(k for k in COMPRESSIONS if k)} or None, "
                         f"not {compression!r}")
    return PLAIN_LEN.pack(len(plain)) + packed


def decompress(stored, flags: int) -> bytes:
    """The plain body of a compressed stored body; CorruptChunk if it does not decode to the
    length its prefix promises (bounded by MAX_CHUNK_BYTES so a lying prefix cannot balloon)."""
    name = compression_name(flags)
    plain_len, = PLAIN_LEN.unpack_from(stored, 0)
    if plain_len > MAX_CHUNK_BYTES:
        raise CorruptChunk(f"compressed chunk claims {plain_len} plain bytes, over {MAX_CHUNK_BYTES}")
    packed = bytes(stored[PLAIN_LEN.size:])
    try:
        if name == "lz4":
            import lz4.frame
            plain = lz4.frame.decompress(packed)
        else:
            import zstandard
            plain = zstandard.ZstdDecompressor().decompress(packed, max_output_size=plain_len)
    except Exception as err:  # the libraries raise their own types for bad frames
        raise CorruptChunk(f"{name} chunk body does not decompress: {err}") from None
    if len(plain) != plain_len:
        raise CorruptChunk(f"{name} chunk body decompressed to {len(plain)} bytes, not {plain_len}")
    return plain


def check_columns(buf, h: ChunkHeader) -> None:
    """O(1) layout check of a stored chunk: the column sizes the header and the last offsets
    imply add up to the body length (per-record monotonicity is left to readers). A compressed
    body is decompressed only by consumers: here its plain length and its codec's frame magic
    are checked, so a chunk whose flags claim a compression its body does not have is refused.
    A Kafka batch body is checked by kafka_batch.check (its CRC, lengths, count), and its record
    count must be the header's."""
    if h.flags & FLAG_KAFKA:
        _check_kafka(buf, h)
        return
    if h.flags & COMPRESSION_MASK:
        _check_compressed(buf, h)
        return
    n = h.record_count
    hsize = h.header_size
    at = hsize + 8 * n
    first, = U32.unpack_from(buf, at)
    size = 12 * n + 4 + U32.unpack_from(buf, at + 4 * n)[0]
    at += 4 * (n + 1)
    if h.flags & FLAG_KEYS:
        k_first, = U32.unpack_from(buf, at)
        size += 4 * (n + 1) + U32.unpack_from(buf, at + 4 * n)[0] + n
        first |= k_first
        at += 4 * (n + 1)
    if h.flags & FLAG_VALUE_NULLS:
        size += n
    if h.flags & FLAG_HEADERS:
        size += _headers_size(buf, hsize + size, n, hsize + h.body_len)
    if h.flags & FLAG_SPARSE:
        size += _sparse_size(n)
    if first != 0 or size != h.body_len:
        raise CorruptChunk("chunk columns do not add up to its body length")


def _check_kafka(buf, h: ChunkHeader) -> None:
    batch = kafka_batch.check(memoryview(buf)[h.header_size:h.size])
    if batch.count != h.record_count:
        raise CorruptChunk(f"Kafka batch of {batch.count} records in a chunk of {h.record_count}")


def wrap(batch, producer_id: int, sequence: int, stream_id: int, streamlet: int) -> bytes:
    """A version 3 chunk (FLAG_KAFKA) holding the Kafka batch `batch` as it is; CorruptChunk
    if it is not one well-formed batch (kafka_batch.check)."""
    h = kafka_batch.check(batch)
    return seal(FLAG_KAFKA, batch, producer_id, sequence, stream_id, streamlet, h.count)


def kafka_rows(c: "Chunk") -> list[tuple]:
    """The records of chunk `c` as kafka_batch.build's rows (timestamp_ms, key, value,
    headers), from its columns: a few Python calls per column, one tuple per record."""
    n = len(c)
    times_ms = (c.timestamps // 1000).tolist()   # µs to ms, floored as Kafka clients do
    headers = c.headers() if c.has_headers else [()] * n
    return list(zip(times_ms, c.keys(), c.values(), headers))


# The first bytes of an lz4 frame and of a zstd frame (their format specifications).
FRAME_MAGIC = {"lz4": b"\x04\x22\x4d\x18", "zstd": b"\x28\xb5\x2f\xfd"}


def _check_compressed(buf, h: ChunkHeader) -> None:
    at = h.header_size
    plain_len, = PLAIN_LEN.unpack_from(buf, at)
    name = compression_name(h.flags)
    magic = FRAME_MAGIC[name]
    if plain_len > MAX_CHUNK_BYTES or h.body_len < PLAIN_LEN.size + len(magic) or \
            bytes(buf[at + PLAIN_LEN.size:at + PLAIN_LEN.size + len(magic)]) != magic:
        raise CorruptChunk(f"chunk flagged {name} does not hold a {name} frame of at most "
                           f"{MAX_CHUNK_BYTES} plain bytes")


def _headers_size(buf, at: int, n: int, end: int) -> int:
    """Bytes of the headers section starting at `at`, from its offset columns' last entries."""
    if at + 4 * (n + 1) > end:
        raise CorruptChunk("chunk headers index runs past its body")
    m, = U32.unpack_from(buf, at + 4 * n)
    k_at = at + 4 * (n + 1)
    if k_at + 8 * (m + 1) > end:
        raise CorruptChunk(f"chunk headers of {m} entries run past its body")
    keys_len, = U32.unpack_from(buf, k_at + 4 * m)
    values_len, = U32.unpack_from(buf, k_at + 4 * (m + 1) + 4 * m)
    return 4 * (n + 1) + 8 * (m + 1) + keys_len + values_len


# --------------------------------------------------------------------------- building

def values_columns(values) -> tuple[object, np.ndarray]:
    """(blob, u32 offsets[n+1]) for a batch of values, with O(1) Python calls.

    Accepts a sequence of bytes-like, a pyarrow Binary/LargeBinary array, a numpy 'S' array
    (trailing NUL bytes are not part of a value, as numpy itself reads them) or a 2-D uint8
    array (each row one fixed-width value).
    """
    if isinstance(values, np.ndarray):
        return _numpy_columns(values)
    if hasattr(values, "buffers") and hasattr(values, "offset"):  # pyarrow array
        return _arrow_columns(values)
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blob = b"".join(values)
    return blob, _as_u32_offsets(offsets)


def _numpy_columns(values: np.ndarray):
    n = values.shape[0]
    # The blob is a flat uint8 view, not a bytes copy: seal_parts' join is its one copy.
    if values.dtype == np.uint8 and values.ndim == 2:
        return np.ascontiguousarray(values).reshape(-1), _uniform_offsets(n, values.shape[1])
    if values.dtype.kind == "S" and values.ndim == 1:
        width = values.dtype.itemsize
        lengths = np.char.str_len(values).astype(np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if n and lengths.min() == width:
            return np.ascontiguousarray(values).view(np.uint8), _as_u32_offsets(offsets)
        grid = np.ascontiguousarray(values).view(np.uint8).reshape(n, width)
        mask = np.arange(width) < lengths[:, None]
        return grid[mask].tobytes(), _as_u32_offsets(offsets)
    raise TypeError(f"values array must be 1-D bytes ('S') or 2-D uint8, not {values.dtype} "
                    f"with {values.ndim} dimensions")


def _arrow_columns(array):
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise TypeError("values may not be null")
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        array = array.cast(pa.large_binary() if pa.types.is_large_string(array.type) else pa.binary())
    if pa.types.is_binary(array.type):
        off_dtype = np.int32
    elif pa.types.is_large_binary(array.type):
        off_dtype = np.int64
    else:
        raise TypeError(f"values must be binary, not {array.type}")
    _, off_buf, data_buf = array.buffers()
    n = len(array)
    offsets = np.frombuffer(off_buf, dtype=off_dtype, count=n + 1, offset=array.offset * off_dtype().itemsize)
    offsets = offsets.astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    blob = memoryview(data_buf)[start:end] if data_buf is not None else b""
    return blob, _as_u32_offsets(offsets - start)


@functools.lru_cache(maxsize=UNIFORM_OFFSETS_CACHED)
def _uniform_offsets(n: int, width: int) -> np.ndarray:
    """The (read-only) u32 offsets of `n` values of `width` bytes each. A producer sends the
    same shape again and again; building them (arange, bound check, cast) was about 3 us of a
    4 KiB chunk's encode."""
    offsets = _as_u32_offsets(np.arange(n + 1, dtype=np.int64) * width)   # width 0: empty values
    offsets.setflags(write=False)
    return offsets


def _as_u32_offsets(offsets: np.ndarray) -> np.ndarray:
    if len(offsets) and offsets[-1] > MAX_CHUNK_BYTES:
        raise RecordTooLarge(f"{int(offsets[-1])} bytes of values exceed the {MAX_CHUNK_BYTES}-byte chunk limit")
    return offsets.astype("<u4")


def encode(producer_id: int, sequence: int, stream_id: int, streamlet: int, values,
           keys: Sequence[bytes | None] | None = None, timestamps=None, headers=None,
           compression: str | None = None, condition: tuple | None = None) -> bytes:
    """Build one chunk. `values` as for values_columns, or a list whose None entries are
    tombstones; `keys` a sequence of bytes or None (same length as values) or None for no
    keys; `timestamps` None (now), an int (all the same) or an int64 sequence, in
    microseconds; `headers` None or one sequence of (str, bytes) pairs (or None) per record;
    `compression` None, "lz4" or "zstd"; `condition` None or (lock ids, high-water mark) for a
    conditional append (FLAG_CONDITION)."""
    if (type(values) is np.ndarray and values.dtype == _U1 and values.ndim == 2 and keys is None
            and headers is None and compression is None and condition is None):
        return _encode_rows(producer_id, sequence, stream_id, streamlet, values, timestamps)
    if condition is not None:
        headers = _with_condition(headers, len(values), *condition)
    values, value_nulls = _split_nulls(values)
    blob, offsets = values_columns(values)
    return encode_columns(producer_id, sequence, stream_id, streamlet, blob, offsets, keys,
                          timestamps, value_nulls, headers, compression,
                          FLAG_CONDITION if condition is not None else 0)


def _split_nulls(values) -> tuple[object, np.ndarray | None]:
    """(`values` with each None as b"", u8 value nulls or None): a list's Nones are tombstones."""
    if isinstance(values, (list, tuple)) and None in values:
        value_nulls = np.fromiter((v is None for v in values), dtype=np.uint8, count=len(values))
        return [b"" if v is None else v for v in values], value_nulls
    return values, None


def _encode_rows(producer_id: int, sequence: int, stream_id: int, streamlet: int,
                 rows: np.ndarray, timestamps) -> bytes:
    """`encode` of a 2-D uint8 array of values alone (one row per value): what encode_columns
    builds for it, without the steps of the other layouts (bench/test_batch_encode.py)."""
    n, width = rows.shape
    # A flat view: seal_parts counts its parts' lengths, and a 2-D array's is its row count.
    body = [_timestamps_bytes(timestamps, n), _uniform_offsets_bytes(n, width),
            np.ascontiguousarray(rows).reshape(-1)]
    return seal_parts(0, body, producer_id, sequence, stream_id, streamlet, n)


@functools.lru_cache(maxsize=UNIFORM_OFFSETS_CACHED)
def _uniform_offsets_bytes(n: int, width: int) -> bytes:
    return _uniform_offsets(n, width).tobytes()


def _with_condition(headers, n: int, locks, high_water_mark: int) -> list:
    """`headers` with the condition's two headers first on record 0."""
    if n == 0:
        raise ValueError("a conditional append needs at least one record")
    out = list(headers) if headers is not None else [None] * n
    packed = np.asarray(list(locks), dtype="<u8").tobytes()
    out[0] = [(CONDITION_LOCKS_HEADER, packed),
              (CONDITION_HWM_HEADER, struct.pack("<q", high_water_mark)), *(out[0] or ())]
    return out


def read_condition(c: "Chunk") -> tuple[tuple[int, ...], int]:
    """(lock ids, high-water mark) of a conditional chunk; CorruptChunk if they are missing
    or malformed."""
    try:
        first = c.headers()[0] if len(c) and c.has_headers else []
    except (UnicodeDecodeError, ValueError, IndexError) as err:
        raise CorruptChunk(f"conditional chunk headers do not decode: {err}") from None
    found = dict(first[:2])
    locks, hwm = found.get(CONDITION_LOCKS_HEADER), found.get(CONDITION_HWM_HEADER)
    if locks is None or hwm is None or len(locks) % 8 or len(hwm) != 8:
        raise CorruptChunk("conditional chunk without well-formed lock and high-water-mark headers")
    return tuple(np.frombuffer(locks, dtype="<u8").tolist()), struct.unpack("<q", hwm)[0]


def encode_columns(producer_id: int, sequence: int, stream_id: int, streamlet: int, blob,
                   offsets: np.ndarray, keys=None, timestamps=None, value_nulls=None,
                   headers=None, compression: str | None = None, extra_flags: int = 0) -> bytes:
    n = len(offsets) - 1
    flags, body = _plain_body(blob, offsets, keys, timestamps, value_nulls, headers)
    flags |= extra_flags | (COMPRESSIONS.get(compression, 0) << COMPRESSION_SHIFT)
    if compression is not None:
        body = [compress(b"".join(body), compression)]
    return seal_parts(flags, body, producer_id, sequence, stream_id, streamlet, n)


def _plain_body(blob, offsets: np.ndarray, keys, timestamps, value_nulls,
                headers) -> tuple[int, list]:
    """(flags, the parts of the plain body) of encode_columns' arguments."""
    n = len(offsets) - 1
    parts = [_timestamps_bytes(timestamps, n), offsets.tobytes()]
    flags = 0
    key_tail: list = []
    if keys is not None:
        keys = keys if isinstance(keys, list) else list(keys)
        nones = keys.count(None)  # C speed: the common all-present case skips per-key Python
    if keys is not None and nones < len(keys):
        if len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} values")
        flags |= FLAG_KEYS
        if nones:
            nulls = np.fromiter((k is None for k in keys), dtype=np.uint8, count=n)
            present = [b"" if k is None else k for k in keys]
        else:
            nulls = np.zeros(n, dtype=np.uint8)
            present = keys
        kblob, koffsets = values_columns(present)
        parts.append(koffsets.tobytes())
        key_tail = [kblob, nulls.tobytes()]
    v2_tail, v2_flags = _v2_columns(n, value_nulls, headers)
    return flags | v2_flags, [*parts, blob, *key_tail, *v2_tail]


def _v2_columns(n: int, value_nulls, headers) -> tuple[list, int]:
    """The version-2 tail columns (value nulls, headers) and their flags; empty when unused."""
    tail, flags = [], 0
    if value_nulls is not None and value_nulls.any():
        flags |= FLAG_VALUE_NULLS
        tail.append(np.asarray(value_nulls, dtype=np.uint8).tobytes())
    if headers is not None and any(headers):
        if len(headers) != n:
            raise ValueError(f"{len(headers)} header lists for {n} values")
        flags |= FLAG_HEADERS
        tail.extend(_headers_columns(headers))
    return tail, flags


def _headers_columns(headers) -> list[bytes]:
    index = np.zeros(len(headers) + 1, dtype=np.int64)
    np.cumsum([len(h) if h else 0 for h in headers], out=index[1:])
    pairs = [pair for h in headers if h for pair in h]
    for k, v in pairs:
        if not isinstance(k, str) or not isinstance(v, (bytes, bytearray, memoryview)):
            raise TypeError(f"a header is a (str key, bytes value) pair, not ({type(k).__name__}, "
                            f"{type(v).__name__})")
    kblob, koffsets = values_columns([k.encode() for k, _ in pairs])
    vblob, voffsets = values_columns([bytes(v) for _, v in pairs])
    return [_as_u32_offsets(index).tobytes(), koffsets.tobytes(), voffsets.tobytes(),
            bytes(kblob), bytes(vblob)]


def encode_sparse(stream_id: int, streamlet: int, place: tuple, keys: list, values: list,
                  timestamps, headers, deltas, span: int, horizon_ms: int | None) -> bytes:
    """A compacted chunk (FLAG_SPARSE, docs/COMPACTION.md) of the records at offset deltas
    `deltas` (ascending, below `span`) from the base offset it will be stamped with; `values`
    with None for tombstones, `horizon_ms` the delete horizon of its tombstones (None: none).
    Its producer is COMPACTED_PRODUCER_ID; `place` = (generation, piece, last) names its
    rewrite and its place in it (its sequence field, with the span: `compacted`)."""
    n = len(values)
    full = np.empty(n + 1, dtype="<u4")
    full[:n] = np.asarray(deltas, dtype=np.int64) if n else []
    full[n] = span
    if len(keys) != n or (n and full[n - 1] >= span):
        raise ValueError(f"{len(keys)} keys, {n} values and deltas {list(full[:n])[:4]}... "
                         f"must match and lie below the span {span}")
    _check_deltas(full)
    values, value_nulls = _split_nulls(list(values))
    blob, offsets = values_columns(values)
    flags, parts = _plain_body(blob, offsets, keys, np.asarray(timestamps, dtype="<i8"),
                               value_nulls, headers)
    trailer = SPARSE_TRAILER.pack(UNSET_U64 if horizon_ms is None else horizon_ms, 0)
    return seal_parts(flags | FLAG_SPARSE, [*parts, full.tobytes(), trailer],
                      COMPACTED_PRODUCER_ID, compacted_sequence(*place, span), stream_id,
                      streamlet, n)


def seal(flags: int, body: bytes, producer_id: int, sequence: int, stream_id: int,
         streamlet: int, count: int) -> bytes:
    """A version 3 chunk of `body`, not yet appended (no group, segment, offsets, number)."""
    return seal_parts(flags, [body], producer_id, sequence, stream_id, streamlet, count)


def seal_parts(flags: int, body: list, producer_id: int, sequence: int, stream_id: int,
               streamlet: int, count: int) -> bytes:
    """`seal` of the body laid out as the concatenation of `body`'s parts: the body checksum
    is chained over the parts and the header's over its two packed pieces, so the chunk is
    built with one join (1 KiB chunks: 0.9 us against 1.8 us for a header buffer packed,
    summed and copied, then a second copy of the body)."""
    body_crc, body_len = 0, 0
    for part in body:
        body_crc = crc32c(part, body_crc)
        body_len += len(part)
    if body_len + HEADER_SIZE > MAX_CHUNK_BYTES:
        raise RecordTooLarge(f"chunk of {body_len + HEADER_SIZE} bytes exceeds {MAX_CHUNK_BYTES}")
    head = _HEADER_LEAD.pack(MAGIC, VERSION_3, flags)
    rest = _HEADER_AFTER_CRC.pack(body_crc, body_len, producer_id, sequence, stream_id, streamlet,
                                  count, UNSET_U32, UNSET_U32, UNSET_U64, UNSET_U64)
    return b"".join([head, U32.pack(crc32c(rest, crc32c(head))), rest, *body])


# The stream id of a void chunk: no stream has it (stream ids start at 1).
VOID_STREAM_ID = 0
# The smallest void chunk: a header and the value-offsets column of no record (a chunk with a
# record is larger).
VOID_SIZE_MIN = HEADER_SIZE + 4


def void(size: int) -> bytes:
    """A chunk of exactly `size` bytes holding no record, of no stream (VOID_STREAM_ID): what a
    virtual segment's replica gets in place of a chunk the broker released before sending it
    there (compacted away, deleted), so every copy of a virtual segment keeps one byte layout
    and recovery may read any of them from any offset. Readers of replicas skip it (no stream
    of theirs). `size` is at least VOID_SIZE_MIN."""
    if size < VOID_SIZE_MIN:
        raise ValueError(f"a void chunk is at least {VOID_SIZE_MIN} bytes, not {size}")
    return seal(0, bytes(size - HEADER_SIZE), COMPACTED_PRODUCER_ID, 0, VOID_STREAM_ID, 0, 0)


def reseal(chunk, producer_id: int, sequence: int) -> bytes:
    """A copy of `chunk` with a new producer identity (header CRC recomputed)."""
    buf = bytearray(chunk)
    struct.pack_into("<QQ", buf, 16, producer_id, sequence)
    struct.pack_into("<I", buf, 4, header_crc(buf))
    return bytes(buf)


def _timestamps_bytes(timestamps, n: int) -> bytes:
    """The timestamps column (little-endian int64 µs). One time for all records is repeated
    as bytes: np.full + tobytes took 2-3 us per chunk, the repeat 0.2 us."""
    if timestamps is None:
        timestamps = time.time_ns() // 1000
    if isinstance(timestamps, (int, np.integer)):
        try:
            return _I64.pack(int(timestamps)) * n
        except struct.error:
            raise ValueError(f"timestamp {timestamps} µs does not fit a signed 64-bit integer") from None
    ts = np.asarray(timestamps, dtype="<i8")
    if ts.shape != (n,):
        raise ValueError(f"{ts.shape[0] if ts.ndim else 1} timestamps for {n} values")
    return ts.tobytes()


# --------------------------------------------------------------------------- reading

# Column dtypes, passed to np.frombuffer positionally: its keyword form costs 0.4 us more a call
# (0.75 against 0.36 us), about a tenth of a 1 KiB chunk's decode on a consumer.
_U4, _I8, _U1 = np.dtype("<u4"), np.dtype("<i8"), np.dtype(np.uint8)
# Flags that change where a chunk's columns lie (Chunk._plain_values handles none of them).
_COLUMN_FLAGS = (FLAG_KEYS | FLAG_VALUE_NULLS | FLAG_HEADERS | COMPRESSION_MASK | FLAG_KAFKA
                 | FLAG_SPARSE)
# The extremes of an i64 of microseconds, in milliseconds: a Kafka timestamp (ms, any i64) past
# them is clamped to them rather than wrapped when it becomes kera's microseconds.
_KAFKA_MS_MAX = (2 ** 63 - 1) // 1000


class Chunk:
    """A decoded view over one chunk's bytes: numpy columns without copying."""

    __slots__ = ("buf", "header", "_timestamps", "value_offsets", "key_offsets", "_values_at",
                 "_keys_at", "_nulls_at", "_vnulls_at", "_headers_at", "_kafka")

    def __init__(self, buf, check: bool = True):
        self.buf = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
        h = verify(self.buf) if check else read_header(self.buf)
        self.header = h
        if not h.flags & _COLUMN_FLAGS:
            self._plain_values(h)
            return
        if h.flags & FLAG_KAFKA:   # decoded on first use of anything but the header
            self.__class__ = _KafkaChunk
            self._kafka = self.buf
            del self.buf   # unset, so that its first use decodes (_KafkaChunk.__getattr__)
            return
        hsize = h.header_size
        if h.flags & COMPRESSION_MASK:  # decompress once; the columns then view the plain copy
            stored = self.buf[hsize:hsize + h.body_len]
            self.buf = memoryview(bytes(self.buf[:hsize]) + decompress(stored, h.flags))
            if _fixed_columns_size(h.record_count, h.flags) > len(self.buf) - hsize:
                raise CorruptChunk(f"{h.record_count} records cannot fit a decompressed body")
        end = len(self.buf) if h.flags & COMPRESSION_MASK else hsize + h.body_len
        self._columns(h.flags, end)

    def _columns(self, flags: int, end: int) -> None:
        """The column views of the plain body in self.buf (laid out as `flags` say, ending at
        byte `end`); CorruptChunk if they do not fill it exactly."""
        h = self.header
        n = h.record_count
        base = h.header_size
        if flags & FLAG_SPARSE:   # the offset deltas and trailer close the body
            end -= _sparse_size(n)
            _check_deltas(np.frombuffer(self.buf, _U4, n + 1, end), h)
        # Made on first use: many readers never look at them, and the view was a fourteenth
        # of a consumer's busy samples at 1 KiB chunks (the streams preset).
        self._timestamps = None
        base += 8 * n
        self.value_offsets = np.frombuffer(self.buf, _U4, n + 1, base)
        base += 4 * (n + 1)
        self.key_offsets = None
        if flags & FLAG_KEYS:
            self.key_offsets = np.frombuffer(self.buf, _U4, n + 1, base)
            base += 4 * (n + 1)
        self._values_at = base
        self._keys_at = base + int(self.value_offsets[-1])
        self._nulls_at = -1
        tail = self._keys_at
        if self.key_offsets is not None:
            self._nulls_at = self._keys_at + int(self.key_offsets[-1])
            tail = self._nulls_at + n
        self._vnulls_at = -1
        if flags & FLAG_VALUE_NULLS:
            self._vnulls_at, tail = tail, tail + n
        self._headers_at = -1
        if flags & FLAG_HEADERS:
            self._headers_at = tail
            tail += _headers_size(self.buf, tail, n, end)
        if tail != end or not _monotonic(self.value_offsets) or (
                self.key_offsets is not None and not _monotonic(self.key_offsets)):
            raise CorruptChunk("chunk columns do not match its body length")

    def _plain_values(self, h: ChunkHeader) -> None:
        """__init__ of the usual chunk: uncompressed values alone (no keys, nulls or headers).
        The same columns and checks, without the other layouts' steps (0.3 of the 4.5 us that
        decoding a 1 KiB chunk took, bench/test_chunk_decode.py)."""
        n = h.record_count
        base = (HEADER_SIZE if h.version == VERSION_3 else HEADER_SIZE_V1) + 8 * n
        self._timestamps = None
        self.value_offsets = offsets = np.frombuffer(self.buf, _U4, n + 1, base)
        self.key_offsets = None
        self._values_at = base = base + 4 * (n + 1)
        self._keys_at = end = base + U32.unpack_from(self.buf, base - 4)[0]
        self._nulls_at = self._vnulls_at = self._headers_at = -1
        if end != base - 12 * n - 4 + h.body_len or not _monotonic(offsets):
            raise CorruptChunk("chunk columns do not match its body length")

    def __len__(self) -> int:
        return self.header.record_count

    # ------------------------------------------------------------------ gaps (FLAG_SPARSE)
    @property
    def offset_deltas(self) -> np.ndarray | None:
        """u32[n+1] of a compacted chunk: record i is offset `base_offset + delta[i]` (number
        `first_number + delta[i]`), the last entry is its span; None when its records' numbers
        are dense (every chunk a producer writes)."""
        if not self.header.flags & FLAG_SPARSE:
            return None
        n = len(self)
        return np.frombuffer(self.buf, _U4, n + 1, self._sparse_at())

    @property
    def span(self) -> int:
        """Record offsets (and numbers) the chunk covers: its record count but for a
        compacted chunk, which covers gaps too."""
        deltas = self.offset_deltas
        return len(self) if deltas is None else int(deltas[-1])

    def record_offsets(self) -> np.ndarray:
        """Each record's offset from the chunk's base offset: 0, 1, ... but for a compacted
        chunk (i8 either way, ready to add to a base)."""
        deltas = self.offset_deltas
        if deltas is None:
            return np.arange(len(self), dtype=np.int64)
        return deltas[:-1].astype(np.int64)

    def records_below(self, delta: int) -> int:
        """How many of its records lie below offset `base_offset + delta` (0 .. len): `delta`
        itself but for a compacted chunk, where it is the index of the first record at or
        after that offset, past any gap."""
        if delta <= 0:
            return 0
        deltas = self.offset_deltas
        if deltas is None:
            return min(delta, len(self))
        return int(np.searchsorted(deltas[:-1], delta))

    @property
    def delete_horizon_ms(self) -> int | None:
        """When a compacted chunk's tombstones were first kept by a compaction (None: it holds
        none, or it is not compacted): they go delete_retention_ms after it."""
        if not self.header.flags & FLAG_SPARSE:
            return None
        horizon, _ = SPARSE_TRAILER.unpack_from(self.buf, self._sparse_at() + 4 * (len(self) + 1))
        return None if horizon == UNSET_U64 else horizon

    def _sparse_at(self) -> int:
        h = self.header
        end = len(self.buf) if h.flags & COMPRESSION_MASK else h.header_size + h.body_len
        return end - _sparse_size(h.record_count)

    @property
    def timestamps(self) -> np.ndarray:
        """i8[n]: each record's time in µs, a view of the chunk's bytes."""
        if self._timestamps is None:
            self._timestamps = np.frombuffer(self.buf, _I8, len(self), self.header.header_size)
        return self._timestamps

    @property
    def first_number(self) -> int | None:
        """The record number of the first record (the others follow densely); None for a
        chunk not yet appended, or written before record numbers."""
        return self.header.number

    @property
    def values_blob(self) -> memoryview:
        return self.buf[self._values_at:self._keys_at]

    @property
    def key_nulls(self) -> np.ndarray | None:
        if self.key_offsets is None:
            return None
        return np.frombuffer(self.buf, _U1, len(self), self._nulls_at)

    @property
    def value_nulls(self) -> np.ndarray | None:
        """u8[n], 1 where the value is None (a tombstone); None when the chunk has none."""
        if self._vnulls_at < 0:
            return None
        return np.frombuffer(self.buf, _U1, len(self), self._vnulls_at)

    def values(self) -> list[bytes | None]:
        blob = bytes(self.values_blob)
        off = self.value_offsets.tolist()
        out = [blob[off[i]:off[i + 1]] for i in range(len(off) - 1)]
        if self._vnulls_at >= 0:
            for i in np.flatnonzero(self.value_nulls).tolist():
                out[i] = None
        return out

    @property
    def has_headers(self) -> bool:
        return self._headers_at >= 0

    def headers(self) -> list[list[tuple[str, bytes]]]:
        """Each record's headers as (str key, bytes value) pairs, in the order sent."""
        n = len(self)
        if self._headers_at < 0:
            return [[] for _ in range(n)]
        at = self._headers_at
        index = np.frombuffer(self.buf, _U4, n + 1, at).tolist()
        m = index[-1]
        koff_at = at + 4 * (n + 1)
        koff = np.frombuffer(self.buf, _U4, m + 1, koff_at).tolist()
        voff = np.frombuffer(self.buf, _U4, m + 1, koff_at + 4 * (m + 1)).tolist()
        k_at = koff_at + 8 * (m + 1)
        kblob = bytes(self.buf[k_at:k_at + koff[-1]])
        vblob = bytes(self.buf[k_at + koff[-1]:k_at + koff[-1] + voff[-1]])
        try:
            pairs = [(kblob[koff[j]:koff[j + 1]].decode(), vblob[voff[j]:voff[j + 1]]) for j in range(m)]
        except UnicodeDecodeError as err:
            raise CorruptChunk(f"chunk header key is not UTF-8: {err}") from None
        return [pairs[index[i]:index[i + 1]] for i in range(n)]

    def headers_arrow(self):
        """Each record's headers as one Arrow list<struct<key: string, value: binary>> column,
        built from the chunk's header columns in O(1) Python calls (the Spark connector's)."""
        import pyarrow as pa
        n = len(self)
        if self._headers_at < 0:
            return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)),
                                            _header_struct([], []), type=HEADERS_ARROW_TYPE)
        at = self._headers_at
        index = np.frombuffer(self.buf, _U4, n + 1, at)
        m = int(index[-1])
        koff_at = at + 4 * (n + 1)
        koff = np.frombuffer(self.buf, _U4, m + 1, koff_at)
        voff = np.frombuffer(self.buf, _U4, m + 1, koff_at + 4 * (m + 1))
        k_at = koff_at + 8 * (m + 1)
        kblob = self.buf[k_at:k_at + int(koff[-1])]
        vblob = self.buf[k_at + int(koff[-1]):k_at + int(koff[-1]) + int(voff[-1])]
        keys = pa.Array.from_buffers(pa.string(), m, [None, pa.py_buffer(koff.astype(np.int32)),
                                                      pa.py_buffer(kblob)])
        try:
            keys.validate(full=True)   # the keys must be UTF-8, as headers() checks
        except pa.ArrowInvalid as err:
            raise CorruptChunk(f"chunk header key is not UTF-8: {err}") from None
        values = pa.Array.from_buffers(pa.binary(), m, [None, pa.py_buffer(voff.astype(np.int32)),
                                                        pa.py_buffer(vblob)])
        return pa.ListArray.from_arrays(pa.array(index.astype(np.int32)),
                                        _header_struct(keys, values), type=HEADERS_ARROW_TYPE)

    def keys(self) -> list[bytes | None]:
        n = len(self)
        if self.key_offsets is None:
            return [None] * n
        blob = bytes(self.buf[self._keys_at:self._nulls_at])
        off = self.key_offsets.tolist()
        nulls = self.key_nulls.tolist()
        return [None if nulls[i] else blob[off[i]:off[i + 1]] for i in range(n)]

    def records(self) -> Iterator[tuple[bytes | None, bytes, int]]:
        return zip(self.keys(), self.values(), self.timestamps.tolist())

    def to_arrow(self):
        """A pyarrow RecordBatch (key binary, value binary, timestamp int64 µs), zero-copy
        over the chunk's buffer except for the offsets' widening."""
        import pyarrow as pa

        n = len(self)
        buf = pa.py_buffer(self.buf)
        value_valid = None
        if self._vnulls_at >= 0:  # tombstones are arrow nulls
            value_valid = pa.py_buffer(np.packbits(self.value_nulls == 0, bitorder="little"))
        values = pa.Array.from_buffers(
            pa.binary(), n, [value_valid, pa.py_buffer(self.value_offsets.astype(np.int32)),
                             buf.slice(self._values_at, self._keys_at - self._values_at)])
        if self.key_offsets is None:
            keys = pa.nulls(n, pa.binary())
        else:
            valid = np.packbits(self.key_nulls == 0, bitorder="little")
            keys = pa.Array.from_buffers(
                pa.binary(), n, [pa.py_buffer(valid), pa.py_buffer(self.key_offsets.astype(np.int32)),
                                 buf.slice(self._keys_at, self._nulls_at - self._keys_at)])
        ts = pa.Array.from_buffers(pa.int64(), n, [None, buf.slice(self.header.header_size, 8 * n)])
        return pa.RecordBatch.from_arrays([keys, values, ts], names=["key", "value", "timestamp"])


class _KafkaChunk(Chunk):
    """The Chunk of a FLAG_KAFKA chunk, which Chunk() turns itself into: its buf and columns are
    unset until first used, then decoded from the batch once. A class of its own because a
    class with __getattr__ loses CPython's fast attribute access (Chunk() of a 1 KiB chunk took
    3.7 us, not 3.5, with it on Chunk)."""

    __slots__ = ()

    def __getattr__(self, name: str):
        """The columns (and the plain buf), made on first use: reached only for a slot not yet
        set."""
        if name == "_kafka" or name not in Chunk.__slots__:   # not a column: no such attribute
            raise AttributeError(name)
        self._decode_kafka()
        return object.__getattribute__(self, name)

    def _decode_kafka(self) -> None:
        """Decode the Kafka batch once into the plain body of the other chunks, then view it."""
        h, stored = self.header, self._kafka
        hsize = h.header_size
        cols = kafka_batch.columns(stored[hsize:h.size])
        if len(cols.values) != h.record_count:
            raise CorruptChunk(f"Kafka batch of {len(cols.values)} records in a chunk of "
                               f"{h.record_count}")
        values, value_nulls = _split_nulls(cols.values)
        blob, offsets = values_columns(values)
        flags, parts = _plain_body(blob, offsets, cols.keys, _kafka_times_us(cols.timestamps_ms),
                                   value_nulls, _kafka_headers(cols.headers))
        buf = memoryview(b"".join([stored[:hsize], *parts]))
        self.buf = buf
        self._columns(flags, len(buf))


def _check_deltas(deltas: np.ndarray, h: ChunkHeader | None = None) -> None:
    """A compacted chunk's offset deltas ascend strictly to its span, which its header
    names too (the pair is checked: recovery trusts the header's)."""
    if deltas[-1] < 1 or (len(deltas) > 1 and not (deltas[1:] > deltas[:-1]).all()):
        raise CorruptChunk("compacted chunk offset deltas do not strictly ascend to its span")
    if h is not None and (h.producer_id != COMPACTED_PRODUCER_ID
                          or int(deltas[-1]) != offsets_covered(h)):
        raise CorruptChunk(f"compacted chunk of producer {h.producer_id} covers "
                           f"{int(deltas[-1])} offsets by its deltas, {offsets_covered(h)} by "
                           f"its header")


def _kafka_times_us(times_ms: list) -> np.ndarray:
    """Kafka's millisecond timestamps as kera's microseconds, clamped to what an i64 holds."""
    try:
        ms = np.array(times_ms, dtype=np.int64)
    except OverflowError:   # base + delta past an i64: only a hostile batch
        ms = np.array([min(max(t, -_KAFKA_MS_MAX), _KAFKA_MS_MAX) for t in times_ms], np.int64)
    return np.clip(ms, -_KAFKA_MS_MAX, _KAFKA_MS_MAX) * 1000


def _kafka_headers(headers: list) -> list | None:
    """Kafka's headers for the headers columns, which hold no null value: a null is b""."""
    if not any(headers):
        return None
    return [[(k, b"" if v is None else v) for k, v in pairs] for pairs in headers]


# Up to this many offsets a Python list is checked faster than numpy's per-call overhead
# allows (9 offsets, a 1 KiB chunk of 100-byte records: 0.7 us against 6.6 us with np.diff,
# which was a sixth of a consumer's busy samples on the streams preset; 600 offsets: numpy's
# slice comparison takes 4 us, the list 15 us).
_LIST_CHECK_OFFSETS_MAX = 64


def _monotonic(offsets: np.ndarray) -> bool:
    """Offsets start at 0 and never decrease."""
    if len(offsets) <= _LIST_CHECK_OFFSETS_MAX:
        listed = offsets.tolist()
        return listed[0] == 0 and listed == sorted(listed)
    return bool(offsets[0] == 0 and (offsets[1:] >= offsets[:-1]).all())


def _header_struct(keys, values):
    import pyarrow as pa
    return pa.StructArray.from_arrays(
        [pa.array(keys, pa.string()) if isinstance(keys, list) else keys,
         pa.array(values, pa.binary()) if isinstance(values, list) else values],
        names=["key", "value"])


def _headers_arrow_type():
    try:
        import pyarrow as pa
    except ImportError:   # pyarrow is needed only by the Spark connector's columns
        return None
    return pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


HEADERS_ARROW_TYPE = _headers_arrow_type()
