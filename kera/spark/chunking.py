"""Cut a sequence of rows of one stream into chunks, one streamlet each, deterministically.

Where a chunk ends depends only on the sequence of rows (not on how Spark happened to batch
them): each *lane* cuts a chunk at the first row that brings it to `chunk_size_bytes`. A keyed
row's lane is its streamlet (crc32c(key) mod streamlets); keyless rows share one lane whose
k-th chunk goes to streamlet (seed + k) mod streamlets. So a task that runs again over the same
rows builds the same chunks, in the same order, for the same streamlets: with the same producer
id and sequences the broker recognises them as duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kera.spark.columns import record_sizes
from kera.codec.partitioner import DEFAULT_PARTITIONER
from kera.spark.hashing import streamlets_of_keys

KEYLESS = -1


@dataclass
class PlannedChunk:
    streamlet: int
    values: pa.Array
    keys: pa.Array | None
    timestamps: np.ndarray  # int64 µs
    headers: pa.Array | None = None   # list<struct<key, value>> per row, or no headers column

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class _Lane:
    pieces: list = field(default_factory=list)  # Rows not yet in a chunk
    bytes: int = 0


class ChunkPlanner:
    def __init__(self, streamlets: int, chunk_size_bytes: int, keyless_seed: int = 0,
                 partitioner: str = DEFAULT_PARTITIONER):
        if streamlets < 1 or chunk_size_bytes < 1:
            raise ValueError("streamlets and chunk_size_bytes must be positive")
        self.streamlets = streamlets
        self.chunk_size_bytes = chunk_size_bytes
        self.keyless_seed = keyless_seed
        self.partitioner = partitioner
        self.keyless_chunks = 0
        self.rows_seen = 0
        self.lanes: dict[int, _Lane] = {}

    def add(self, values: pa.Array, keys: pa.Array | None, timestamps: np.ndarray,
            headers: pa.Array | None = None) -> list[PlannedChunk]:
        """Rows in order: binary values (no nulls), binary keys or None, int64 timestamps,
        header lists or None. Returns the chunks these rows completed."""
        n = len(values)
        if n == 0:
            return []
        if keys is not None and keys.null_count == n:
            keys = None
        lanes = (np.full(n, KEYLESS, dtype=np.int64) if keys is None
                 else streamlets_of_keys(keys, self.streamlets, self.partitioner))
        done: list = []  # (row that completed the chunk, lane, chunk)
        first = self.rows_seen
        self.rows_seen += n
        if lanes[0] == lanes[-1] and (lanes == lanes[0]).all():
            lane = int(lanes[0])
            self._lane_add(lane, _Rows(values, None if lane == KEYLESS else keys, timestamps,
                                       headers), np.arange(first, first + n), done)
        else:
            order = np.argsort(lanes, kind="stable")
            sorted_lanes = lanes[order]
            cuts = np.flatnonzero(np.diff(sorted_lanes)) + 1
            for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [n]])):
                lane = int(sorted_lanes[a])
                rows = order[a:b]
                picked = _Rows(values, None if lane == KEYLESS else keys, timestamps, headers).take(rows)
                self._lane_add(lane, picked, first + rows, done)
        done.sort(key=lambda item: item[:2])
        return [self._finish(lane, pieces) for _, lane, pieces in done]

    def flush(self) -> list[PlannedChunk]:
        """Chunks of every row not yet in one (lanes in a fixed order)."""
        out = []
        for lane in sorted(self.lanes):
            state = self.lanes[lane]
            if state.pieces:
                out.append(self._finish(lane, state.pieces))
        self.lanes.clear()
        return out

    def _lane_add(self, lane: int, part: "_Rows", rows: np.ndarray, done: list) -> None:
        """Append one lane's rows (`rows`: their positions in the whole sequence); a chunk
        completed by row r goes to `done` as (r, lane, pieces)."""
        state = self.lanes.setdefault(lane, _Lane())
        cum = np.cumsum(record_sizes(part.values, part.keys, part.headers))
        pos, consumed = 0, 0
        n = len(part.values)
        while pos < n:
            need = self.chunk_size_bytes - state.bytes
            r = int(np.searchsorted(cum, consumed + need, side="left"))
            if r >= n:
                state.pieces.append(part.slice(pos, n))
                state.bytes += int(cum[-1]) - consumed
                return
            done.append((int(rows[r]), lane, state.pieces + [part.slice(pos, r + 1)]))
            state.pieces, state.bytes = [], 0
            consumed = int(cum[r])
            pos = r + 1

    def _finish(self, lane: int, pieces: list) -> PlannedChunk:
        if lane == KEYLESS:
            streamlet = (self.keyless_seed + self.keyless_chunks) % self.streamlets
            self.keyless_chunks += 1
        else:
            streamlet = lane
        rows = pieces[0] if len(pieces) == 1 else _Rows.concat(pieces)
        return PlannedChunk(streamlet, rows.values, rows.keys, rows.timestamps, rows.headers)


@dataclass
class _Rows:
    """Rows of one lane: the columns a chunk is made of, cut and joined together."""
    values: pa.Array
    keys: pa.Array | None
    timestamps: np.ndarray
    headers: pa.Array | None

    def slice(self, a: int, b: int) -> "_Rows":
        if a == 0 and b == len(self.values):
            return self
        return _Rows(self.values.slice(a, b - a), _opt(self.keys, "slice", a, b - a),
                     self.timestamps[a:b], _opt(self.headers, "slice", a, b - a))

    def take(self, rows: np.ndarray) -> "_Rows":
        idx = pa.array(rows)
        return _Rows(self.values.take(idx), _opt(self.keys, "take", idx), self.timestamps[rows],
                     _opt(self.headers, "take", idx))

    @staticmethod
    def concat(pieces: list["_Rows"]) -> "_Rows":
        first = pieces[0]
        return _Rows(pa.concat_arrays([p.values for p in pieces]),
                     None if first.keys is None else pa.concat_arrays([p.keys for p in pieces]),
                     np.concatenate([p.timestamps for p in pieces]),
                     None if first.headers is None else pa.concat_arrays([p.headers for p in pieces]))


def _opt(array: pa.Array | None, method: str, *args):
    return None if array is None else getattr(array, method)(*args)
