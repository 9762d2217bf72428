"""Cutting a batch of records into chunk-sized pieces with O(1) Python calls per chunk.

`send_batch` accepts the value containers kera.codec.chunk.values_columns does (a sequence of
bytes-like, a numpy 'S' array, a 2-D uint8 array, a pyarrow binary array). These helpers
measure a batch, pick the indices of each streamlet's records and cut them into pieces that
fit one chunk each; the pieces are then encoded directly by kera.codec.chunk.encode.
"""

from __future__ import annotations

import operator
from typing import Iterator, NamedTuple

import numpy as np
from crc32c import crc32c

from kera.errors import RecordTooLarge
from kera.codec.partitioner import KeyHash, streamlets_for_keys
from kera.codec.timestamps import check_us
from kera.producer.accumulator import (KEYED_OVERHEAD_BYTES, RAISE_HINT, RECORD_OVERHEAD_BYTES,
                                       header_bytes)

def _is_arrow(values) -> bool:
    return hasattr(values, "buffers") and hasattr(values, "offset") or type(values).__name__ == "ChunkedArray"


def value_lengths(values) -> np.ndarray:
    """int64 length of each value, without a Python call per value for array inputs."""
    if isinstance(values, np.ndarray):
        if values.dtype == np.uint8 and values.ndim == 2:
            return np.full(values.shape[0], values.shape[1], dtype=np.int64)
        if values.dtype.kind == "S" and values.ndim == 1:
            return np.char.str_len(values).astype(np.int64)
        raise TypeError(f"values array must be 1-D bytes ('S') or 2-D uint8, not {values.dtype} "
                        f"with {values.ndim} dimensions")
    if _is_arrow(values):
        import pyarrow as pa
        import pyarrow.compute as pc

        if values.null_count:
            raise TypeError("values may not be null")
        if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)
                or pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            raise TypeError(f"values must be binary, not {values.type}")
        return pc.binary_length(values).to_numpy(zero_copy_only=False).astype(np.int64)
    if not isinstance(values, list):
        values = list(values)
    _check_bytes(values, "values")
    return np.fromiter(map(len, values), dtype=np.int64, count=len(values))


def _check_bytes(values: list, what: str, none_ok: bool = False) -> None:
    """TypeError unless every item is bytes-like (a C-speed pass over the types present)."""
    bad = [t.__name__ for t in set(map(type, values))
           if not issubclass(t, (bytes, bytearray, memoryview)) and not (none_ok and t is type(None))]
    if bad:
        raise TypeError(f"{what} must be bytes{' or None' if none_ok else ''}, not {', '.join(sorted(bad))}")


def as_list(values):
    """Sequences other than lists (tuples, generators) as a list, memoryviews as bytes (their
    len() counts items, not bytes); arrays unchanged."""
    if isinstance(values, np.ndarray) or _is_arrow(values):
        return values
    if not isinstance(values, list):
        values = list(values)
    if memoryview in set(map(type, values)):
        values = [bytes(v) if type(v) is memoryview else v for v in values]
    return values


def normalize_headers(headers) -> list[tuple[str, bytes]]:
    """A copy of `headers` as (str, bytes) pairs; TypeError naming the first bad pair."""
    out = []
    for pair in headers:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"headers are (str key, bytes value) pairs, not {pair!r}")
        out.append((pair[0], as_bytes(pair[1], f"header {pair[0]!r} value")))
    return out


def as_bytes(value, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):  # a copy: the caller may reuse it
        return bytes(value)
    raise TypeError(f"{what} must be bytes, not {type(value).__name__}")


def take(values, idx: np.ndarray):
    """The values at `idx` (int64 indices), in that order, in the same kind of container."""
    if isinstance(values, np.ndarray):
        return values[idx]
    if _is_arrow(values):
        import pyarrow as pa
        return values.take(pa.array(idx))
    if len(idx) == 1:
        return [values[int(idx[0])]]
    return list(operator.itemgetter(*idx.tolist())(values))


def normalize_keys(keys, n: int) -> list:
    """Keys as a list of bytes or None, checked against the number of values."""
    if isinstance(keys, np.ndarray):
        if keys.dtype.kind != "S" or keys.ndim != 1:
            raise TypeError(f"keys array must be 1-D bytes ('S'), not {keys.dtype}")
        keys = keys.tolist()
    elif _is_arrow(keys):
        keys = keys.to_pylist()
    elif not isinstance(keys, list):
        keys = list(keys)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} keys for {n} values")
    _check_bytes(keys, "keys", none_ok=True)
    if set(map(type, keys)) - {bytes, type(None)}:
        keys = [k if k is None or type(k) is bytes else bytes(k) for k in keys]
    return keys


def key_lengths(keys: list) -> np.ndarray:
    return np.fromiter((0 if k is None else len(k) for k in keys), dtype=np.int64, count=len(keys))


def timestamps_column(timestamps, n: int):
    """None (stamped at encode), one int for all, or an int64 array of n."""
    if timestamps is None:
        return None
    if isinstance(timestamps, (int, np.integer)):
        check_us(int(timestamps))
        return int(timestamps)
    ts = np.asarray(timestamps, dtype=np.int64)
    if ts.shape != (n,):
        raise ValueError(f"{ts.size} timestamps for {n} values")
    if n:
        check_us(int(ts.max()), int(ts.min()))
    return ts


def record_sizes(lengths: np.ndarray, klengths: np.ndarray | None) -> np.ndarray:
    """Bytes each record takes in a chunk body (same accounting as the Accumulator)."""
    if klengths is None:
        return lengths + RECORD_OVERHEAD_BYTES
    return lengths + klengths + KEYED_OVERHEAD_BYTES


def split_by_size(sizes: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """[start, end) ranges cutting records of `sizes` bytes into pieces of at most `capacity`
    bytes each (a record larger than that gets a piece of its own); one searchsorted per piece,
    or none when every record has the same size (see _split_uniform)."""
    n = len(sizes)
    if n == 0:
        return []
    if sizes[0] == sizes[-1] and (sizes == sizes[0]).all():
        return _split_uniform(n, int(sizes[0]), capacity)
    cum = np.cumsum(sizes, dtype=np.int64)
    ranges = []
    start, base = 0, 0
    while start < n:
        end = int(np.searchsorted(cum, base + capacity, side="right"))
        if end <= start:
            end = start + 1
        ranges.append((start, end))
        base = int(cum[end - 1])
        start = end
    return ranges


def _split_uniform(n: int, size: int, capacity: int) -> list[tuple[int, int]]:
    """split_by_size of `n` records of `size` bytes each: the same greedy cut, computed. Rows
    of a 2-D array all have one size, and there the searchsorted loop was 13% of a producer's
    samples at 4 KiB chunks (issue 15 profile)."""
    per = max(1, capacity // size) if size > 0 else n
    return [(start, min(start + per, n)) for start in range(0, n, per)]


def group_by_streamlet(streamlets: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(streamlet, indices in input order) for each streamlet present."""
    order = np.argsort(streamlets, kind="stable")
    ordered = streamlets[order]
    cuts = np.flatnonzero(np.diff(ordered)) + 1
    bounds = [0, *cuts.tolist(), len(order)]
    return [(int(ordered[a]), order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


class Piece(NamedTuple):
    """Records for one chunk: `streamlet` None means "the stream's sticky streamlet"."""
    streamlet: int | None
    values: object
    keys: list | None
    timestamps: object
    count: int
    headers: list | None = None   # one list of (str, bytes) pairs (or None) per record


def plan(values, keys, timestamps, *, streamlets: int, capacity: int, max_record_bytes: int,
         keyless_streamlet: int, headers=None, key_hash: KeyHash = crc32c
         ) -> tuple[int, Iterator[Piece]]:
    """(record count, pieces) of a batch: keyless batches in input order, keyed batches
    grouped by streamlet (input order kept within each). Everything that can be refused is
    checked before the first piece is made, so a batch is refused whole or queued whole;
    `keyless_streamlet` takes the None keys of a keyed batch. `headers`: None, or one list
    of (str, bytes) pairs (or None) per record (a Python step per record: headers are
    Python objects). `key_hash` places keys (kera.codec.partitioner)."""
    if keys is None and headers is None and _is_rows(values):
        return _plan_rows(values, timestamps, capacity, max_record_bytes)
    values = as_list(values)
    if type(values).__name__ == "ChunkedArray":
        values = values.combine_chunks()
    lengths = value_lengths(values)
    n = len(lengths)
    ts = timestamps_column(timestamps, n)
    klist = None if keys is None else normalize_keys(keys, n)
    klengths = None if klist is None else key_lengths(klist)
    hlist, hsizes = (None, 0) if headers is None else headers_column(headers, n)
    if n:
        record_bytes = (lengths if klengths is None else lengths + klengths) + hsizes
        biggest = int(record_bytes.max())
        if biggest > max_record_bytes:
            raise RecordTooLarge(f"a record of {biggest} bytes exceeds max_record_bytes={max_record_bytes}: {RAISE_HINT}")
    sizes = record_sizes(lengths, klengths) + hsizes
    return n, _pieces(values, klist, ts, sizes, streamlets, capacity, keyless_streamlet, hlist,
                      key_hash)


def _is_rows(values) -> bool:
    return isinstance(values, np.ndarray) and values.ndim == 2 and values.dtype == np.uint8


def _plan_rows(values: np.ndarray, timestamps, capacity: int,
               max_record_bytes: int) -> tuple[int, Iterator[Piece]]:
    """plan() of a keyless batch of 2-D uint8 rows without headers: every record is one row
    wide, so nothing is measured per record. The per-record arrays and their reductions cost
    about 8 us of a 4 KiB chunk's 35 records (issue 15 profile, throughput preset)."""
    n, width = values.shape
    ts = timestamps_column(timestamps, n)
    if n and width > max_record_bytes:
        raise RecordTooLarge(f"a record of {width} bytes exceeds max_record_bytes={max_record_bytes}: {RAISE_HINT}")
    ranges = _split_uniform(n, width + RECORD_OVERHEAD_BYTES, capacity)
    return n, _keyless_pieces(values, ts, ranges, None)


def headers_column(headers, n: int) -> tuple[list | None, np.ndarray | int]:
    """(one normalized header list or None per record, or None when no record has any;
    the bytes each record's headers take in a chunk). A list object given for many records
    (the usual case: the same headers on a whole batch) is normalized and measured once."""
    if not isinstance(headers, list):
        headers = list(headers)
    if len(headers) != n:
        raise ValueError(f"{len(headers)} header lists for {n} values")
    seen: dict[int, tuple] = {}   # id -> (normalized, bytes, the object: keeps the id its own)
    out, sizes = [], np.zeros(n, dtype=np.int64)
    for i, h in enumerate(headers):
        if not h:
            out.append(None)
            continue
        known = seen.get(id(h))
        if known is None:
            norm = normalize_headers(h)
            known = seen[id(h)] = (norm, header_bytes(norm), h)
        out.append(known[0])
        sizes[i] = known[1]
    return (out, sizes) if seen else (None, 0)


def _pieces(values, klist, ts, sizes, streamlets, capacity, keyless_streamlet,
            hlist=None, key_hash: KeyHash = crc32c) -> Iterator[Piece]:
    fixed_ts = ts is None or isinstance(ts, int)
    if klist is None:
        yield from _keyless_pieces(values, ts, split_by_size(sizes, capacity), hlist)
        return
    sls = streamlets_for_keys(klist, streamlets, key_hash)
    sls[sls < 0] = keyless_streamlet
    for sl, idx in group_by_streamlet(sls):
        sub_values = take(values, idx)
        sub_keys = [klist[i] for i in idx.tolist()]
        sub_ts = ts if fixed_ts else ts[idx]
        sub_headers = None if hlist is None else [hlist[i] for i in idx.tolist()]
        for a, b in split_by_size(sizes[idx], capacity):
            keys = sub_keys[a:b]
            if all(k is None for k in keys):
                keys = None
            yield Piece(sl, sub_values[a:b], keys, sub_ts if fixed_ts else sub_ts[a:b], b - a,
                        None if sub_headers is None else sub_headers[a:b])


def _keyless_pieces(values, ts, ranges: list[tuple[int, int]], hlist) -> Iterator[Piece]:
    """One piece per [start, end) range of a keyless batch, on the stream's sticky streamlet."""
    fixed_ts = ts is None or isinstance(ts, int)
    for a, b in ranges:
        yield Piece(None, values[a:b], None, ts if fixed_ts else ts[a:b], b - a,
                    None if hlist is None else hlist[a:b])
