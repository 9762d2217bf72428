"""Click pipeline: producer -> kera -> Spark Structured Streaming -> kera -> consumer.

1. A kera Producer writes click events (key = user, value = {"user", "page"} as JSON, record
   timestamp = the click's event time) into stream `clicks`.
2. A Spark Structured Streaming job reads `clicks` with format "kera", counts clicks per user
   per 10-second event-time window, and writes the counts into stream `click_counts` (key =
   user, value = {"user", "window_start", "clicks"} as JSON) with the exactly-once kera sink.
   It runs in "complete" output mode: every trigger appends the whole table of counts (Spark
   offers Python sinks "append" and "complete" only), so a count can appear several times, the
   latest (largest) being the current one.
3. A kera Consumer reads `click_counts` and prints the final count per user and window.

Run it (starts a local cluster in a temporary directory unless --bootstrap is given):

    python examples/click_pipeline.py
    python examples/click_pipeline.py --bootstrap 127.0.0.1:7000 --events 5000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

WINDOW_S = 10
CLICKS = "clicks"
COUNTS = "click_counts"


# --------------------------------------------------------------------------- 1. produce

def make_events(n: int, seed: int = 1, start_s: int = 1_700_000_000, users: int = 20,
                pages: int = 5, span_s: int = 60) -> list[tuple[str, str, int]]:
    """n clicks (user, page, event time in µs) spread over span_s seconds."""
    rnd = random.Random(seed)
    return [(f"user-{rnd.randrange(users)}", f"/page/{rnd.randrange(pages)}",
             (start_s + rnd.randrange(span_s)) * 1_000_000 + rnd.randrange(1_000_000))
            for _ in range(n)]


def create_streams(bootstrap: str, clicks: str = CLICKS, counts: str = COUNTS,
                   replication: int = 1) -> None:
    from kera.client.admin import Admin

    with Admin(bootstrap) as admin:
        admin.create_stream(clicks, streamlets=2, active_groups=2, replication=replication)
        admin.create_stream(counts, streamlets=2, active_groups=1, replication=replication)


def produce_clicks(bootstrap: str, events, stream: str = CLICKS) -> None:
    from kera.producer import Producer

    with Producer(bootstrap) as producer:
        for user, page, ts_us in events:
            producer.send(stream, json.dumps({"user": user, "page": page}).encode(),
                          key=user.encode(), timestamp=ts_us)
        producer.flush()


# --------------------------------------------------------------------------- 2. aggregate

def start_aggregation(spark, bootstrap: str, checkpoint: str, clicks: str = CLICKS,
                      counts: str = COUNTS, available_now: bool = True):
    """Start the streaming job; returns the StreamingQuery."""
    from pyspark.sql import functions as F

    events = (spark.readStream.format("kera")
              .option("bootstrap", bootstrap).option("stream", clicks)
              .option("startingOffsets", "earliest")
              .load()
              .select(F.col("key").cast("string").alias("user"), "timestamp"))
    per_window = events.groupBy(F.window("timestamp", f"{WINDOW_S} seconds"), "user").count()
    out = per_window.select(
        F.col("user").alias("key"),
        F.to_json(F.struct("user", F.col("window.start").cast("long").alias("window_start"),
                           F.col("count").alias("clicks"))).alias("value"))
    writer = (out.writeStream.format("kera")
              .option("bootstrap", bootstrap).option("stream", counts)
              .option("checkpointLocation", checkpoint)
              .outputMode("complete"))
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="1 second")
    return writer.start()


# --------------------------------------------------------------------------- 3. consume

def expected_counts(events) -> dict[tuple[str, int], int]:
    return dict(Counter((user, (ts_us // 1_000_000) // WINDOW_S * WINDOW_S) for user, _, ts_us in events))


def read_counts(bootstrap: str, stream: str = COUNTS, idle_s: float = 2.0,
                until: dict | None = None, timeout_s: float = 60.0) -> dict[tuple[str, int], int]:
    """Final count per (user, window start): the largest update seen. Reads until `until` is
    matched, or nothing new arrived for idle_s seconds, or timeout_s passed."""
    from kera.consumer import Consumer

    counts: dict[tuple[str, int], int] = {}
    deadline = time.monotonic() + timeout_s
    last_new = time.monotonic()
    with Consumer(bootstrap, stream, start="earliest") as consumer:
        while time.monotonic() < deadline:
            record = consumer.poll(timeout_s=0.2)
            if record is None:
                if (until is not None and counts == until) or \
                        (until is None and time.monotonic() - last_new > idle_s):
                    break
                continue
            last_new = time.monotonic()
            row = json.loads(record.value)
            key = (row["user"], row["window_start"])
            counts[key] = max(counts.get(key, 0), row["clicks"])
    return counts


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", help="coordinator host:port (default: start a local cluster)")
    parser.add_argument("--events", type=int, default=2000)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    import kera.spark

    workdir = tempfile.mkdtemp(prefix="kera-clicks-")
    cluster = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from kera.cli.local import LocalCluster
        cluster = LocalCluster(os.path.join(workdir, "cluster"), brokers=1, backups=0)
        bootstrap = cluster.bootstrap
        print(f"local cluster at {bootstrap} (data in {workdir})")
    spark = (SparkSession.builder.master("local[2]").appName("kera-click-pipeline")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    kera.spark.register(spark)
    try:
        create_streams(bootstrap)
        events = make_events(args.events)
        produce_clicks(bootstrap, events)
        print(f"produced {len(events)} clicks into '{CLICKS}'")
        query = start_aggregation(spark, bootstrap, os.path.join(workdir, "checkpoint"))
        query.awaitTermination()
        print(f"Spark job done: {query.lastProgress and query.lastProgress['batchId'] + 1} micro-batch(es)")
        counts = read_counts(bootstrap)
        for (user, window_start), clicks in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            print(f"{time.strftime('%H:%M:%S', time.gmtime(window_start))} {user:>8} {clicks:4d}")
        ok = counts == expected_counts(events)
        print("counts match the events" if ok else "counts DO NOT match the events")
        return 0 if ok else 1
    finally:
        spark.stop()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
