"""send_batch's planning with headers (kera.producer.batch.plan): one header list shared by a
whole batch, as a service stamps every record with the same trace or content type, against a
list of its own per record.

    python -m pytest bench/test_plan_headers.py -q --benchmark-enable

The figure to read is the time per plan of RECORDS records; no assertion on it.
"""

from __future__ import annotations

import pytest

from kera.producer import batch

RECORDS = 100_000
CAPACITY_BYTES = 16 * 1024 - 68      # a 16 KiB chunk's room for records (kera.producer)
HEADERS = [("h0", b"00000000"), ("h1", b"00000001")]


@pytest.mark.parametrize("lists", ["shared", "one-per-record"])
def test_plan_with_headers(benchmark, lists):
    values = [b"x" * 100] * RECORDS
    headers = [HEADERS] * RECORDS if lists == "shared" else [list(HEADERS) for _ in range(RECORDS)]

    def plan():
        _, pieces = batch.plan(values, None, None, streamlets=8, capacity=CAPACITY_BYTES,
                               max_record_bytes=1 << 20, keyless_streamlet=0, headers=headers)
        return sum(p.count for p in pieces)

    assert benchmark(plan) == RECORDS
