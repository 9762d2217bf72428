"""send_batch's per-chunk work without the network: plan a batch of one chunk's records and
encode its piece (kera.producer.batch.plan + kera.codec.chunk.encode), as the throughput preset's
producers do for every 4 KiB chunk (35 records of 100 bytes).

    python -m pytest bench/test_batch_encode.py -q --benchmark-enable

The figure to read is the time per chunk for each input kind; no assertion on it. On
2026-11-26 (issue 15) the 2-D rows went from 19.2 to 8.0 us per chunk once planning stopped
measuring each record and the encoder cached its offsets and repeated its timestamp. Later
that day 2-D rows got an encode path of their own (no keys, headers, compression or condition:
kera.codec.chunk._encode_rows): 7.0 -> 6.0 us (8 rows) and 7.4 -> 6.4 us (35 rows), the best of
five runs alternated with the commit before.
"""

from __future__ import annotations

import numpy as np
import pytest

from kera.codec import chunk
from kera.producer import batch

RECORDS = 35                         # a 4 KiB chunk of 100-byte records
RECORD_BYTES = 100
CAPACITY_BYTES = 4 * 1024 - 68       # a 4 KiB chunk's room for records (kera.producer)


def _values(kind: str):
    rows = np.random.default_rng(1).integers(1, 255, size=(RECORDS, RECORD_BYTES), dtype=np.uint8)
    return {"rows": rows, "bytes_list": [bytes(r) for r in rows],
            "numpy_s": np.array([bytes(r) for r in rows], dtype=f"S{RECORD_BYTES}")}[kind]


@pytest.mark.parametrize("kind", ["rows", "bytes_list", "numpy_s"])
def test_plan_and_encode_one_chunk(benchmark, kind):
    values = _values(kind)

    def one_chunk():
        n, pieces = batch.plan(values, None, None, streamlets=32, capacity=CAPACITY_BYTES,
                               max_record_bytes=1 << 20, keyless_streamlet=0)
        return [chunk.encode(1, 2, 3, 4, p.values, p.keys, p.timestamps, headers=p.headers)
                for p in pieces]

    chunks = benchmark(one_chunk)
    assert len(chunks) == 1 and chunk.Chunk(chunks[0]).values() == [bytes(r) for r in _values("rows")]
