"""Format "kera" from a Spark standalone cluster (a master and two workers, each executor its
own JVM and Python worker; tests/spark/standalone.py), not only `local[2]`: batch and streaming
reads and writes, the exactly-once sink through an executor killed with -9 mid-batch, and the
import check refusing executors whose Python cannot import kera."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from standalone import wait_until
from test_spark_connector import broker_stats, create, opts, produce, read_all

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=0)


def executor_pids_that_ran(df) -> set[int]:
    """The executor-side Python worker processes' parents' parents: proves where tasks ran."""
    return set(df.rdd.mapPartitions(lambda _rows: [os.getpid()]).collect())


def test_the_session_runs_on_two_executor_jvms(standalone, standalone_spark):
    sc = standalone_spark.sparkContext
    assert sc.master == standalone.url
    assert len(standalone.executor_pids()) == 2
    # two tasks at once need both 1-core executors, each with its own Python worker
    ran = executor_pids_that_ran(standalone_spark.range(0, 4, 1, 2))
    assert len(ran) == 2


def test_batch_write_and_read_on_executors(standalone_spark, cluster):
    spark = standalone_spark
    create(cluster, "sa-batch", streamlets=3, active_groups=2)
    rows = [(f"user-{i % 17}", f"value-{i:05d}") for i in range(4000)]
    df = spark.createDataFrame(rows, "key string, value string").repartition(4)
    df.write.format("kera").options(**opts(cluster, "sa-batch", chunkSizeBytes="2048")).mode("append").save()

    back = read_all(spark, cluster, "sa-batch", minPartitions="4")
    assert back.rdd.getNumPartitions() >= 4
    got = back.select("key", "value", "streamlet", "group", "offset").collect()
    assert Counter((r.key.decode(), r.value.decode()) for r in got) == Counter(rows)
    assert len({(r.streamlet, r.group, r.offset) for r in got}) == len(got)


def test_streaming_read_and_write_on_executors(standalone_spark, cluster, tmp_path):
    spark = standalone_spark
    create(cluster, "sa-in", streamlets=2, active_groups=2)
    create(cluster, "sa-out", streamlets=2)
    first = [b"a%05d" % i for i in range(1500)]
    produce(cluster, "sa-in", first, [b"k%d" % (i % 7) for i in range(len(first))])
    ck = str(tmp_path / "ck")

    def run():
        src = spark.readStream.format("kera").options(
            **opts(cluster, "sa-in", startingOffsets="earliest", maxOffsetsPerTrigger="600")).load()
        q = (src.selectExpr("key", "upper(cast(value as string)) as value")
             .writeStream.format("kera").options(**opts(cluster, "sa-out"))
             .option("checkpointLocation", ck).trigger(availableNow=True).start())
        assert q.awaitTermination(240)
        assert q.exception() is None
        return q

    q = run()
    assert q.lastProgress is not None and q.lastProgress["batchId"] >= 2   # 600 per batch
    more = [b"b%05d" % i for i in range(400)]
    produce(cluster, "sa-in", more, [b"k%d" % (i % 5) for i in range(len(more))], producer_id=100)
    run()   # resumes from its checkpoint: only the new records
    got = Counter(bytes(r.value) for r in read_all(spark, cluster, "sa-out").collect())
    assert got == Counter(v.upper() for v in first + more)


def descendant_of(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])   # field 4, after the command's ')'
    return False


def test_exactly_once_sink_through_a_killed_executor(standalone, standalone_spark, cluster, tmp_path):
    """A write task blocks mid-partition after its sink has sent chunks; the test kill -9s the
    executor JVM running it. Spark re-runs the task on the other worker, which rebuilds the
    same chunks under the same producer ids: the broker drops the ones it has, every row is
    stored exactly once."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    spark = standalone_spark
    create(cluster, "sa-src", streamlets=2, active_groups=2)
    create(cluster, "sa-dst", streamlets=2, active_groups=2)
    n = 2000
    # Values large enough that the blocked UDF cannot run far ahead of the sink.
    values = [b"r%05d-" % i + b"." * 2000 for i in range(n)]
    produce(cluster, "sa-src", values, [b"u%d" % (i % 9) for i in range(n)], per_chunk=20)
    blocked, released = tmp_path / "blocked", tmp_path / "released"
    poison = "r01500-"
    # The blocked attempt waits at most this long for the kill (then fails the test).
    block_limit_s = 240.0

    def block_once(v):
        import time
        if v.startswith(poison) and not blocked.exists():
            blocked.write_text(str(os.getpid()))
            deadline = time.monotonic() + block_limit_s
            while not released.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("the executor running this task was not killed")
        return v

    fail = F.udf(block_once, StringType())
    before = sum(s.get("duplicates", 0) for s in broker_stats(cluster))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        src = spark.readStream.format("kera").options(
            **opts(cluster, "sa-src", startingOffsets="earliest")).load()
        out = src.select("key", fail(F.col("value").cast("string")).alias("value"), "timestamp")
        q = (out.writeStream.format("kera").options(**opts(cluster, "sa-dst", chunkSizeBytes="16384"))
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
        wait_until(blocked.exists, 240, "a write task blocked mid-partition")
        udf_pid = int(blocked.read_text())
        victims = [p for p in standalone.executor_pids() if descendant_of(udf_pid, p)]
        assert len(victims) == 1, (udf_pid, standalone.executor_pids())
        os.kill(victims[0], signal.SIGKILL)
        assert q.awaitTermination(300)
        assert q.exception() is None, q.exception()
    finally:
        released.write_text("x")
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = read_all(spark, cluster, "sa-dst").select("key", "value", "timestamp").collect()
    assert len(got) == n
    assert Counter(bytes(r.value) for r in got) == Counter(values)
    src_rows = {bytes(r.value): r for r in read_all(spark, cluster, "sa-src").collect()}
    assert all(src_rows[bytes(r.value)].key == r.key and src_rows[bytes(r.value)].timestamp == r.timestamp
               for r in got)
    after = sum(s.get("duplicates", 0) for s in broker_stats(cluster))
    assert after > before, "the re-run task re-sent chunks the broker already had"
