"""Batch: the records of one fetched chunk, as columns (no Python call per record)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from kera.codec.chunk import FLAG_SPARSE, Chunk
from kera.codec.position import Record


class Batch:
    """The records of one chunk of one group of one streamlet from index `skip` on, in order:
    the first at offset `offset`, the others at the next offsets (`offset + i`), or past gaps
    for a compacted chunk (docs/COMPACTION.md: its offset deltas say where).

    `to_arrow()` is a pyarrow RecordBatch (key, value, timestamp) over the chunk's buffer;
    `values` the pyarrow binary array of values; `value_offsets` / `values_blob` /
    `timestamps` numpy and memoryview columns; `offsets` the record offsets (numpy int64).
    Unpacks as (stream, streamlet, group, offset, record_batch).
    """

    __slots__ = ("stream", "streamlet", "group", "offset", "chunk", "skip")

    def __init__(self, stream: str, streamlet: int, group: int, offset: int, chunk: Chunk, skip: int):
        self.stream = stream
        self.streamlet = streamlet
        self.group = group
        self.offset = offset
        self.chunk = chunk
        self.skip = skip

    def __len__(self) -> int:
        return len(self.chunk) - self.skip

    def __iter__(self):
        return iter((self.stream, self.streamlet, self.group, self.offset, self.to_arrow()))

    def __repr__(self) -> str:
        return (f"Batch({self.stream!r}, streamlet={self.streamlet}, group={self.group}, "
                f"offset={self.offset}, records={len(self)})")

    @property
    def next_offset(self) -> int:
        """The offset after the chunk: where reading resumes once the batch is consumed."""
        if not self.chunk.header.flags & FLAG_SPARSE:
            return self.offset + len(self)
        deltas = self.chunk.offset_deltas
        return self.offset + int(deltas[-1]) - self._first_delta(deltas)

    def _first_delta(self, deltas: np.ndarray) -> int:
        """The offset delta of the batch's first record in its compacted chunk."""
        return int(deltas[self.skip]) if self.skip < len(self.chunk) else int(deltas[-1])

    def _sparse_steps(self) -> np.ndarray:
        """A compacted chunk's records' offsets from the batch's first (int64)."""
        deltas = self.chunk.offset_deltas
        return deltas[self.skip:-1].astype(np.int64) - self._first_delta(deltas)

    def to_arrow(self):
        batch = self.chunk.to_arrow()
        return batch.slice(self.skip) if self.skip else batch

    @property
    def values(self):
        """pyarrow BinaryArray of the values."""
        return self.to_arrow().column(1)

    @property
    def values_blob(self) -> memoryview:
        """The value bytes of these records (value_offsets index into it)."""
        if not self.skip:   # the usual whole chunk: no numpy scalar to read
            return self.chunk.values_blob
        return self.chunk.values_blob[int(self.chunk.value_offsets[self.skip]):]

    @property
    def value_offsets(self) -> np.ndarray:
        """u32/int64 offsets (len + 1) of each value in values_blob."""
        if not self.skip:
            return self.chunk.value_offsets
        off = self.chunk.value_offsets[self.skip:]
        return off - off[0]

    @property
    def timestamps(self) -> np.ndarray:
        return self.chunk.timestamps[self.skip:]

    @property
    def offsets(self) -> np.ndarray:
        if not self.chunk.header.flags & FLAG_SPARSE:
            return np.arange(self.offset, self.offset + len(self), dtype=np.int64)
        return self.offset + self._sparse_steps()

    @property
    def first_number(self) -> int | None:
        """The record number of this batch's first record (the rest follow as its offsets
        do); None for data written before record numbers."""
        first = self.chunk.first_number
        if first is None:
            return None
        if not self.chunk.header.flags & FLAG_SPARSE:
            return first + self.skip
        return first + self._first_delta(self.chunk.offset_deltas)

    @property
    def numbers(self) -> np.ndarray | None:
        first = self.first_number
        if first is None:
            return None
        if not self.chunk.header.flags & FLAG_SPARSE:
            return np.arange(first, first + len(self), dtype=np.int64)
        return first + self._sparse_steps()

    def value_list(self) -> list[bytes | None]:
        return self.chunk.values()[self.skip:]

    def keys(self) -> list[bytes | None]:
        return self.chunk.keys()[self.skip:]

    def headers(self) -> list[list[tuple[str, bytes]]]:
        return self.chunk.headers()[self.skip:]

    def records(self) -> Iterator[Record]:
        s, sl, g, base = self.stream, self.streamlet, self.group, self.offset
        first = self.first_number
        sparse = self.chunk.header.flags & FLAG_SPARSE
        steps = self._sparse_steps().tolist() if sparse else range(len(self))
        rows = zip(steps, self.keys(), self.value_list(), self.timestamps.tolist(), self.headers())
        for i, k, v, t, h in rows:
            yield Record(k, v, t, s, sl, g, base + i, tuple(h), None if first is None else first + i)
