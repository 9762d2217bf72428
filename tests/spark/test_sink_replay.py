"""The sink's write tasks against a real cluster, without Spark: a task attempt whose input
ended early, then a complete re-run with the same identity, store every row exactly once; a
task whose chunks cannot be stored fails in bounded time, naming the stream."""

from __future__ import annotations

import time
from collections import Counter

import pyarrow as pa
import pytest

from kera.client.admin import Admin
from kera.errors import Timeout
from kera.spark import offsets as ko
from kera.spark.fetch import read_group
from kera.spark.options import Options
from kera.spark.sink import STALL_TIMEOUTS, _TaskWriter, producer_id, send_tails
from kera.spark.source import _Planner


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=0)


def read_values(opts: Options, stream: str) -> list[bytes]:
    planner = _Planner(opts)
    try:
        info, groups = planner.snapshot(stream)
        out = []
        for sl, infos in groups.items():
            for part in planner.partitions(stream, info, sl, ko.Cursor(), ko.advance(ko.Cursor(), infos), infos):
                for batch in read_group(part):
                    out += batch.column("value").to_pylist()
        return out
    finally:
        planner.close()


def batches(n: int, size: int, keyed: bool):
    out = []
    for a in range(0, n, size):
        vals = pa.array([b"row-%06d-" % i + b"." * (i % 40) for i in range(a, min(n, a + size))])
        cols, names = [vals], ["value"]
        if keyed:
            cols.append(pa.array([b"user-%d" % (i % 7) if i % 5 else None for i in range(a, min(n, a + size))],
                                 pa.binary()))
            names.append("key")
        out.append(pa.record_batch(cols, names=names))
    return out


@pytest.mark.parametrize("keyed", [False, True])
def test_truncated_attempt_then_full_rerun_stores_every_row_once(cluster, keyed):
    stream = f"replay-{int(keyed)}"
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream(stream, streamlets=3, active_groups=2)
    opts = Options.parse({"bootstrap": cluster.bootstrap, "stream": stream, "chunkSizeBytes": "700"})
    pid = producer_id("query", "5", 1)
    data = batches(3000, 170, keyed)

    # Attempt 1: Spark ended its input early (upstream failure); its tails are never sent.
    first = _TaskWriter(opts, pid, 1, timestamp_us=42).run(iter(data[:7]))
    assert first.tails and first.chunks > len(first.tails)
    stored = read_values(opts, stream)
    assert 0 < len(stored) < 7 * 170 and len(set(stored)) == len(stored)

    # Attempt 2 sees everything, batched differently; the driver sends its tails at commit.
    rebatched = batches(3000, 333, keyed)
    second = _TaskWriter(opts, pid, 1, timestamp_us=42).run(iter(rebatched))
    assert send_tails(opts, [second]) == len(second.tails)
    # A repeated commit (the batch replayed after a driver failure) stores nothing new.
    third = _TaskWriter(opts, pid, 1, timestamp_us=42).run(iter(data))
    send_tails(opts, [third])
    want = Counter(v for b in data for v in b.column("value").to_pylist())
    assert Counter(read_values(opts, stream)) == want


def test_producer_id_is_stable_and_distinct():
    a = producer_id("q", "7", 1)
    assert a == producer_id("q", "7", 1)
    assert len({a, producer_id("q", "7", 2), producer_id("q", "8", 1), producer_id("r", "7", 1)}) == 4
    assert 0 < a < 2 ** 64


def test_task_whose_chunks_cannot_be_stored_fails_in_bounded_time_naming_the_stream(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0)
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream("down", streamlets=2)
    cluster.kill_broker(0)
    timeout_s = 1.0
    # A buffer that holds every chunk (the final flush gives up), then one that fills (send does).
    for buffer_bytes, where in ((32 << 20, "full chunks of write task 3"), (4096, "write task 3 could not send")):
        opts = Options.parse({"bootstrap": cluster.bootstrap, "stream": "down", "chunkSizeBytes": "700",
                              "bufferBytes": str(buffer_bytes), "timeoutMs": str(int(timeout_s * 1000))})
        started = time.monotonic()
        with pytest.raises(Timeout, match=where) as err:
            _TaskWriter(opts, producer_id("q", "0", 3), 3, timestamp_us=42).run(iter(batches(500, 100, False)))
        assert "'down'" in str(err.value) and "timeoutMs" in str(err.value)
        # The wait, then closing the producer (its request thread ends within a request timeout).
        assert time.monotonic() - started < STALL_TIMEOUTS * timeout_s + 2 * timeout_s + 5
