"""Spark's own Kafka connector (`format("kafka")`, package spark-sql-kafka-0-10 fetched from
Maven Central through `spark.jars.packages`) against kera's Kafka listener: a batch read of
records produced by kafka-python, column by column; `startingOffsetsByTimestamp`; a batch write
read back by kafka-python and by Spark (headers included); a streaming read, run twice from one
checkpoint.

The connector's version is the installed PySpark's. When Maven Central has no such release
(a PySpark newer than what the repository serves), the newest release of the same major version
it has is used instead, and the session says so on stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kafkit import (CLIENT_TIMEOUT_MS, WAIT_S, consume_kafka_python, create_topic,
                    kafka_python_consumer, kafka_python_producer)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

MAVEN = "https://repo1.maven.org/maven2/org/apache/spark"
STREAM_WAIT_S = 120          # one availableNow streaming run, start to finish
KAFKA_OPTS = {               # Spark's Kafka clients, with timeouts of their own
    "kafka.request.timeout.ms": str(CLIENT_TIMEOUT_MS),
    "kafka.default.api.timeout.ms": str(2 * CLIENT_TIMEOUT_MS),
    "kafka.session.timeout.ms": "10000",
}


# ---------------------------------------------------------------------- the Spark session
def _connector_version(scala: str, version: str) -> str:
    """`version` if Maven Central has spark-sql-kafka-0-10 at it, else the newest release of
    the same major version it lists; pytest.skip if Maven Central cannot be reached."""
    artifact = f"spark-sql-kafka-0-10_{scala}"
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"{MAVEN}/{artifact}/{version}/{artifact}-{version}.pom", method="HEAD"), timeout=15)
        return version
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            pytest.skip(f"Maven Central answered {exc.code} for {artifact}:{version}")
    except OSError as exc:
        pytest.skip(f"Maven Central unreachable, needed for {artifact}: {exc}")
    with urllib.request.urlopen(f"{MAVEN}/{artifact}/maven-metadata.xml", timeout=15) as reply:
        listed = re.findall(r"<version>([0-9.]+)</version>", reply.read().decode())
    major = version.split(".")[0]
    same_major = sorted((v for v in listed if v.split(".")[0] == major),
                        key=lambda v: tuple(int(x) for x in v.split(".")))
    if not same_major:
        pytest.skip(f"Maven Central has no {artifact} release {major}.x (PySpark {version})")
    sys.stderr.write(f"\nMaven Central has no {artifact}:{version}; using {same_major[-1]}\n")
    return same_major[-1]


def _kafka_source_loaded(jvm) -> bool:
    """Whether the JVM's context class loader (py4j's, and the driver's: the one
    `spark.jars.packages` extends) has the connector's classes."""
    from py4j.java_gateway import JavaClass
    return isinstance(jvm.org.apache.spark.sql.kafka010.KafkaSourceProvider, JavaClass)


def _stop_jvm_without_kafka_source() -> None:
    """`spark.jars.packages` is applied when PySpark launches its JVM; a JVM already running in
    this process (another module's session) without the Kafka source is shut down, so that
    the next session launches one with it."""
    from pyspark import SparkContext
    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()
    gateway = SparkContext._gateway
    if gateway is None or _kafka_source_loaded(SparkContext._jvm):
        return
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    if proc is not None:
        proc.stdin.close()            # the JVM exits when its stdin closes
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
            proc.wait(timeout=30)
    SparkContext._gateway = None
    SparkContext._jvm = None


@pytest.fixture(scope="module")
def kspark(tmp_path_factory):
    """A local SparkSession with Spark's Kafka connector, for this module; stopped at its end
    (tests/spark's fixtures build their own session again)."""
    try:
        import pyspark
    except ImportError:
        pytest.skip("pyspark is needed")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("a Java runtime is needed")
    jars = Path(pyspark.__file__).parent / "jars"
    [scala_jar] = jars.glob("scala-library-*.jar")
    scala = ".".join(scala_jar.stem.split("-")[-1].split(".")[:2])         # "2.13"
    version = _connector_version(scala, pyspark.__version__)
    package = f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{version}"

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    _stop_jvm_without_kafka_source()
    session = (SparkSession.builder.master("local[2]").appName("kera-spark-kafka-tests")
               .config("spark.jars.packages", package)
               .config("spark.jars.ivy", str(Path.home() / ".ivy2"))
               .config("spark.ui.enabled", "false")
               .config("spark.driver.memory", "1g")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("warehouse")))
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.streaming.stopTimeout", "30s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    assert _kafka_source_loaded(session.sparkContext._jvm), f"{package} not on the classpath"
    yield session
    session.stop()


def read_batch(spark, cluster, topic: str, **options):
    reader = spark.read.format("kafka").option("kafka.bootstrap.servers",
                                               cluster.kafka_bootstrap)
    for k, v in {**KAFKA_OPTS, "subscribe": topic, **options}.items():
        reader = reader.option(k, v)
    return reader.load()


def produce(cluster, topic: str, records: list[dict]) -> dict:
    """Send each record (kafka-python `send` keyword arguments); {(partition, offset): the
    record with its acknowledged timestamp}."""
    producer = kafka_python_producer(cluster, acks="all", linger_ms=5)
    try:
        futures = [(r, producer.send(topic, **r)) for r in records]
        producer.flush(timeout=WAIT_S)
        acked = {}
        for r, f in futures:
            md = f.get(timeout=WAIT_S)
            acked[(md.partition, md.offset)] = {**r, "timestamp_ms": md.timestamp}
    finally:
        producer.close(timeout=10)
    assert len(acked) == len(records)
    return acked


def rows(df) -> list:
    from pyspark.sql import functions as F
    return df.select("key", "value", "topic", "partition", "offset",
                     F.unix_millis("timestamp").alias("ts"), "timestampType").collect()


# ---------------------------------------------------------------------- tests
def test_batch_read_earliest_to_latest_column_by_column(kafka_cluster, topic, kspark):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    base = int(time.time() * 1000) - 60_000
    records = [{"key": b"k%d" % (i % 5), "value": b"value-%03d" % i, "partition": i % 2,
                "timestamp_ms": base + i} for i in range(60)]
    records.append({"key": None, "value": b"no key", "partition": 1, "timestamp_ms": base + 99})
    acked = produce(kafka_cluster, topic, records)

    df = read_batch(kspark, kafka_cluster, topic, startingOffsets="earliest",
                    endingOffsets="latest")
    got = sorted(rows(df), key=lambda r: (r.partition, r.offset))
    assert len(got) == len(acked)
    assert [(r.partition, r.offset) for r in got] == sorted(acked)
    for r in got:
        want = acked[(r.partition, r.offset)]
        assert (r.key, r.value, r.topic, r.ts, r.timestampType) == \
            (want["key"], want["value"], topic, want["timestamp_ms"], 0), (r, want)
    # Offsets dense from 0 in each partition, records in the order sent.
    for p in (0, 1):
        sent = [r["value"] for r in records if r["partition"] == p]
        assert [bytes(r.value) for r in got if r.partition == p] == sent
        assert [r.offset for r in got if r.partition == p] == list(range(len(sent)))

    # Explicit per-partition offsets: [from, until) of each partition.
    df = read_batch(kspark, kafka_cluster, topic,
                    startingOffsets=json.dumps({topic: {"0": 10, "1": 3}}),
                    endingOffsets=json.dumps({topic: {"0": 20, "1": -1}}))
    got = {(r.partition, r.offset) for r in rows(df)}
    assert got == {(0, o) for o in range(10, 20)} | {(1, o) for o in range(3, 31)}


def test_starting_offsets_by_timestamp_picks_the_first_offset_at_or_after(kafka_cluster, topic,
                                                                          kspark):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    base = int(time.time() * 1000) - 3_600_000
    # Partition 0: a record per second; partition 1: a record every 10 s.
    records = [{"value": b"p0-%d" % i, "partition": 0, "timestamp_ms": base + 1000 * i}
               for i in range(30)]
    records += [{"value": b"p1-%d" % i, "partition": 1, "timestamp_ms": base + 10_000 * i}
                for i in range(10)]
    produce(kafka_cluster, topic, records)

    # 12.5 s -> offset 13 in partition 0 (13 s); 40 s exactly -> offset 4 in partition 1.
    df = read_batch(kspark, kafka_cluster, topic,
                    startingOffsetsByTimestamp=json.dumps(
                        {topic: {"0": base + 12_500, "1": base + 40_000}}),
                    endingOffsets="latest")
    got = sorted((r.partition, r.offset, bytes(r.value), r.ts) for r in rows(df))
    want = [(0, i, b"p0-%d" % i, base + 1000 * i) for i in range(13, 30)] + \
           [(1, i, b"p1-%d" % i, base + 10_000 * i) for i in range(4, 10)]
    assert got == want

    # Before the first record: every record; ending by timestamp too.
    df = read_batch(kspark, kafka_cluster, topic,
                    startingOffsetsByTimestamp=json.dumps({topic: {"0": base - 5, "1": base}}),
                    endingOffsetsByTimestamp=json.dumps(
                        {topic: {"0": base + 5_000, "1": base + 20_001}}))
    got = sorted((r.partition, r.offset) for r in rows(df))
    assert got == [(0, i) for i in range(5)] + [(1, i) for i in range(3)]


def test_batch_write_read_back_by_kafka_python_and_spark(kafka_cluster, topic, kspark):
    from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, StringType, StructField,
                                   StructType)
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
    schema = StructType([StructField("key", StringType()), StructField("value", StringType()),
                         StructField("partition", IntegerType()),
                         StructField("headers", ArrayType(header))])
    data = [(f"key-{i}", f"value-{i}", i % 2,
             [("seq", b"%d" % i), ("kind", b"even" if i % 2 == 0 else b"odd")])
            for i in range(50)]
    data.append((None, "keyless", 0, []))
    df = kspark.createDataFrame(data, schema).coalesce(1)
    writer = df.write.format("kafka").option("kafka.bootstrap.servers",
                                             kafka_cluster.kafka_bootstrap)
    for k, v in {**KAFKA_OPTS, "topic": topic, "kafka.acks": "all",
                 "kafka.delivery.timeout.ms": "60000"}.items():
        writer = writer.option(k, v)
    writer.save()

    expected = {(i % 2, f"key-{i}".encode(), f"value-{i}".encode(),
                 (("seq", b"%d" % i), ("kind", b"even" if i % 2 == 0 else b"odd")))
                for i in range(50)} | {(0, None, b"keyless", ())}

    consumer = kafka_python_consumer(kafka_cluster, topic)
    try:
        got = consume_kafka_python(consumer, len(data))
        extra = consumer.poll(timeout_ms=1000)
    finally:
        consumer.close()
    assert not any(extra.values()), "records beyond those written"
    read = [(r.partition, r.key, r.value, tuple(tuple(h) for h in r.headers)) for r in got]
    assert len(read) == len(set(read)) == len(data)
    assert set(read) == expected
    # One Spark partition (coalesce(1)): each Kafka partition holds its records in order.
    for p in (0, 1):
        offsets = [r.offset for r in got if r.partition == p]
        assert offsets == list(range(len(offsets)))
        seqs = [int(dict(r.headers)["seq"]) for r in got if r.partition == p and r.headers]
        assert seqs == sorted(seqs)

    # Spark reads the headers back (includeHeaders).
    back = read_batch(kspark, kafka_cluster, topic, includeHeaders="true",
                      startingOffsets="earliest", endingOffsets="latest").collect()
    spark_read = {(r.partition, None if r.key is None else bytes(r.key), bytes(r.value),
                   tuple((h.key, bytes(h.value)) for h in (r.headers or [])))
                  for r in back}
    assert len(back) == len(data) and spark_read == expected


def test_streaming_read_gets_every_record_and_resumes_from_its_checkpoint(kafka_cluster, topic,
                                                                          kspark, tmp_path):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    first = [{"key": b"k%d" % i, "value": b"first-%d" % i} for i in range(80)]
    produce(kafka_cluster, topic, first)
    checkpoint = str(tmp_path / "checkpoint")
    batches: list = []

    def run() -> list:
        seen = len(batches)
        stream = kspark.readStream.format("kafka").option("kafka.bootstrap.servers",
                                                          kafka_cluster.kafka_bootstrap)
        for k, v in {**KAFKA_OPTS, "subscribe": topic, "startingOffsets": "earliest",
                     "maxOffsetsPerTrigger": "50"}.items():
            stream = stream.option(k, v)

        def collect(df, batch_id):
            batches.append((batch_id, [(r.partition, r.offset, bytes(r.key), bytes(r.value))
                                       for r in df.collect()]))

        query = (stream.load().writeStream.foreachBatch(collect)
                 .option("checkpointLocation", checkpoint)
                 .trigger(availableNow=True).start())
        try:
            assert query.awaitTermination(STREAM_WAIT_S), \
                f"availableNow query still running after {STREAM_WAIT_S} s"
            assert query.exception() is None, query.exception()
        finally:
            query.stop()
        return [rec for _, recs in batches[seen:] for rec in recs]

    got = run()
    assert sorted((k, v) for _, _, k, v in got) == sorted((r["key"], r["value"]) for r in first)
    assert len({(p, o) for p, o, _, _ in got}) == len(first)
    assert len(batches) >= 2, "maxOffsetsPerTrigger=50 of 80 records: at least two batches"

    second = [{"key": b"n%d" % i, "value": b"second-%d" % i} for i in range(30)]
    produce(kafka_cluster, topic, second)
    got = run()      # the same checkpoint: only the records written since
    assert sorted((k, v) for _, _, k, v in got) == sorted((r["key"], r["value"]) for r in second)
