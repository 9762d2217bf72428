"""End-to-end latency: the send time rides in each value; a log-bucketed histogram keeps it.

Producers write their wall-clock send time (µs, little-endian int64) into the first 8 bytes of
every value just before handing the records to the client; consumers subtract it from their
receive time. All clients run on one machine, so the clocks agree. The histogram has fixed
size (`BUCKETS`), 2 % wide buckets, so memory is bounded however many records are measured.
"""

from __future__ import annotations

import math

import numpy as np

from .workload import STAMP_BYTES

GROWTH = 1.02                       # bucket i holds latencies in [GROWTH**i, GROWTH**(i+1)) µs
BUCKETS = 1000                      # up to GROWTH**1000 µs = about 400 s
_LOG_GROWTH = math.log(GROWTH)
_STAMP_DTYPE = np.dtype("<i8")


def stamp_rows(values: np.ndarray, now_us: int) -> None:
    """Write `now_us` into the first 8 bytes of every row of a 2-D uint8 array."""
    values[:, :STAMP_BYTES] = np.array([now_us], dtype=_STAMP_DTYPE).view(np.uint8)


def stamps_from_blob(blob, value_offsets: np.ndarray) -> np.ndarray:
    """Send times of values laid back to back in `blob` at `value_offsets` (n + 1 offsets,
    relative to the first; every value at least STAMP_BYTES long).

    One int64 view starting at every byte of `blob`, indexed at the values' starts: two numpy
    calls per chunk. The earlier 2-D gather took about a third of a consumer's CPU at 4 KiB
    chunks (issue 15 profile), which is the harness's cost, not kera's."""
    starts = value_offsets[:-1]
    if len(starts) == 0:
        return np.empty(0, dtype=_STAMP_DTYPE)
    every_byte = np.ndarray(shape=(len(blob) - STAMP_BYTES + 1,), dtype=_STAMP_DTYPE,
                            buffer=blob, strides=(1,))
    first = int(value_offsets[0])
    return every_byte[starts - first if first else starts]


def stamps_from_values(values: list) -> np.ndarray:
    """Send times of a list of values (bytes)."""
    return np.frombuffer(b"".join([v[:STAMP_BYTES] for v in values]), dtype=_STAMP_DTYPE)


class LatencyHistogram:
    def __init__(self, counts=None):
        self.counts = np.zeros(BUCKETS, dtype=np.int64) if counts is None \
            else np.asarray(counts, dtype=np.int64)

    def add(self, latencies_us: np.ndarray) -> None:
        if len(latencies_us) == 0:
            return
        lat = np.maximum(np.asarray(latencies_us, dtype=np.float64), 1.0)
        idx = np.minimum((np.log(lat) / _LOG_GROWTH).astype(np.int64), BUCKETS - 1)
        self.counts += np.bincount(idx, minlength=BUCKETS)

    def merge(self, other: "LatencyHistogram") -> None:
        self.counts += other.counts

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def percentile_ms(self, p: float) -> float | None:
        """The p-th percentile (0..100) in ms: the geometric middle of its bucket."""
        total = self.total
        if total == 0:
            return None
        rank = max(1, math.ceil(total * p / 100.0))
        i = int(np.searchsorted(np.cumsum(self.counts), rank))
        return GROWTH ** (i + 0.5) / 1000.0

    def to_list(self) -> list[int]:
        return self.counts.tolist()
