"""Throughput of the Spark connector next to Spark's own ceilings, measured in one run.

    python -m kera.spark.bench                       # local cluster, 1M rows of 100-byte values
    python -m kera.spark.bench --rows 2000000 --bootstrap 127.0.0.1:7000

Each line is rows/s for the same rows (a 100-byte value each) with Spark `local[2]`:

- spark ceiling: generate the rows and drop them (`noop` sink), all in the JVM
- python sink ceiling: generate the rows and hand them to a Python Arrow sink that drops
  them: the cost of Spark's Python Data Source write path, which the kera sink also pays
- kera write:    generate the rows and write them to a kera stream (`df.write.format("kera")`)
- python source ceiling: a Python source yielding ready-made Arrow batches of such rows
- kera read:     `spark.read.format("kera")` of those rows into the `noop` sink
- stream ceiling / kera stream read: Trigger.AvailableNow over the `rate-micro-batch` source
  vs over the kera stream, into the `noop` sink

Python workers are warmed up first (a small kera write and read).

Numbers are reported, never asserted: this machine is shared and noisy, which is why the
ceilings run next to the measurements. Best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from pyspark.sql.datasource import (DataSource, DataSourceArrowWriter, DataSourceReader,
                                    InputPartition, WriterCommitMessage)

VALUE_EXPR = "cast(concat(lpad(cast(id as string), 12, '0'), repeat('x', 88)) as binary)"
BATCH_ROWS = 10_000


class _NullWriter(DataSourceArrowWriter):
    def write(self, iterator):
        for _ in iterator:
            pass
        return WriterCommitMessage()


class _ReadyReader(DataSourceReader):
    def __init__(self, rows: int):
        self.rows = rows

    def partitions(self):
        return [InputPartition(self.rows // 2), InputPartition(self.rows - self.rows // 2)]

    def read(self, partition):
        import pyarrow as pa
        batch = pa.record_batch([pa.array([b"%012d" % i + b"x" * 88 for i in range(BATCH_ROWS)])],
                                names=["value"])
        left = partition.value
        while left > 0:
            yield batch.slice(0, min(left, BATCH_ROWS))
            left -= BATCH_ROWS


class PythonCeiling(DataSource):
    """A Python source and sink doing no work: what Spark's Python Data Source API costs."""

    @classmethod
    def name(cls) -> str:
        return "kera_bench_ceiling"

    def schema(self) -> str:
        return "value binary"

    def reader(self, schema):
        return _ReadyReader(int(self.options["rows"]))

    def writer(self, schema, overwrite):
        return _NullWriter()


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(spark, bootstrap: str, rows: int, repeat: int = 2, streamlets: int = 2) -> dict[str, float]:
    from kera.client.admin import Admin

    spark.dataSource.register(PythonCeiling)
    admin = Admin(bootstrap)

    def new_stream() -> dict:
        name = f"bench-{time.time_ns()}"
        admin.create_stream(name, streamlets=streamlets, active_groups=1, replication=1)
        return {"bootstrap": bootstrap, "stream": name}

    def generated(n: int):
        return spark.range(0, n, numPartitions=2).selectExpr(f"{VALUE_EXPR} as value")

    warm = new_stream()
    generated(10_000).write.format("kera").options(**warm).mode("append").save()
    spark.read.format("kera").options(**warm).load().write.format("noop").mode("overwrite").save()

    out: dict[str, float] = {}
    data = generated(rows)
    out["spark ceiling (range -> noop)"] = rows / _best(
        lambda: data.write.format("noop").mode("overwrite").save(), repeat)
    out["python sink ceiling (range -> null python sink)"] = rows / _best(
        lambda: data.write.format("kera_bench_ceiling").mode("append").save(), repeat)
    targets = []

    def write_kera():
        targets.append(new_stream())
        data.write.format("kera").options(**targets[-1]).mode("append").save()

    out["kera write (range -> kera)"] = rows / _best(write_kera, repeat)
    kera_opts = targets[-1]

    out["python source ceiling (python source -> noop)"] = rows / _best(
        lambda: spark.read.format("kera_bench_ceiling").option("rows", rows).load()
        .write.format("noop").mode("overwrite").save(), repeat)
    reader = spark.read.format("kera").options(**kera_opts, minPartitions="2")
    count = reader.load().count()
    assert count == rows, f"read {count} rows back, wrote {rows}"
    out["kera read (kera -> noop)"] = rows / _best(
        lambda: reader.load().write.format("noop").mode("overwrite").save(), repeat)

    def stream(df):
        ck = tempfile.mkdtemp(prefix="kera-bench-ck-")
        q = df.writeStream.format("noop").option("checkpointLocation", ck).trigger(availableNow=True).start()
        q.awaitTermination()

    rate = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rows)
            .option("numPartitions", 2).load().selectExpr(f"{VALUE_EXPR.replace('id', 'value')} as value"))

    def rate_once():
        ck = tempfile.mkdtemp(prefix="kera-bench-ck-")
        # rate-micro-batch has no AvailableNow support: one batch of `rows` rows, then stop.
        q = rate.writeStream.format("noop").option("checkpointLocation", ck).trigger(once=True).start()
        q.awaitTermination()

    out["stream ceiling (rate-micro-batch -> noop)"] = rows / _best(rate_once, repeat)
    kera_stream = spark.readStream.format("kera").options(**kera_opts, startingOffsets="earliest",
                                                          minPartitions="2").load()
    out["kera stream read (kera -> noop)"] = rows / _best(lambda: stream(kera_stream), repeat)
    admin.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="kera Spark connector throughput")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--bootstrap", help="coordinator host:port (default: start a local cluster)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import kera.spark

    cluster = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from kera.cli.local import LocalCluster
        cluster = LocalCluster(tempfile.mkdtemp(prefix="kera-bench-"), brokers=1, backups=0,
                               log_level="WARNING")
        bootstrap = cluster.bootstrap
    spark = (SparkSession.builder.master("local[2]").appName("kera-spark-bench")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    kera.spark.register(spark)
    try:
        results = run(spark, bootstrap, args.rows, args.repeat)
    finally:
        spark.stop()
        if cluster is not None:
            cluster.stop()
    width = max(map(len, results))
    print(f"{args.rows} rows of 100-byte values, Spark local[2], best of {args.repeat}")
    for label, rate in results.items():
        print(f"  {label:<{width}}  {rate:>12,.0f} rows/s  {rate * 100 / 1e6:8.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
