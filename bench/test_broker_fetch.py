"""A broker's per-read work for one fetch request, without the network: the request a consumer
of many streams sends (one read per streamlet, 64 streams of one streamlet each), parsed,
checked and served by the broker core (kera.broker.core.Broker.fetch).

    python -m pytest bench/test_broker_fetch.py -q --benchmark-enable

The figure to read is the time per fetch of 64 reads, for reads that find one new 1 KiB chunk
each and for reads already at the end; no assertion on it. On the streams preset at 128
streams, fetches were a fifth of the broker's busy samples (issue 15). On 2026-11-26 one
streamlet lookup per read (it was three) and one type test for a well-formed read's integers
took a fetch of 64 reads from 482 to 397 us (min; one chunk each) and from 356 to 282 us (at
the end), measured one after the other against the commit before.
"""

from __future__ import annotations

import pytest

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig

BROKER_ID = 7
STREAMS = 64                  # one consumer's share of the streams preset's 128 streams
RECORDS_PER_CHUNK = 8         # a 1 KiB chunk of 100-byte records, as in that preset


def _desc(sid: int) -> dict:
    return {"name": f"s{sid}", "id": sid, "streamlets": 1, "active_groups": 1, "replication": 1,
            "group_segments": 64, "segment_size_bytes": 8 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [BROKER_ID], "brokers": {}, "version": 1}


@pytest.fixture(scope="module")
def broker():
    b = Broker("n0", BrokerConfig(), broker_id=BROKER_ID)
    sids = range(1, STREAMS + 1)
    b.apply_metadata([_desc(s) for s in sids], 1)
    for s in sids:
        b.produce(s, [chunk.encode(1, 0, s, 0, [b"v" * 100] * RECORDS_PER_CHUNK)], 0.0)
    return b


@pytest.mark.parametrize("where", ["one_new_chunk", "at_the_end"])
def test_fetch_of_one_read_per_stream(benchmark, broker, where):
    offset = 0 if where == "one_new_chunk" else RECORDS_PER_CHUNK
    reads = [[s, 0, {"low": 0, "offsets": {0: offset}}, 1 << 20] for s in range(1, STREAMS + 1)]

    def fetch():
        return broker.reads.fetch(reads, [])

    results, frames = benchmark(fetch)
    assert all(r[0] is None for r in results)
    assert len(frames) == (STREAMS if where == "one_new_chunk" else 0)
