"""kafka-python against kera's Kafka listener, with the client's defaults (idempotent producer,
acks=all): topic admin, produce and consume with keys and headers, acks 0 and 1, offsets by
timestamp (confluent-kafka's too), a fetch inside a batch, topic auto-creation and deletion,
committed offsets with their metadata, and the group admin APIs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from confluent_kafka import Consumer as ConfluentConsumer, TopicPartition as CTopicPartition
from kafka import TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.structs import OffsetAndMetadata

from kafkit import (CLIENT_TIMEOUT_MS, Wire, confluent_config, consume_kafka_python, create_topic,
                    fetch_request, fetched_partition, kafka_python_admin, kafka_python_consumer,
                    kafka_python_producer, metadata_request, record_batches, wait_for)
from kera.producer import Producer

RECORDS = 2_000


def test_admin_produce_and_consume_with_kafka_python_defaults(kafka_cluster, topic):
    admin = kafka_python_admin(kafka_cluster)
    try:
        create_topic(kafka_cluster, topic, partitions=2, replication=2,
                     configs={"retention.ms": "86400000"})
        assert topic in admin.list_topics()
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)],
                                         config_filter="all")
        entries = configs["topic"][topic]
        assert entries["retention.ms"]["value"] == "86400000", entries
        assert entries["cleanup.policy"]["value"] == "delete"
        assert int(entries["max.message.bytes"]["value"]) > 0
        described = admin.describe_topics([topic])
        assert [len(t["partitions"]) for t in described] == [2]
    finally:
        admin.close()

    producer = kafka_python_producer(kafka_cluster)
    assert producer.config["enable_idempotence"] and producer.config["acks"] == -1
    sent = {}
    try:
        futures = []
        for i in range(RECORDS):
            key, value = b"key-%d" % (i % 97), b"value-%d" % i
            headers = [("i", str(i).encode()), ("bin", bytes([i % 256, 0, 255]))]
            futures.append((key, value, headers, producer.send(topic, value=value, key=key,
                                                               headers=headers)))
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
        for key, value, headers, future in futures:
            md = future.get(timeout=CLIENT_TIMEOUT_MS / 1000)
            sent[(md.partition, md.offset)] = (key, value, headers, md.timestamp)
    finally:
        producer.close(timeout=10)
    assert len(sent) == RECORDS, "two records acknowledged at one offset"

    consumer = kafka_python_consumer(kafka_cluster, topic)
    try:
        got = consume_kafka_python(consumer, RECORDS)
        extra = consumer.poll(timeout_ms=1000)
    finally:
        consumer.close()
    assert not any(extra.values()), "records read beyond those produced"
    read = {(r.partition, r.offset): (r.key, r.value, list(r.headers), r.timestamp) for r in got}
    assert len(read) == len(got) == RECORDS, "a record was read twice"
    assert read == sent
    for p in (0, 1):
        offsets = sorted(o for part, o in read if part == p)
        assert offsets == list(range(len(offsets))), f"partition {p}: offsets not dense from 0"
        assert offsets, f"partition {p} got no record: keys spread over both partitions"


@pytest.mark.parametrize("acks", [0, 1])
def test_produce_with_acks_0_and_1(kafka_cluster, topic, acks):
    """acks=0 gets no response (Kafka's rule: the client does not read one) and acks=1 one
    per request; with either every record is stored once, in order, after the flush."""
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    producer = kafka_python_producer(kafka_cluster, acks=acks, enable_idempotence=False,
                                     linger_ms=2)
    try:
        futures = [producer.send(topic, value=b"%d" % i, partition=0) for i in range(500)]
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
        offsets = [f.get(timeout=5).offset for f in futures]
        # The connection still answers what follows the unanswered requests, in order.
        after = producer.send(topic, value=b"last", partition=0).get(
            timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)
    if acks == 1:
        assert offsets == list(range(500)) and after.offset == 500
    consumer = kafka_python_consumer(kafka_cluster, topic)
    try:
        got = consume_kafka_python(consumer, 501)
        extra = consumer.poll(timeout_ms=500)
    finally:
        consumer.close()
    assert not any(extra.values())
    assert [(r.offset, r.value) for r in got] == \
        list(enumerate([b"%d" % i for i in range(500)] + [b"last"]))


def test_offsets_for_times_earliest_and_latest(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    base = int(time.time() * 1000) - 60_000
    first = [base + i for i in range(100)]                  # batch 1: base .. base+99
    second = [base + 10_000 + 10 * i for i in range(100)]   # batch 2: base+10000, +10010, ...
    stamps = first + second
    producer = kafka_python_producer(kafka_cluster, linger_ms=50)
    try:
        for batch in (first, second):
            for ts in batch:
                producer.send(topic, value=b"%d" % ts, timestamp_ms=ts, partition=0)
            producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)

    tp = TopicPartition(topic, 0)
    # time asked (after base) -> the offset expected: the first record at or after it (None:
    # no record is); base+500 lies between the two batches.
    cases = {-1: 0, 0: 0, 50: 50, 500: 100, 10_000: 100, 10_005: 101, 10_990: 199,
             10_991: None}
    consumer = kafka_python_consumer(kafka_cluster)
    try:
        found = {at: consumer.offsets_for_times({tp: base + at}, timeout_ms=CLIENT_TIMEOUT_MS)[tp]
                 for at in cases}
        begin = consumer.beginning_offsets([tp], timeout_ms=CLIENT_TIMEOUT_MS)
        end = consumer.end_offsets([tp], timeout_ms=CLIENT_TIMEOUT_MS)
    finally:
        consumer.close()
    confluent = ConfluentConsumer(confluent_config(kafka_cluster, group_id=f"{topic}-unused"))
    try:
        answered = [tpo for at in cases for tpo in confluent.offsets_for_times(
            [CTopicPartition(topic, 0, base + at)], timeout=CLIENT_TIMEOUT_MS / 1000)]
        watermarks = confluent.get_watermark_offsets(CTopicPartition(topic, 0),
                                                     timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        confluent.close()

    assert {at: f and f.offset for at, f in found.items()} == cases
    assert [(tpo.error, tpo.offset) for tpo in answered] == \
        [(None, -1 if want is None else want) for want in cases.values()]
    assert (begin, end) == ({tp: 0}, {tp: 200})      # ListOffsets -2 and -1
    assert watermarks == (0, 200)
    # Kafka answers the timestamp of the record found, not the one asked.
    assert {at: f.timestamp - base for at, f in found.items() if f} == \
        {at: stamps[want] - base for at, want in cases.items() if want is not None}


@pytest.mark.parametrize("writer", ["kafka-client", "kera-producer"])
def test_fetch_at_an_offset_inside_a_batch_returns_that_batch(kafka_cluster, topic, writer):
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    values = [b"record-%d" % i for i in range(10)]
    if writer == "kafka-client":
        producer = kafka_python_producer(kafka_cluster, linger_ms=1000, batch_size=1 << 20)
        try:
            futures = [producer.send(topic, value=v, partition=0) for v in values]
            producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
            assert [f.get(timeout=5).offset for f in futures] == list(range(10))
        finally:
            producer.close(timeout=10)
    else:
        with Producer(kafka_cluster.bootstrap, linger_ms=1000) as producer:
            producer.send_batch(topic, values)
            producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)

    # On the wire: a fetch at offset 5 gets the whole batch holding it, from offset 0.
    leader = _leader_address(kafka_cluster, topic, 0)
    with Wire(leader) as wire:
        reply = wire.request(fetch_request(topic, 0, 5))
    part = fetched_partition(reply)
    assert (part.error_code, part.high_watermark) == (0, 10)
    batches = record_batches(part.records)
    assert batches and batches[0]["base_offset"] <= 5 <= batches[0]["last_offset"], batches
    assert batches == [{"base_offset": 0, "last_offset": 9, "codec": 0, "count": 10}], \
        "the ten records were sent as one batch and are served as one"

    consumer = kafka_python_consumer(kafka_cluster)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 5)
        got = consume_kafka_python(consumer, 5)
        extra = consumer.poll(timeout_ms=500)
    finally:
        consumer.close()
    assert not any(extra.values())
    assert [(r.offset, r.value) for r in got] == list(zip(range(5, 10), values[5:]))


def _leader_address(cluster, topic: str, partition: int) -> str:
    with Wire(cluster.kafka_addresses[0]) as wire:

        reply = wire.request(metadata_request([topic]))
    nodes = {b.node_id: f"{b.host}:{b.port}" for b in reply.brokers}
    [t] = reply.topics
    return nodes[t.partitions[partition].leader_id]


def test_produce_to_an_unknown_topic_creates_it_and_delete_topics_removes_it(kafka_cluster,
                                                                             topic):
    admin = kafka_python_admin(kafka_cluster)
    try:
        assert topic not in admin.list_topics()
        producer = kafka_python_producer(kafka_cluster)
        try:
            md = producer.send(topic, key=b"k", value=b"first").get(
                timeout=CLIENT_TIMEOUT_MS / 1000)
        finally:
            producer.close(timeout=10)
        assert md.offset == 0
        wait_for(lambda: topic in admin.list_topics(), 10, "the topic in every broker's Metadata")
        consumer = kafka_python_consumer(kafka_cluster, topic)
        try:
            [record] = consume_kafka_python(consumer, 1)
        finally:
            consumer.close()
        assert (record.key, record.value) == (b"k", b"first")

        reply = admin.delete_topics([topic], timeout_ms=CLIENT_TIMEOUT_MS)
        assert _deleted(reply) == [(topic, 0)], reply
        wait_for(lambda: topic not in admin.list_topics(), 10, "the topic gone from Metadata")
    finally:
        admin.close()
    with kafka_cluster.admin() as kera_admin:
        assert topic not in [s["name"] for s in kera_admin.list_streams()]


def _deleted(reply) -> list[tuple]:
    """(name, error code) of each topic of kafka-python's DeleteTopics result."""
    return [(r["name"], r["error_code"]) for r in reply["topics"]]


def test_offset_commit_keeps_its_metadata_string(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    group = f"{topic}-group"
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = kafka_python_consumer(kafka_cluster, group_id=group)
    try:
        consumer.assign([tp0, tp1])
        consumer.commit({tp0: OffsetAndMetadata(7, "meta", -1),
                         tp1: OffsetAndMetadata(0, "", -1)})
        committed = consumer.committed(tp0, metadata=True, timeout_ms=CLIENT_TIMEOUT_MS)
        assert (committed.offset, committed.metadata) == (7, "meta")
        assert consumer.committed(tp1, timeout_ms=CLIENT_TIMEOUT_MS) == 0
    finally:
        consumer.close()
    admin = kafka_python_admin(kafka_cluster)
    try:
        offsets = admin.list_group_offsets({group: None})[group]
    finally:
        admin.close()
    assert {tp: (o.offset, o.metadata) for tp, o in offsets.items()} == {
        tp0: (7, "meta"), tp1: (0, "")}
    # kera's own tools see the Kafka group and its commits (the coordinator keeps them)
    listed = _kera(kafka_cluster, "group", "list", "--json")
    assert {"group": group, "protocol": "kafka", "parts_committed": 2}.items() <= \
        next(g for g in listed if g["group"] == group).items()
    described = _kera(kafka_cluster, "group", "describe", group, "--json")
    assert described["offsets"] == [[topic, 0, 7, "meta"], [topic, 1, 0, ""]]


def _kera(cluster, *argv: str):
    proc = subprocess.run([sys.executable, "-m", "kera", *argv, "--bootstrap", cluster.bootstrap],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_group_admin_lists_describes_and_deletes_a_group(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    producer = kafka_python_producer(kafka_cluster)
    try:
        for i in range(10):
            producer.send(topic, value=b"%d" % i, partition=i % 2)
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)
    group = f"{topic}-group"
    admin = kafka_python_admin(kafka_cluster)
    consumer = kafka_python_consumer(kafka_cluster, topic, group_id=group)
    try:
        consume_kafka_python(consumer, 10)
        consumer.commit()
        listed = [g for g in admin.list_groups() if g["group_id"] == group]
        # Each broker lists the groups it coordinates, so a group is listed once.
        assert [(g["group_id"], g["group_state"]) for g in listed] == [(group, "Stable")], listed
        described = admin.describe_groups([group])[group]
        assert described["group_state"] == "Stable" and len(described["members"]) == 1
        [member] = described["members"]
        assert member["member_assignment"]["assigned_partitions"] == [
            {"topic": topic, "partitions": [0, 1]}]
        offsets = admin.list_group_offsets({group: None})[group]
        assert {tp.partition: o.offset for tp, o in offsets.items()} == {0: 5, 1: 5}
    finally:
        consumer.close()
    try:
        wait_for(lambda: admin.describe_groups([group])[group]["group_state"] == "Empty", 10,
                 "the group empty once its member left")
        assert admin.delete_groups([group]) == {group: "OK"}
        assert group not in [g["group_id"] for g in admin.list_groups()]
        assert admin.list_group_offsets({group: None})[group] == {}
    finally:
        admin.close()
