"""Arrow <-> chunk columns for the Spark connector, with O(1) Python calls per chunk.

Reading: a fetched chunk becomes the rows of the source schema (the chunk's key/value/timestamp
columns as zero-copy views, plus constant stream/streamlet/group columns and the offset range).
Writing: an Arrow slice of values (and keys) becomes one chunk, byte-for-byte what
`kera.codec.chunk.encode` builds from the same records.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kera.codec import chunk as kchunk
from kera.errors import RecordTooLarge

SCHEMA_DDL = ("key binary, value binary, stream string, streamlet int, `group` int, "
              "offset long, timestamp timestamp, headers array<struct<key: string, value: binary>>, "
              "number long")
TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
# What Spark expects a Python source to yield for SCHEMA_DDL (every field nullable).
ARROW_SCHEMA = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("stream", pa.string()),
    ("streamlet", pa.int32()), ("group", pa.int32()), ("offset", pa.int64()),
    ("timestamp", TIMESTAMP_TYPE), ("headers", kchunk.HEADERS_ARROW_TYPE), ("number", pa.int64())])


def chunk_rows(c: kchunk.Chunk, lo: int, hi: int, stream: str, streamlet: int, group: int,
               base_offset: int) -> pa.RecordBatch:
    """Records [lo, hi) of chunk `c` (indexes inside the chunk) as source rows; record i has
    offset base_offset + i, or base_offset + its offset delta in a compacted chunk."""
    kvt = c.to_arrow()
    headers = c.headers_arrow()
    if lo or hi != len(c):
        kvt = kvt.slice(lo, hi - lo)
        headers = headers.slice(lo, hi - lo)
    n = hi - lo
    keys, values, ts = kvt.column(0), kvt.column(1), kvt.column(2)
    return pa.RecordBatch.from_arrays([
        keys, values, pa.repeat(stream, n),
        pa.array(np.full(n, streamlet, dtype=np.int32)),
        pa.array(np.full(n, group, dtype=np.int32)),
        pa.array(_steps(c, base_offset, lo, hi)),
        ts.view(TIMESTAMP_TYPE), headers, _numbers(c, lo, hi)], schema=ARROW_SCHEMA)


def _numbers(c: kchunk.Chunk, lo: int, hi: int) -> pa.Array:
    """Record numbers of records [lo, hi) of chunk `c`; nulls for a chunk written before
    numbers."""
    first = c.first_number
    if first is None:
        return pa.nulls(hi - lo, pa.int64())
    return pa.array(_steps(c, first, lo, hi))


def _steps(c: kchunk.Chunk, first: int, lo: int, hi: int) -> np.ndarray:
    """`first` + the offset of each of records [lo, hi) in chunk `c` (int64): i, or its
    offset delta in a compacted chunk."""
    if not c.header.flags & kchunk.FLAG_SPARSE:
        return np.arange(first + lo, first + hi, dtype=np.int64)
    return first + c.record_offsets()[lo:hi]


def concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One batch out of many (one copy): Spark pays per batch, so few large ones are cheaper."""
    if len(batches) == 1:
        return batches[0]
    if hasattr(pa, "concat_batches"):
        return pa.concat_batches(batches)
    return pa.Table.from_batches(batches, schema=ARROW_SCHEMA).combine_chunks().to_batches()[0]


# --------------------------------------------------------------------------- writing

def header_pairs(headers: pa.Array | None) -> list | None:
    """Each row's headers as (str, bytes) pairs for kera.codec.chunk, or None when no row has any.
    A null header value is stored as b"" (kera header values are bytes)."""
    if headers is None or not pc.any(pc.greater(pc.list_value_length(headers), 0)).as_py():
        return None
    out = []
    for row in headers.to_pylist():
        pairs = []
        for h in row or ():
            if h is None or h["key"] is None:
                raise ValueError("a header needs a key: the 'headers' column holds a null one")
            value = h["value"]
            pairs.append((h["key"], b"" if value is None else
                          value.encode() if isinstance(value, str) else value))
        out.append(pairs)
    return out


def as_binary(array) -> pa.Array:
    """A binary / large_binary view of a binary or string column (no copy)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_string(array.type):
        return array.view(pa.binary())
    if pa.types.is_large_string(array.type):
        return array.view(pa.large_binary())
    if pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type):
        return array
    raise TypeError(f"expected a binary or string column, not {array.type}")


def record_sizes(values: pa.Array, keys: pa.Array | None,
                 headers: pa.Array | None = None) -> np.ndarray:
    """Bytes each record adds to a chunk body: timestamp 8 + value offset 4 + value, and with
    keys key offset 4 + key + null flag 1, and with headers an index entry 4 and per header
    two offsets 8 + key + value."""
    sizes = 12 + _lengths(values)
    if keys is not None:
        sizes += 5 + _lengths(keys)
    if headers is not None:
        sizes += 4 + header_sizes(headers)
    return sizes


def header_sizes(headers: pa.Array) -> np.ndarray:
    """Per row, the bytes of its headers (8 + key + value each; a null list has none)."""
    counts = pc.fill_null(pc.list_value_length(headers), 0).to_numpy(
        zero_copy_only=False).astype(np.int64)
    pairs = pc.list_flatten(headers)          # a null list contributes no pair
    if len(pairs) == 0:
        return np.zeros(len(headers), dtype=np.int64)
    keys, values = pairs.flatten()            # the children as the struct sees them
    per_pair = 8 + _lengths(as_binary(keys)) + _lengths(as_binary(values))
    ends = np.cumsum(counts)
    total = np.concatenate([[0], np.cumsum(per_pair)])
    return total[ends] - total[ends - counts]


def _lengths(array: pa.Array) -> np.ndarray:
    if array.null_count:
        array = array.fill_null(b"")
    off_dtype = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], dtype=off_dtype, count=len(array) + 1,
                            offset=array.offset * np.dtype(off_dtype).itemsize)
    return np.diff(offsets).astype(np.int64)


def encode_arrow(producer_id: int, sequence: int, stream_id: int, streamlet: int,
                 values: pa.Array, keys: pa.Array | None, timestamps: np.ndarray,
                 headers: pa.Array | None = None) -> bytes:
    """One chunk from binary Arrow columns and int64 µs timestamps. Null keys stay null; a chunk whose keys are all
    null is built without a key column, as kera.codec.chunk.encode does. Rows with headers
    (list<struct<key string, value binary>>) go through kera.codec.chunk.encode_columns (Python per
    header)."""
    if values.null_count:
        raise ValueError("the value column may not hold nulls")
    blob, offsets = kchunk.values_columns(values)
    pairs = header_pairs(headers)
    if pairs is not None:
        return kchunk.encode_columns(producer_id, sequence, stream_id, streamlet, blob, offsets,
                                     None if keys is None else keys.to_pylist(), timestamps,
                                     headers=pairs)
    if keys is None or keys.null_count == len(keys):
        return kchunk.encode_columns(producer_id, sequence, stream_id, streamlet, blob, offsets,
                                     None, timestamps)
    n = len(values)
    ts = np.asarray(timestamps, dtype="<i8")
    if ts.shape != (n,):
        raise ValueError(f"{ts.size} timestamps for {n} values")
    nulls = np.asarray(keys.is_null().to_numpy(zero_copy_only=False), dtype=np.uint8)
    kblob, koffsets = kchunk.values_columns(keys.fill_null(b"") if keys.null_count else keys)
    body = b"".join([ts.tobytes(), offsets.tobytes(), koffsets.tobytes(), blob, kblob, nulls.tobytes()])
    if len(body) + kchunk.HEADER_SIZE > kchunk.MAX_CHUNK_BYTES:
        raise RecordTooLarge(f"chunk of {len(body) + kchunk.HEADER_SIZE} bytes exceeds {kchunk.MAX_CHUNK_BYTES}")
    return kchunk.seal(kchunk.FLAG_KEYS, body, producer_id, sequence, stream_id, streamlet, n)
