"""Throughput of the Spark connector next to Spark's own ceilings, measured in one run.

    python -m kera.spark.bench                       # local cluster, 1M rows of 100-byte values
    python -m kera.spark.bench --rows 2000000 --bootstrap 127.0.0.1:7000

Each line is rows/s for the same rows (a 100-byte value each) with Spark `local[2]`:

- write ceiling: generate the rows and drop them (`noop` sink)
- kera write:    generate the rows and write them to a kera stream (`df.write.format("kera")`)
- read ceiling:  generate the rows and drop them again, the cost of a batch scan into Spark
- kera read:     `spark.read.format("kera")` of those rows into the `noop` sink
- stream ceiling / kera stream read: Trigger.AvailableNow over the `rate-micro-batch` source
  vs over the kera stream, into the `noop` sink

Numbers are reported, never asserted: this machine is shared and noisy, which is why the
ceilings run next to the measurements. Best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

VALUE_EXPR = "cast(concat(lpad(cast(id as string), 12, '0'), repeat('x', 88)) as binary)"


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(spark, bootstrap: str, rows: int, repeat: int = 2, streamlets: int = 2) -> dict[str, float]:
    from kera.admin import Admin

    name = f"bench-{int(time.time() * 1000)}"
    with Admin(bootstrap) as admin:
        admin.create_stream(name, streamlets=streamlets, active_groups=1, replication=1)
    generated = spark.range(0, rows, numPartitions=2).selectExpr(f"{VALUE_EXPR} as value")
    kera_opts = {"bootstrap": bootstrap, "stream": name}
    out: dict[str, float] = {}

    out["write ceiling (range -> noop)"] = rows / _best(
        lambda: generated.write.format("noop").mode("overwrite").save(), repeat)
    # Written once only: the stream must hold `rows` rows for the reads below.
    out["kera write (range -> kera)"] = rows / _best(
        lambda: generated.write.format("kera").options(**kera_opts).mode("append").save(), 1)

    out["read ceiling (range -> noop)"] = rows / _best(
        lambda: generated.selectExpr("value").write.format("noop").mode("overwrite").save(), repeat)
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
        from kera.local import LocalCluster
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
