"""Core benchmarks (issue 2): one broker, R=1, 100-byte values, 16 KiB chunks.

    make bench        # python -m pytest bench -q --benchmark-enable

- send_batch: records/s acknowledged (send_batch of a 2-D uint8 array, then flush)
- send: records/s acknowledged, one `send()` call per record
- poll_batch: records/s of a bulk consumer reading what was written, from the beginning
- the raw pyzmq ROUTER/DEALER ceiling for the same bytes, and kera's ingest as a fraction of it

Each round is timed here as well as by pytest-benchmark, so the summary table printed at the
end (bench/conftest.py) is there with benchmarks disabled too (then every test runs one round).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from . import core_summary
from .ceiling import CeilingServer, transfer
from .workload import CHUNK_HEADER_BYTES, RECORD_OVERHEAD_BYTES

CHUNK_SIZE_BYTES = 16 * 1024
VALUE_BYTES = 100
STREAMLETS = 4
BATCH_RECORDS = 400_000          # per send_batch round (40 MB of values)
SINGLE_RECORDS = 100_000         # per send() round
READ_RECORDS = 1_000_000         # written once, read back by each poll_batch round
ROUNDS = 5
FLUSH_TIMEOUT_S = 120.0
READ_TIMEOUT_S = 120.0
RECORDS_PER_CHUNK = (CHUNK_SIZE_BYTES - CHUNK_HEADER_BYTES) // (VALUE_BYTES + RECORD_OVERHEAD_BYTES)


def wire_bytes(records: int) -> int:
    """Chunk bytes that carry `records` values (what goes over the wire, before headers)."""
    chunks = math.ceil(records / RECORDS_PER_CHUNK)
    return records * (VALUE_BYTES + RECORD_OVERHEAD_BYTES) + chunks * CHUNK_HEADER_BYTES


def _rounds(benchmark, fn, setup=None):
    """pytest-benchmark's pedantic mode: ROUNDS rounds of one call each (one when disabled)."""
    return benchmark.pedantic(fn, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kera.cli.local import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("core"), brokers=1, backups=0,
                      log_level="WARNING") as c:
        yield c


@pytest.fixture(scope="module")
def producer(cluster):
    from kera.producer import Producer

    with Producer(cluster.bootstrap, chunk_size_bytes=CHUNK_SIZE_BYTES) as p:
        yield p


def _stream(cluster, name: str) -> str:
    cluster.admin().create_stream(name, streamlets=STREAMLETS, replication=1)
    return name


def _values(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, size=(n, VALUE_BYTES), dtype=np.uint8)


def test_send_batch_acknowledged(benchmark, cluster, producer):
    stream = _stream(cluster, "core-batch")
    values = _values(BATCH_RECORDS)

    def run():
        t0 = time.perf_counter()
        producer.send_batch(stream, values)
        producer.flush(FLUSH_TIMEOUT_S)
        core_summary.record(core_summary.INGEST, BATCH_RECORDS, wire_bytes(BATCH_RECORDS),
                            time.perf_counter() - t0)

    acked0 = producer.stats["records_acked"]
    _rounds(benchmark, run)
    rounds = len(core_summary.RESULTS[core_summary.INGEST]["seconds"])
    assert producer.stats["records_acked"] - acked0 == rounds * BATCH_RECORDS
    rec_s, bytes_s = core_summary.rates(core_summary.INGEST)
    benchmark.extra_info.update(records_per_round=BATCH_RECORDS, records_per_s=round(rec_s),
                                wire_mb_per_s=round(bytes_s / 1e6, 1))


def test_send_per_record_acknowledged(benchmark, cluster, producer):
    stream = _stream(cluster, "core-single")
    rows = _values(SINGLE_RECORDS)
    values = [rows[i].tobytes() for i in range(SINGLE_RECORDS)]
    name = "send() per record (acknowledged)"

    def run():
        send = producer.send
        t0 = time.perf_counter()
        for v in values:
            send(stream, v)
        producer.flush(FLUSH_TIMEOUT_S)
        core_summary.record(name, SINGLE_RECORDS, wire_bytes(SINGLE_RECORDS),
                            time.perf_counter() - t0)

    _rounds(benchmark, run)
    rec_s, _ = core_summary.rates(name)
    benchmark.extra_info.update(records_per_round=SINGLE_RECORDS, records_per_s=round(rec_s))


def test_poll_batch_reads_what_was_written(benchmark, cluster, producer):
    from kera.consumer import Consumer

    stream = _stream(cluster, "core-read")
    producer.send_batch(stream, _values(READ_RECORDS))
    producer.flush(FLUSH_TIMEOUT_S)
    name = "poll_batch (bulk consumer, from earliest)"

    def run():
        got = 0
        t0 = time.perf_counter()
        with Consumer(cluster.bootstrap, stream, start="earliest") as c:
            deadline = time.monotonic() + READ_TIMEOUT_S
            while got < READ_RECORDS:
                assert time.monotonic() < deadline, f"read {got} of {READ_RECORDS} records"
                for batch in c.poll_batch(timeout_s=1.0):
                    got += len(batch)
        core_summary.record(name, READ_RECORDS, wire_bytes(READ_RECORDS), time.perf_counter() - t0)
        assert got == READ_RECORDS

    _rounds(benchmark, run)
    rec_s, _ = core_summary.rates(name)
    benchmark.extra_info.update(records_per_round=READ_RECORDS, records_per_s=round(rec_s))


def test_raw_pyzmq_ceiling_for_equal_bytes(benchmark):
    total = wire_bytes(BATCH_RECORDS)
    with CeilingServer() as server:
        def run():
            result = transfer(server.port, total, frame_bytes=CHUNK_SIZE_BYTES)
            core_summary.record(core_summary.CEILING, 0, result["bytes"], result["seconds"])

        _rounds(benchmark, run)
    _, bytes_s = core_summary.rates(core_summary.CEILING)
    benchmark.extra_info.update(bytes_per_round=total, mb_per_s=round(bytes_s / 1e6, 1))
    ingest = core_summary.rates(core_summary.INGEST)
    if ingest:
        benchmark.extra_info["kera_ingest_fraction_of_ceiling"] = round(ingest[1] / bytes_s, 3)
