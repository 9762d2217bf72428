"""A consumer's per-chunk decode without the network: a fetched chunk checked and viewed as
columns (kera.codec.chunk.Chunk: both checksums, the offsets check) and its values handed out as a
consumer.batch.Batch (values_blob, value_offsets), as the benchmark's consumers read them.

    python -m pytest bench/test_chunk_decode.py -q --benchmark-enable

The figure to read is the time per chunk, for the streams preset's 1 KiB chunks (8 records) and
the throughput preset's 4 KiB ones (35 records); no assertion on it. On 2026-11-26 (issue 15)
the timestamps view, which these readers never use, moved to first use, and a whole chunk's
Batch columns skip their numpy scalar reads: 7.2 -> 6.0 us (8 records) and 8.2 -> 6.9 us (35
records), measured one after the other against the commit before. Later that day a
values-only chunk got a decode path of its own (kera.codec.chunk.Chunk._plain_values): 5.2 -> 4.9 us
(8 records) and 6.1 -> 5.8 us (35 records), the best of five runs alternated with the commit
before.
"""

from __future__ import annotations

import pytest

from kera.codec import chunk
from kera.consumer.batch import Batch

RECORD_BYTES = 100


@pytest.mark.parametrize("records", [8, 35])
def test_decode_one_fetched_chunk(benchmark, records):
    view = memoryview(chunk.encode(1, 0, 1, 0, [b"v" * RECORD_BYTES] * records))

    def decode():
        b = Batch("s", 0, 0, 0, chunk.Chunk(view), 0)
        return b.values_blob, b.value_offsets

    blob, offsets = benchmark(decode)
    assert len(blob) == records * RECORD_BYTES and len(offsets) == records + 1
