"""Hot paths of the producer, for pytest-benchmark (`pytest --benchmark-enable -k hotpath`).

With benchmarks disabled (the default) each runs once as a plain correctness test.
"""

import numpy as np

from kera.codec import chunk
from kera.client.metadata import StreamInfo
from kera.producer import batch
from kera.producer.accumulator import Accumulator
from kera.producer.pipeline import Pipeline

N = 20_000


def _fresh():
    pipe = Pipeline(request_size_bytes=1 << 20, in_flight_per_broker=4, retries_max=5, request_timeout_s=1)
    acc = Accumulator(pipe, 1, chunk_size_bytes=16 * 1024, max_record_bytes=1 << 20, linger_s=0.005)
    info = StreamInfo("s", 1, 4, 1, 1, (0, 0, 0, 0), {}, 1, True)
    return acc, pipe, acc.stream_state(info)


def test_hotpath_append_keyless(benchmark):
    values = [bytes(100)] * N

    def run():
        acc, pipe, st = _fresh()
        append = acc.append
        for v in values:
            append(st, v, None, None)
        return acc, pipe

    acc, pipe = benchmark(run)
    acc.seal_all()
    assert sum(c.records for lane in pipe.lanes.values() for c in lane.chunks) == N


def test_hotpath_append_keyed(benchmark):
    values = [bytes(100)] * N
    keys = [b"user-%d" % (i % 1000) for i in range(N)]

    def run():
        acc, pipe, st = _fresh()
        append = acc.append
        for v, k in zip(values, keys):
            append(st, v, k, None)
        return acc, pipe

    acc, pipe = benchmark(run)
    acc.seal_all()
    assert sum(c.records for lane in pipe.lanes.values() for c in lane.chunks) == N


def test_hotpath_batch_plan_and_encode(benchmark):
    values = np.zeros((10 * N, 100), dtype=np.uint8)

    def run():
        _, pieces = batch.plan(values, None, None, streamlets=4, capacity=16 * 1024 - 68,
                               max_record_bytes=1 << 20, keyless_streamlet=0)
        return [chunk.encode(1, i, 1, 0, p.values, p.keys, p.timestamps) for i, p in enumerate(pieces)]

    chunks = benchmark(run)
    assert sum(chunk.read_header(c).record_count for c in chunks) == 10 * N
