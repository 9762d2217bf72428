"""Segment memory (issue 15): what a broker pays to copy chunks into its segments.

    python -m pytest bench/test_segment_memory.py -q --benchmark-enable -p no:randomly

Each round appends 64 KiB chunks until SEGMENTS segments of 8 MiB are full, into
- fresh memory with plain pages (what a broker does without a pool: `anonymous_buffer`), kept
  across rounds as a broker keeps its data, populated ahead of the writes with one madvise
  per window (what a segment does) or faulted one page at a time by the copy;
- the same, advised for transparent huge pages (what kera did before; on this machine, a VM
  whose balloon hands freed 2 MiB blocks back to its host, it cost 3-4x plain pages);
- memory reused from a `SegmentPool` (a broker whose retention or tiering frees segments).
Compare the three rows' means; the summary line gives each per chunk.
"""

from __future__ import annotations

import mmap
import time

import pytest

from kera.codec import chunk
from kera.broker import segment as segment_module
from kera.broker.segment import Segment
from kera.broker.segment_pool import SegmentPool

SEGMENT_BYTES = 8 << 20
CHUNK_VALUES = 600                       # ~64 KiB chunks of 100-byte values
SEGMENTS = 16                            # per round: 128 MiB
ROUNDS = 5


def _huge_page_buffer(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _fill(pool, payload: bytes, kept: list) -> int:
    """Fill SEGMENTS segments; with a pool they are then released into it (retention), without
    one they are kept (a broker's data grows), so each round faults memory never used before."""
    chunks = 0
    segs = []
    for n in range(SEGMENTS):
        seg = Segment(None, n, SEGMENT_BYTES, pool)
        while seg.fits(len(payload)):
            seg.append(payload, len(payload), 0, chunks * CHUNK_VALUES, CHUNK_VALUES)
            chunks += 1
        segs.append(seg)
    if pool is None:
        kept.extend(segs)
    for seg in segs if pool is not None else ():
        seg.release()
    return chunks


@pytest.mark.parametrize("memory", ["fresh plain pages", "fresh plain pages, faulted one by one",
                                    "fresh huge pages", "pooled"])
def test_append_64k_chunks(benchmark, monkeypatch, memory):
    payload = bytes(chunk.encode(1, 0, 1, 0, [b"v" * 100] * CHUNK_VALUES))
    pool = SegmentPool(SEGMENTS * SEGMENT_BYTES) if memory == "pooled" else None
    if memory == "fresh huge pages":
        monkeypatch.setattr(segment_module, "anonymous_buffer", _huge_page_buffer)
    if memory.endswith("one by one"):
        monkeypatch.setattr(segment_module, "POPULATE_AHEAD_MAX_BYTES", 0)
    kept: list = []
    if pool is not None:
        _fill(pool, payload, kept)           # the pool now holds a round's memory
    times = []

    def round_():
        start = time.perf_counter()
        times.append((_fill(pool, payload, kept), time.perf_counter() - start))

    benchmark.pedantic(round_, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    chunks = sum(c for c, _ in times)
    print(f"\n{memory}: {sum(t for _, t in times) / chunks * 1e6:.1f} us per 64 KiB chunk")
    for seg in kept:
        seg.release()
