"""Broker loop stall per produce request with many distinct producer ids (issue 10, item 5).

Drives the broker's sans-IO core (no sockets: the stall measured is the loop's own work) with
`--producers` distinct producers, each storing its first chunk, so the duplicate-detection
table overflows. Then times produce requests of about `--request-bytes` made of chunks of
producers evicted long ago: their next chunk (sequence 1) and a retry of their first chunk
(sequence 0). Prints the time per request and whether the retries were stored again.

    python -m kera.bench.producer_stall --producers 1000000
"""

from __future__ import annotations

import argparse
import statistics
import time

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig

BROKER_ID = 1
CHUNKS_PER_FILL_REQUEST = 500   # chunks per produce request while filling the table


def stream_descriptor() -> dict:
    return {"name": "bench", "id": 1, "streamlets": 1, "active_groups": 1, "replication": 1,
            "group_segments": 1024, "segment_size_bytes": 8 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [BROKER_ID],
            "brokers": {str(BROKER_ID): "127.0.0.1:1"}, "version": 1, "ready": True}


def fill(b: Broker, producers: int) -> None:
    request = []
    for p in range(producers):
        request.append(chunk.encode(p, 0, 1, 0, [b"x" * 32]))
        if len(request) == CHUNKS_PER_FILL_REQUEST:
            b.produce(p, request, 0.0)
            request = []
    if request:
        b.produce("last", request, 0.0)


def time_requests(b: Broker, first: int, sequence: int, chunks: int, requests: int) -> list[float]:
    """Seconds per produce request of `chunks` chunks of evicted producers (ids from `first`),
    each at `sequence`."""
    times = []
    for r in range(requests):
        frames = [chunk.encode(first + r * chunks + i, sequence, 1, 0, [b"x" * 32])
                  for i in range(chunks)]
        t0 = time.perf_counter()
        b.produce(("req", sequence, r), frames, 0.0)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=1_000_000)
    ap.add_argument("--request-bytes", type=int, default=5000)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    b = Broker("bench", BrokerConfig(), broker_id=BROKER_ID)
    b.apply_metadata([stream_descriptor()], 1)
    t0 = time.perf_counter()
    fill(b, args.producers)
    print(f"filled: {args.producers} producers in {time.perf_counter() - t0:.1f} s; "
          f"table entries {len(b.producers)}")
    chunks = max(1, args.request_bytes // len(chunk.encode(0, 0, 1, 0, [b"x" * 32])))
    # Distinct producers for the two cases, all among the first half (evicted long ago).
    for first, sequence, what in ((0, 0, "retry of an evicted producer's first chunk"),
                                  (args.producers // 4, 1, "next chunk of an evicted producer")):
        stored = b.stats()["chunks_appended"]
        times = time_requests(b, first, sequence, chunks, args.requests)
        again = b.stats()["chunks_appended"] - stored
        print(f"{what}: {chunks} chunks/request ({args.request_bytes} B), "
              f"median {statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms "
              f"per request; chunks stored: {again} of {chunks * args.requests}")


if __name__ == "__main__":
    main()
