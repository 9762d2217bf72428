"""Format "kera" in a real SparkSession against a real local cluster: batch round trip,
streaming reads resumed from a checkpoint, an exactly-once streaming write through a failed
and re-run batch, maxOffsetsPerTrigger, and the example pipeline."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from kera.codec import chunk as kchunk

from kera.net import rpc
from kera.client.admin import Admin

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def opts(cluster, stream, **more):
    return {"bootstrap": cluster.bootstrap, "stream": stream, **more}


def create(cluster, name, **kw):
    with Admin(cluster.bootstrap) as admin:
        return admin.create_stream(name, **kw)


def produce(cluster, stream, values, keys=None, producer_id=7, ts=None, per_chunk=50):
    """Append records over the wire as a new producer (ids producer_id + streamlet), `per_chunk`
    per chunk, keyed records to their key's streamlet (crc32c mod M), keyless ones to
    streamlet 0."""
    from kera.codec.partitioner import streamlet_for_key

    with Admin(cluster.bootstrap) as admin:
        desc = admin.describe_stream(stream)
    m = desc["streamlets"]
    by_sl: dict[int, list] = {}
    for i, v in enumerate(values):
        k = keys[i] if keys else None
        sl = 0 if k is None else streamlet_for_key(k, m)
        by_sl.setdefault(sl, []).append((k, v, ts[i] if ts else 1_700_000_000_000_000 + i))
    for sl, rows in sorted(by_sl.items()):
        address = desc["brokers"][str(desc["placement"][sl])]
        with rpc.Connection(address) as conn:
            s = 0
            for a in range(0, len(rows), per_chunk):
                part = rows[a:a + per_chunk]
                chunk = kchunk.encode(producer_id + sl, s, desc["id"], sl, [r[1] for r in part],
                                      [r[0] for r in part] if keys else None, [r[2] for r in part])
                header, _ = conn.call("produce", None, [chunk])
                assert not isinstance(header["results"][0][0], str), header
                s += 1


def read_all(spark, cluster, stream, **more):
    return spark.read.format("kera").options(**opts(cluster, stream, **more)).load()


def broker_stats(cluster) -> list[dict]:
    return [rpc.call(b.address, "stats")[0]["stats"] for b in cluster.brokers]


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=0)


# --------------------------------------------------------------------------- batch

def test_batch_round_trip_exact(spark, cluster):
    create(cluster, "rt", streamlets=3, active_groups=2)
    rows = [(f"user-{i % 17}", f"value-{i:05d}-" + "x" * (i % 50)) for i in range(5000)]
    df = spark.createDataFrame(rows, "key string, value string")
    df.write.format("kera").options(**opts(cluster, "rt", chunkSizeBytes="2048")).mode("append").save()

    back = read_all(spark, cluster, "rt")
    assert back.schema.simpleString() == (
        "struct<key:binary,value:binary,stream:string,streamlet:int,group:int,offset:bigint,"
        "timestamp:timestamp,headers:array<struct<key:string,value:binary>>,number:bigint>")
    got = back.collect()
    assert Counter((r.key.decode(), r.value.decode()) for r in got) == Counter(rows)
    assert {r.stream for r in got} == {"rt"}
    # offsets are dense from 0 in every group, and each key sits on one streamlet
    by_group: dict = {}
    for r in got:
        by_group.setdefault((r.streamlet, r.group), []).append(r.offset)
    for offs in by_group.values():
        assert sorted(offs) == list(range(len(offs)))
    # record numbers: within a group they follow the offsets (the slot's numbering goes on
    # across its groups), and the streamlet's first groups start at 0
    bases = {(r.streamlet, r.group, r.number - r.offset) for r in got}
    assert len(bases) == len(by_group)
    assert {sl for sl, g, base in bases if base == 0} == {r.streamlet for r in got}
    assert all(len({r.streamlet for r in got if r.key == k}) == 1 for k in {r.key for r in got})
    # one writer task per input partition, so per key the rows of one task stay in order
    ordered = sorted(got, key=lambda r: (r.streamlet, r.group, r.offset))
    for key in {r.key for r in got}:
        mine = [r.value.decode() for r in ordered if r.key == key]
        assert Counter(mine) == Counter(v for k, v in rows if k == key.decode())

    # bounded reads: endingOffsets from a JSON offset, minPartitions splits groups
    ending = {"rt": {"0": {"next": 1, "groups": {"0": 5}}}}
    part = read_all(spark, cluster, "rt", endingOffsets=json.dumps(ending), minPartitions="4")
    got = part.collect()
    # streamlet 0 stops at offset 5 of group 0; the other streamlets are read to the end
    assert sorted(r.offset for r in got if r.streamlet == 0) == list(range(5))
    assert len([r for r in got if r.streamlet != 0]) == len([r for r in ordered if r.streamlet != 0])
    assert read_all(spark, cluster, "rt", minPartitions="7").count() == 5000


def test_batch_read_of_an_empty_stream_and_bad_options(spark, cluster):
    create(cluster, "empty", streamlets=2)
    assert read_all(spark, cluster, "empty").count() == 0
    with pytest.raises(Exception, match="bootstrap"):
        spark.read.format("kera").option("stream", "empty").load().collect()
    with pytest.raises(Exception, match="unknown_stream|no stream|unknown stream"):
        read_all(spark, cluster, "no-such-stream").collect()


def test_write_to_a_missing_stream_fails_while_planning_and_save_mode_is_explained(spark, cluster):
    df = spark.range(3).selectExpr("cast(id as string) as value")
    writer = df.write.format("kera").options(**opts(cluster, "never-created"))
    with pytest.raises(Exception) as missing:
        writer.mode("append").save()
    text = str(missing.value)
    assert "'never-created': it does not exist" in text and "kera stream create never-created" in text
    assert "failed 4 times" not in text and "in stage" not in text   # no task ran
    create(cluster, "mode-check", streamlets=1)
    with pytest.raises(Exception, match="Append"):     # Spark's default ErrorIfExists: refused
        df.write.format("kera").options(**opts(cluster, "mode-check")).save()
    with pytest.raises(Exception, match=r"append-only: use mode\('append'\)"):
        df.write.format("kera").options(**opts(cluster, "mode-check")).mode("overwrite").save()


def test_subscribe_pattern_reads_every_stream_whose_whole_name_matches(spark, cluster):
    for name in ("pat-a", "pat-b", "xpat-c"):
        create(cluster, name, streamlets=1)
        produce(cluster, name, [name.encode() + b"-%d" % i for i in range(5)])
    reader = spark.read.format("kera").option("bootstrap", cluster.bootstrap)
    rows = reader.option("subscribePattern", "pat-.*").load().select("stream", "value").collect()
    assert sorted((r.stream, bytes(r.value)) for r in rows) == sorted(
        (n, n.encode() + b"-%d" % i) for n in ("pat-a", "pat-b") for i in range(5))
    with pytest.raises(Exception, match="no stream on .* matches subscribePattern 'nothing-.*'"):
        reader.option("subscribePattern", "nothing-.*").load().collect()
    with pytest.raises(Exception, match="'stream' or 'subscribePattern', not both"):
        reader.options(stream="pat-a", subscribePattern="pat-.*").load().collect()


# --------------------------------------------------------------------------- streaming read

def wait_for(predicate, timeout_s=120.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_streaming_read_resumes_from_checkpoint_exactly_once(spark, cluster, tmp_path):
    create(cluster, "events", streamlets=2, active_groups=2)
    n1 = 1200
    values = [b"e%05d" % i for i in range(n1)]
    keys = [b"k%d" % (i % 13) for i in range(n1)]
    produce(cluster, "events", values, keys)
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")

    def start(trigger, **limit):
        df = spark.readStream.format("kera").options(**opts(
            cluster, "events", startingOffsets="earliest", **limit)).load()
        w = (df.selectExpr("cast(value as string) as value", "streamlet", "group", "offset")
             .writeStream.format("parquet").option("path", out).option("checkpointLocation", ck))
        return w.trigger(**trigger).start()

    q = start({"processingTime": "200 milliseconds"}, maxOffsetsPerTrigger="100")
    try:
        wait_for(lambda: q.lastProgress is not None and q.lastProgress["batchId"] >= 2,
                 what="three micro-batches")
    finally:
        q.stop()
    assert q.exception() is None
    first_run = spark.read.parquet(out).count()
    assert 0 < first_run < n1  # stopped mid-stream

    # more records (a second producer, and more of the first) while the query is down
    n2 = 400
    values2 = [b"f%05d" % i for i in range(n2)]
    produce(cluster, "events", values2, [b"k%d" % (i % 5) for i in range(n2)], producer_id=100)
    q = start({"availableNow": True})  # the rest in one batch (the limit may change on restart)
    assert q.awaitTermination(180)
    assert q.exception() is None
    rows = spark.read.parquet(out).collect()
    got = Counter(r.value.encode() for r in rows)
    assert got == Counter(values + values2), "every record exactly once"
    assert len({(r.streamlet, r.group, r.offset) for r in rows}) == len(rows)


def test_max_offsets_per_trigger_bounds_batches_and_keeps_producer_order(spark, cluster, tmp_path):
    # Small segments, one per group: groups close every few chunks, so micro-batches cross
    # group boundaries; each streamlet is written by one producer (one slot).
    create(cluster, "bounded", streamlets=3, active_groups=2, group_segments=1, segment_size_bytes=8192)
    n = 2000
    produce(cluster, "bounded", [b"b%05d" % i for i in range(n)], [b"k%d" % (i % 11) for i in range(n)],
            per_chunk=40)
    sizes: list[int] = []
    seen: list = []

    def each(batch_df, batch_id):
        rows = batch_df.select("value", "streamlet", "group", "offset").collect()
        sizes.append(len(rows))
        seen.extend((batch_id, r.streamlet, r.group, r.offset, r.value) for r in rows)

    q = (spark.readStream.format("kera")
         .options(**opts(cluster, "bounded", startingOffsets="earliest", maxOffsetsPerTrigger="300"))
         .load().writeStream.foreachBatch(each)
         .option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(180)
    assert q.exception() is None
    nonempty = [s for s in sizes if s]
    assert all(s <= 300 for s in sizes), sizes
    assert sum(sizes) == n and len(nonempty) >= n // 300
    assert Counter(r[-1] for r in seen) == Counter(b"b%05d" % i for i in range(n))
    assert len({r[1] for r in seen}) == 3 and len({(r[1], r[2]) for r in seen}) > 6  # groups closed
    # Per streamlet (one producer), batches deliver records in the order they were sent.
    for sl in range(3):
        mine = sorted((r for r in seen if r[1] == sl), key=lambda r: r[:4])
        assert [r[-1] for r in mine] == sorted(r[-1] for r in mine)


def test_streaming_read_starting_latest_skips_existing_records(spark, cluster, tmp_path):
    create(cluster, "late", streamlets=1)
    produce(cluster, "late", [b"old"] * 10)
    seen: list = []
    q = (spark.readStream.format("kera").options(**opts(cluster, "late")).load()
         .writeStream.foreachBatch(lambda df, _: seen.extend(r.value for r in df.collect()))
         .option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="200 milliseconds").start())
    try:
        wait_for(lambda: q.lastProgress is not None, what="the first micro-batch")
        produce(cluster, "late", [b"new"] * 7, producer_id=100)
        wait_for(lambda: len(seen) >= 7, what="the new records")
    finally:
        q.stop()
    assert seen == [b"new"] * 7


# --------------------------------------------------------------------------- exactly-once sink

def test_streaming_write_stores_every_row_once_through_a_failed_batch(spark, cluster, tmp_path):
    """A write task fails after it has sent some chunks; the query fails, restarts from its
    checkpoint and replays the batch: the sink's producer ids and sequences are the same, so
    the broker drops the chunks it already has and every row is stored exactly once."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    create(cluster, "src", streamlets=2, active_groups=2)
    create(cluster, "dst", streamlets=2, active_groups=2)
    n = 2000
    # Large enough values that the failing UDF cannot run far ahead of the sink: the sink has
    # sent chunks of the task before the failure.
    values = [b"r%05d-" % i + b"." * 2000 for i in range(n)]
    produce(cluster, "src", values, [b"u%d" % (i % 9) for i in range(n)], per_chunk=20)
    marker = tmp_path / "failed-once"
    poison = "r01500-"

    def fail_once(v):
        if v.startswith(poison) and not marker.exists():
            marker.write_text("x")
            raise RuntimeError("injected failure in the middle of a write task")
        return v

    fail = F.udf(fail_once, StringType())
    ck = str(tmp_path / "ck")
    before = sum(s.get("duplicates", 0) for s in broker_stats(cluster))

    def run():
        src = spark.readStream.format("kera").options(**opts(cluster, "src", startingOffsets="earliest")).load()
        out = src.select("key", fail(F.col("value").cast("string")).alias("value"), "timestamp")
        return (out.writeStream.format("kera").options(**opts(cluster, "dst", chunkSizeBytes="16384"))
                .option("checkpointLocation", ck).trigger(availableNow=True).start())

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        q = run()
        with pytest.raises(Exception):
            q.awaitTermination(180)
        assert marker.exists()
        q = run()  # replays the failed batch from the checkpoint
        assert q.awaitTermination(180)
        assert q.exception() is None
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = read_all(spark, cluster, "dst").select("key", "value", "timestamp").collect()
    assert len(got) == n
    assert Counter(r.value for r in got) == Counter(values)
    src_rows = {r.value: r for r in read_all(spark, cluster, "src").collect()}
    assert all(src_rows[r.value].key == r.key and src_rows[r.value].timestamp == r.timestamp for r in got)
    after = sum(s.get("duplicates", 0) for s in broker_stats(cluster))
    assert after > before, "the re-run batch re-sent chunks the broker already had"


def test_batch_write_with_stream_column_and_retried_job(spark, cluster):
    """Rows routed by a `stream` column; running the same write again with the same writeId
    (a re-run job) stores nothing new."""
    create(cluster, "multi-a", streamlets=2)
    create(cluster, "multi-b", streamlets=1)
    rows = [("multi-a" if i % 3 else "multi-b", f"v{i}") for i in range(900)]
    df = spark.createDataFrame(rows, "stream string, value string").repartition(2)
    df = df.sortWithinPartitions("value")  # a deterministic order for each write task
    w = lambda: df.write.format("kera").options(bootstrap=cluster.bootstrap, writeId="job-1").mode("append").save()
    w()
    w()
    for name in ("multi-a", "multi-b"):
        got = [r.value.decode() for r in read_all(spark, cluster, name).collect()]
        assert Counter(got) == Counter(v for s, v in rows if s == name)


# --------------------------------------------------------------------------- example

def test_click_pipeline_example_produces_correct_aggregates(spark, cluster, tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import click_pipeline as ex
    finally:
        sys.path.remove(str(REPO / "examples"))
    ex.create_streams(cluster.bootstrap)
    events = ex.make_events(1500, seed=5)
    ex.produce_clicks(cluster.bootstrap, events)
    q = ex.start_aggregation(spark, cluster.bootstrap, str(tmp_path / "ck"))
    assert q.awaitTermination(180)
    assert q.exception() is None
    want = ex.expected_counts(events)
    assert ex.read_counts(cluster.bootstrap, until=want, timeout_s=60) == want


def test_a_secure_cluster_is_read_and_written_with_the_key_file_option(spark, local_cluster):
    """keyFile on the sink and the source; without it the secure cluster is not reachable,
    and a client key reads only what it was granted."""
    import os
    from kera.net.keys import KEY_FILE_ENV
    secure = local_cluster(brokers=1, secure=True, log_level="WARNING")
    os.environ.pop(KEY_FILE_ENV, None)   # the key comes from the option alone
    admin_key, client_key = str(secure.keys.admin), str(secure.keys.client)
    with Admin(secure.bootstrap, key_file=admin_key) as admin:
        admin.create_stream("sealed", streamlets=2)
        admin.add_acls([["client", "allow", "read", "stream", "sealed", "literal"]])
    rows = [(b"k%d" % i, b"v%d" % i) for i in range(100)]
    (spark.createDataFrame(rows, "key binary, value binary").write.format("kera")
     .options(bootstrap=secure.bootstrap, stream="sealed", keyFile=admin_key).mode("append")
     .save())
    base = dict(bootstrap=secure.bootstrap, stream="sealed", timeoutMs="3000")
    got = spark.read.format("kera").options(**base, keyFile=client_key).load()
    assert sorted(bytes(r.value) for r in got.collect()) == sorted(v for _, v in rows)
    with pytest.raises(Exception, match="CURVE|timeout|Timeout"):
        spark.read.format("kera").options(**base).load().collect()


# --------------------------------------------------------------------------- consumer group progress

def committed_by_group(cluster, group) -> dict:
    """{(streamlet, group): offset} the consumer group `group` has committed."""
    described = rpc.call(cluster.bootstrap, "group_describe", {"group": group})[0]
    return {(sl, g): off for _s, sl, pos in described["positions"] for g, off, _ep in pos}


def test_a_streaming_query_commits_its_progress_to_a_group(spark, cluster, tmp_path):
    from pyspark.errors import StreamingQueryException

    from kera import Consumer
    from kera.consumer.membership import positions_from_wire
    create(cluster, "progress", streamlets=3, active_groups=2)
    n = 600
    produce(cluster, "progress", [b"p%05d" % i for i in range(n)],
            [b"k%d" % (i % 7) for i in range(n)])
    seen: list = []

    def run():
        q = (spark.readStream.format("kera")
             .options(**opts(cluster, "progress", startingOffsets="earliest", group="sparkq",
                             maxOffsetsPerTrigger="250"))
             .load().writeStream
             .foreachBatch(lambda df, _: seen.extend(
                 (r.streamlet, r.group, r.offset) for r in df.collect()))
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
        try:
            assert q.awaitTermination(180)
        except StreamingQueryException:
            pass       # the caller looks at q.exception()
        return q

    assert run().exception() is None
    assert len(seen) == n
    consumed = {}
    for sl, g, off in seen:
        consumed[(sl, g)] = max(consumed.get((sl, g), 0), off + 1)
    assert committed_by_group(cluster, "sparkq") == consumed, "the query's end positions"
    described = rpc.call(cluster.bootstrap, "group_describe", {"group": "sparkq"})[0]
    with Consumer(cluster.bootstrap, "progress", streamlets=[]) as c:
        assert sum(c.lag_of(positions_from_wire(described["positions"])).values()) == 0
    # More records: the group shows them as lag until the query (from its checkpoint) reads them.
    produce(cluster, "progress", [b"q%05d" % i for i in range(90)], [b"k%d" % (i % 7) for i in range(90)],
            producer_id=100)
    with Consumer(cluster.bootstrap, "progress", streamlets=[]) as c:
        assert sum(c.lag_of(positions_from_wire(described["positions"])).values()) == 90
    assert run().exception() is None
    assert len(seen) == n + 90
    described = rpc.call(cluster.bootstrap, "group_describe", {"group": "sparkq"})[0]
    with Consumer(cluster.bootstrap, "progress", streamlets=[]) as c:
        assert sum(c.lag_of(positions_from_wire(described["positions"])).values()) == 0
    # A group that kera consumers use is not the query's to write: it fails, loudly.
    produce(cluster, "progress", [b"r%05d" % i for i in range(10)], producer_id=200)
    with Consumer(cluster.bootstrap, "progress", group="sparkq", auto_commit_interval_ms=None) as m:
        wait_for(lambda: m.assignment(), what="the member's assignment")
        q = run()
    assert q.exception() is not None and "GroupNotEmpty" in str(q.exception()), q.exception()


def test_record_headers_reach_spark_rows(spark, cluster):
    from kera import Producer
    create(cluster, "hdr", streamlets=2)
    with Producer(cluster.bootstrap) as p:
        for i in range(20):
            p.send("hdr", b"v%d" % i, key=b"k%d" % i,
                   headers=[("trace", b"t%d" % i), ("n", b"%d" % (i % 3))] if i % 2 else None)
        p.flush()
    got = {bytes(r.value): [(h.key, bytes(h.value)) for h in r.headers]
           for r in read_all(spark, cluster, "hdr").collect()}
    assert got == {b"v%d" % i: ([("trace", b"t%d" % i), ("n", b"%d" % (i % 3))] if i % 2 else [])
                   for i in range(20)}


def test_a_headers_column_is_written_and_rows_copy_back_with_theirs(spark, cluster):
    """The sink stores a `headers` column (Kafka's shape) with each row; rows read from one
    stream are written to another as they are, headers included."""
    create(cluster, "hdr-in", streamlets=2)
    create(cluster, "hdr-out", streamlets=3)
    rows = [(b"k%d" % (i % 5), b"v%d" % i,
             [("trace", b"t%d" % i), ("n", (b"%d" % (i % 3)))] if i % 2 else []) for i in range(40)]
    df = spark.createDataFrame(rows, "key binary, value binary, "
                                     "headers array<struct<key: string, value: binary>>")
    df.write.format("kera").options(**opts(cluster, "hdr-in")).mode("append").save()
    read_all(spark, cluster, "hdr-in").write.format("kera").options(
        **opts(cluster, "hdr-out")).mode("append").save()
    want = {v: h for _, v, h in rows}
    for stream in ("hdr-in", "hdr-out"):
        got = {bytes(r.value): [(h.key, bytes(h.value)) for h in r.headers]
               for r in read_all(spark, cluster, stream).collect()}
        assert got == want, stream
    bad = spark.createDataFrame([(b"v", [1])], "value binary, headers array<int>")
    with pytest.raises(Exception, match="column 'headers' must be"):
        bad.write.format("kera").options(**opts(cluster, "hdr-in")).mode("append").save()


def test_batch_read_starting_and_ending_at_a_time(spark, cluster):
    """startingTimestamp: every streamlet from its first record at or after the time (ms);
    startingOffsetsByTimestamp: per streamlet, the others as startingOffsets says; the ending
    options likewise end before the first record at or after the time."""
    create(cluster, "at-time", streamlets=2, active_groups=1)
    base_ms = 1_800_000_000_000
    keys = [b"k%d" % i for i in range(200)]
    produce(cluster, "at-time", [b"v%d" % i for i in range(200)], keys=keys,
            ts=[(base_ms + i) * 1000 for i in range(200)], per_chunk=30)
    from kera.codec.partitioner import streamlet_for_key
    sl_of = {b"v%d" % i: streamlet_for_key(k, 2) for i, k in enumerate(keys)}

    def values(**more):
        df = read_all(spark, cluster, "at-time", **more)
        return sorted(bytes(r.value) for r in df.select("value").collect())

    assert values(startingTimestamp=str(base_ms + 150)) == sorted(
        b"v%d" % i for i in range(150, 200))
    by_time = json.dumps({"at-time": {"0": base_ms + 120}})
    assert values(startingOffsetsByTimestamp=by_time) == sorted(
        b"v%d" % i for i in range(200) if i >= 120 or sl_of[b"v%d" % i] == 1)
    assert values(startingTimestamp=str(base_ms + 1000)) == []
    assert values(endingTimestamp=str(base_ms + 50)) == sorted(b"v%d" % i for i in range(50))
    assert values(startingTimestamp=str(base_ms + 50), endingTimestamp=str(base_ms + 150)) == \
        sorted(b"v%d" % i for i in range(50, 150))
    end_by_time = json.dumps({"at-time": {"1": base_ms + 100}})
    assert values(endingOffsetsByTimestamp=end_by_time) == sorted(
        b"v%d" % i for i in range(200) if i < 100 or sl_of[b"v%d" % i] == 0)
