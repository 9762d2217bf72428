"""Compacted topics through the Kafka listener (issue 38's first slice, docs/COMPACTION.md):
CreateTopics takes cleanup.policy and the compaction configs, DescribeConfigs shows them, and
a keyless record on a compacted topic is refused as Kafka refuses it (INVALID_RECORD) while
keyed ones are stored and read back; once the broker's passes compacted a topic, a Kafka
consumer reads one record per key at offsets with gaps."""

from __future__ import annotations

import time

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import InvalidConfigurationError, InvalidRecordError

from kafkit import (CLIENT_TIMEOUT_MS, consume_kafka_python, create_topic, kafka_python_admin,
                    kafka_python_consumer, kafka_python_producer)

LONG_MAX = str(2**63 - 1)


def describe(cluster, topic) -> dict:
    admin = kafka_python_admin(cluster)
    try:
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)],
                                         config_filter="all")
    finally:
        admin.close()
    return {k: v["value"] for k, v in configs["topic"][topic].items()}


def test_compacted_topic_configs_and_keyless_refusal(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1, replication=2,
                 configs={"cleanup.policy": "compact", "delete.retention.ms": "1000",
                          "min.cleanable.dirty.ratio": "0.1"})
    shown = describe(kafka_cluster, topic)
    assert (shown["cleanup.policy"], shown["delete.retention.ms"],
            shown["min.cleanable.dirty.ratio"], shown["min.compaction.lag.ms"],
            shown["max.compaction.lag.ms"]) == ("compact", "1000", "0.1", "0", LONG_MAX)

    producer = kafka_python_producer(kafka_cluster)
    try:
        for i in range(20):
            producer.send(topic, key=b"k%d" % (i % 5), value=b"v%d" % i)
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)

    keyless = kafka_python_producer(kafka_cluster, retries=0)
    try:
        future = keyless.send(topic, value=b"no key")
        with pytest.raises(InvalidRecordError):
            future.get(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        keyless.close(timeout=10)

    consumer = kafka_python_consumer(kafka_cluster, topic)
    try:
        got = consume_kafka_python(consumer, 20)
        extra = consumer.poll(timeout_ms=1000)
    finally:
        consumer.close()
    assert not any(extra.values()), "the keyless record was stored"
    assert [(r.offset, r.key, r.value) for r in got] == \
        [(i, b"k%d" % (i % 5), b"v%d" % i) for i in range(20)]


def test_create_topics_refuses_a_bad_policy(kafka_cluster, topic):
    admin = kafka_python_admin(kafka_cluster)
    try:
        with pytest.raises(InvalidConfigurationError,
                           match="cleanup_policy must be one of delete, compact, compact,delete"):
            admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "never"})])
    finally:
        admin.close()


def test_a_kafka_consumer_reads_a_compacted_topic_after_passes(kafka_cluster, topic):
    """Once the broker's passes compacted the topic (docs/COMPACTION.md), a Kafka consumer from
    the beginning gets one record per key, its latest (a tombstone for a deleted key), at
    offsets that are the records' kera numbers, with the gaps between stepped over."""
    from kera import Consumer
    with kafka_cluster.admin() as admin:   # small groups, so that passes run within the test
        admin.create_stream(topic, streamlets=1, replication=2, segment_size_bytes=32 * 1024,
                            group_segments=2, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01)
    latest: dict = {}
    producer = kafka_python_producer(kafka_cluster)
    try:
        for u in range(10):
            for k in range(200):
                key, value = b"k%03d" % k, (None if u == 9 and k % 20 == 0
                                            else b"%d:" % u + b"x" * 80)
                producer.send(topic, key=key, value=value)
                latest[key] = value
        for i in range(1500):   # keys written once: every update lands in a finished group
            producer.send(topic, key=b"pad%04d" % i, value=b"p" * 80)
            latest[b"pad%04d" % i] = b"p" * 80
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)
    deadline = time.monotonic() + 90
    while True:
        with Consumer(kafka_cluster.bootstrap, topic, start="earliest") as c:
            records = []
            while (r := c.poll(timeout_s=1.0)) is not None:
                records.append(r)
        if len(records) == len(latest):   # one per key: compacted
            break
        assert time.monotonic() < deadline, "no pass compacted the topic"
        time.sleep(1.0)
    consumer = kafka_python_consumer(kafka_cluster, topic)
    try:
        got = consume_kafka_python(consumer, len(latest))
        extra = consumer.poll(timeout_ms=1000)
    finally:
        consumer.close()
    assert not any(extra.values())
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    assert [r.offset for r in got] == [r.number for r in records]
