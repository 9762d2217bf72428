"""Hot paths of the broker core, for pytest-benchmark
(`pytest tests/unit/test_broker_hotpath.py --benchmark-enable`). With benchmarks disabled (the
default) each runs once as a plain correctness test. Per-chunk cost is what counts: a request of
8 chunks of ~16 KiB, appended (verify, one copy, stamp, index) and, with R=2, referenced by the
virtual log, replicated in one write and acknowledged.

Profile with pyinstrument: `python tests/unit/test_broker_hotpath.py [R]`.
"""

import struct
import sys

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig

ME = 7
STREAMLETS = 8
REQUESTS = 64


def _desc(R):
    return {"name": "s", "id": 1, "streamlets": STREAMLETS, "active_groups": 1, "replication": R,
            "group_segments": 64, "segment_size_bytes": 8 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [ME] * STREAMLETS, "brokers": {}, "version": 1}


def _requests(n_requests: int):
    base = chunk.encode(1, 0, 1, 0, [b"v" * 100] * 150)   # ~16 KiB
    out = []
    for seq in range(n_requests):
        req = []
        for sl in range(STREAMLETS):
            buf = bytearray(base)
            struct.pack_into("<QQQI", buf, 16, 1, seq, 1, sl)
            struct.pack_into("<I", buf, 4, chunk.header_crc(buf))
            req.append(bytes(buf))
        out.append(req)
    return out


def _setup(R):
    b = Broker("n0", BrokerConfig(), broker_id=ME)
    b.apply_metadata([_desc(R)], 1)
    b.placement.set_backups([{"id": 1, "address": "h:1", "node": "n1", "alive": True}], 0.0)
    return b


def _run(b, requests, R):
    for i, req in enumerate(requests):
        b.produce(i, req, 0.0)
        if R > 1:
            for w in b.sync(0.0):
                b.write_done(w, {"length": w.end_bytes}, None, 0.0)
            b.take_replies()
    return b


def test_hotpath_append_r1(benchmark):
    requests = _requests(REQUESTS)
    b = benchmark.pedantic(_run, setup=lambda: ((_setup(1), requests, 1), {}), rounds=5)
    assert b.stats()["chunks_appended"] == REQUESTS * STREAMLETS


def test_hotpath_append_and_replicate_r2(benchmark):
    requests = _requests(REQUESTS)
    b = benchmark.pedantic(_run, setup=lambda: ((_setup(2), requests, 2), {}), rounds=5)
    s = b.stats()
    assert s["chunks_appended"] == REQUESTS * STREAMLETS and s["durable_lag_bytes"] == 0
    # One write per request (a virtual segment rolling over splits one in two).
    assert s["chunks_per_replication_write"] > 0.9 * STREAMLETS


if __name__ == "__main__":
    import time

    from pyinstrument import Profiler

    R = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    requests = _requests(500)
    b = _setup(R)
    profiler = Profiler(interval=0.0002)
    t0 = time.process_time()
    profiler.start()
    _run(b, requests, R)
    profiler.stop()
    cpu = time.process_time() - t0
    print(profiler.output_text(color=False))
    n = len(requests) * STREAMLETS
    print(f"R={R}: {cpu / n * 1e6:.1f} us CPU per chunk (with the profiler on)")
