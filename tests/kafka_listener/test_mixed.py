"""One set of records for both protocols: what a Kafka client produces (each compression codec)
kera's Consumer reads with the same key, value, headers and millisecond timestamp, at the
Kafka offset as its record number; what kera's Producer sends a Kafka consumer reads the
same way."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer as ConfluentConsumer, Producer as ConfluentProducer

from kafkit import (WAIT_S, confluent_config, consume_confluent, consume_kafka_python,
                    create_topic, kafka_python_consumer)
from kera.consumer import Consumer
from kera.producer import Producer

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]


def records(n: int, base_ms: int) -> list[tuple]:
    """(key, value, headers, timestamp_ms): nulls, empties, binary, repeated header keys."""
    out = []
    for i in range(n):
        key = None if i % 7 == 0 else b"key-%d" % (i % 5)
        value = None if i % 11 == 3 else b"" if i % 11 == 4 else bytes([i % 256]) * (i % 50) + \
            b"value-%d" % i
        headers = [] if i % 3 == 0 else [("h", b"%d" % i), ("h", b""), ("bin", b"\x00\xff")]
        out.append((key, value, headers, base_ms + i))
    return out


def read_kera(cluster, topic: str, count: int) -> list:
    got = []
    deadline = time.monotonic() + WAIT_S
    with Consumer(cluster.bootstrap, topic, start="earliest", request_timeout_s=10.0) as consumer:
        while len(got) < count:
            assert time.monotonic() < deadline, f"kera read {len(got)} of {count} records"
            record = consumer.poll(timeout_s=0.2)
            if record is not None:
                got.append(record)
        extra = consumer.poll(timeout_s=0.5)
    assert extra is None, f"a record beyond those produced: {extra}"
    return got


@pytest.mark.parametrize("codec", CODECS)
def test_kafka_producer_to_kera_consumer(kafka_cluster, topic, codec):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    sent = records(300, int(time.time() * 1000) - 3_600_000)
    reports = []
    producer = ConfluentProducer(confluent_config(kafka_cluster, compression_type=codec,
                                                  linger_ms=20, message_timeout_ms=WAIT_S * 1000))
    for i, (key, value, headers, ts) in enumerate(sent):
        producer.produce(topic, value=value, key=key, headers=headers, timestamp=ts,
                         on_delivery=lambda err, msg, i=i: reports.append(
                             (err, i, msg.partition(), msg.offset())))
    assert producer.flush(WAIT_S) == 0
    assert [r for r in reports if r[0] is not None] == []
    where = {i: (p, o) for _, i, p, o in reports}

    got = read_kera(kafka_cluster, topic, len(sent))
    read = {(r.streamlet, r.number): (r.key, r.value, list(r.headers), r.timestamp_ms)
            for r in got}
    assert len(read) == len(got), "a record read twice"
    assert read == {where[i]: (key, value, headers, ts)
                    for i, (key, value, headers, ts) in enumerate(sent)}


@pytest.mark.parametrize("reader", ["kafka-python", "confluent-kafka"])
def test_kera_producer_to_kafka_consumer(kafka_cluster, topic, reader):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    base_ms = int(time.time() * 1000) - 3_600_000
    sent = records(300, base_ms)
    # and a batch with microsecond timestamps: Kafka gets their millisecond part
    batch_values = [b"batch-%d" % i for i in range(100)]
    batch_us = [(base_ms + 1_000 + i) * 1000 + 999 for i in range(100)]
    with Producer(kafka_cluster.bootstrap, linger_ms=5) as producer:
        for key, value, headers, ts in sent:
            producer.send(topic, value, key=key, headers=headers, timestamp_ms=ts)
        producer.send_batch(topic, batch_values, keys=[b"batch"] * 100, timestamps=batch_us)
        producer.flush(timeout=WAIT_S)
    expected = sorted([(k, v, h, ts) for k, v, h, ts in sent] +
                      [(b"batch", v, [], us // 1000) for v, us in zip(batch_values, batch_us)],
                      key=repr)
    count = len(expected)

    if reader == "kafka-python":
        consumer = kafka_python_consumer(kafka_cluster, topic)
        try:
            got = consume_kafka_python(consumer, count)
            extra = consumer.poll(timeout_ms=500)
        finally:
            consumer.close()
        assert not any(extra.values())
        rows = [(r.partition, r.offset, r.key, r.value, list(r.headers), r.timestamp)
                for r in got]
    else:
        consumer = ConfluentConsumer(confluent_config(kafka_cluster, group_id=f"{topic}-g",
                                                      auto_offset_reset="earliest",
                                                      enable_auto_commit=False))
        try:
            consumer.subscribe([topic])
            got = consume_confluent(consumer, count)
            extra = consumer.consume(num_messages=10, timeout=0.5)
        finally:
            consumer.close()
        assert not extra
        rows = [(m.partition(), m.offset(), m.key(), m.value(), list(m.headers() or []),
                 m.timestamp()[1]) for m in got]
    assert len({(p, o) for p, o, *_ in rows}) == count, "a record read twice"
    assert sorted([(k, v, h, ts) for _, _, k, v, h, ts in rows], key=repr) == expected
    for p in {p for p, *_ in rows}:
        offsets = [o for q, o, *_ in rows if q == p]
        assert offsets == list(range(len(offsets))), f"partition {p}: offsets not dense from 0"
