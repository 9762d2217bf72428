"""Key -> streamlet, the same stable rule as the producer client (kera.codec.partitioner):
crc32c(key) mod streamlets, for a whole Arrow column at once.

Hashing a column of keys costs O(longest key) numpy calls (one table-driven CRC step per byte
position, over every key that long), not a Python call per key. Keys longer than
VECTOR_KEY_BYTES_MAX fall back to the crc32c library per key.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kera.codec.chunk import crc32c
from kera.codec.partitioner import DEFAULT_PARTITIONER, key_hash, streamlets_for_keys

VECTOR_KEY_BYTES_MAX = 256
_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_TABLE = _table()


def crc32c_column(keys: pa.Array) -> np.ndarray:
    """uint32 CRC-32C of every value of a binary array without nulls."""
    n = len(keys)
    large = pa.types.is_large_binary(keys.type)
    off_dtype = np.int64 if large else np.int32
    offsets = np.frombuffer(keys.buffers()[1], dtype=off_dtype, count=n + 1,
                            offset=keys.offset * np.dtype(off_dtype).itemsize).astype(np.int64)
    data = keys.buffers()[2]
    blob = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    longest = int(lengths.max()) if n else 0
    if longest > VECTOR_KEY_BYTES_MAX:
        return np.fromiter((crc32c(k) for k in keys.to_pylist()), dtype=np.uint32, count=n)
    # Longest keys first, so the keys still running at byte position j are a prefix.
    order = np.argsort(-lengths, kind="stable")
    starts = offsets[:-1][order]
    sorted_len = lengths[order]
    running = np.searchsorted(-sorted_len, -np.arange(longest), side="left")  # keys longer than j
    crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    for j in range(longest):
        k = int(running[j])
        byte = blob[starts[:k] + j].astype(np.uint32)
        crc[:k] = _TABLE[(crc[:k] ^ byte) & 0xFF] ^ (crc[:k] >> 8)
    out = np.empty(n, dtype=np.uint32)
    out[order] = crc ^ np.uint32(0xFFFFFFFF)
    return out


def streamlets_of_keys(keys: pa.Array, streamlets: int,
                       partitioner: str = DEFAULT_PARTITIONER) -> np.ndarray:
    """int64 streamlet of every key (null keys get -1: the caller places keyless records).
    crc32c is vectorised; other partitioners hash key by key (kera.codec.partitioner)."""
    if keys.null_count:
        valid = np.asarray(keys.is_valid().to_numpy(zero_copy_only=False))
        out = np.full(len(keys), -1, dtype=np.int64)
        out[valid] = streamlets_of_keys(keys.filter(pa.array(valid)), streamlets, partitioner)
        return out
    if partitioner != DEFAULT_PARTITIONER:
        return streamlets_for_keys(keys.to_pylist(), streamlets, key_hash(partitioner))
    return (crc32c_column(keys) % np.uint32(streamlets)).astype(np.int64)
