"""Kafka transactions against kera's Kafka listener, with confluent-kafka (librdkafka): a
transactional producer writes two topics and the input group's offsets, commits one
transaction and aborts another; a read_committed consumer sees only the committed records and
the group's offsets committed with them; a read_uncommitted one sees the aborted records too;
a second producer with the same transactional.id fences the first; and a kera transactional
Producer's aborted records are invisible to a Kafka read_committed consumer."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

import kera

from kafkit import (WAIT_S, confluent_config, consume_confluent, create_topic,
                    kafka_python_producer)

TXN_TIMEOUT_MS = 20_000     # above the clients' socket.timeout.ms (librdkafka requires it)


def txn_producer(cluster, tid: str) -> Producer:
    p = Producer(confluent_config(cluster, transactional_id=tid,
                                  transaction_timeout_ms=TXN_TIMEOUT_MS,
                                  message_timeout_ms=TXN_TIMEOUT_MS - 5000, linger_ms=5))
    p.init_transactions(WAIT_S)
    return p


def read_all(cluster, topics: list[str], isolation: str, count: int, group: str | None = None,
             settle_s: float = 1.5) -> list:
    """Every record of `topics` a consumer of `isolation` reads: `count` of them, then nothing
    more within `settle_s` (the records it must not see had time to arrive)."""
    consumer = Consumer(confluent_config(
        cluster, group_id=group or f"reader-{'-'.join(topics)}-{isolation}",
        auto_offset_reset="earliest", enable_auto_commit=False, isolation_level=isolation,
        session_timeout_ms=10_000))
    try:
        consumer.subscribe(topics)
        got = consume_confluent(consumer, count)
        extra = [m for m in consumer.consume(num_messages=100, timeout=settle_s)
                 if m.error() is None]
    finally:
        consumer.close()
    return [(m.topic(), m.value()) for m in got + extra]


def test_commit_and_abort_across_topics_with_group_offsets(kafka_cluster, topic):
    source, out_a, out_b = f"{topic}-in", f"{topic}-a", f"{topic}-b"
    for name in (source, out_a, out_b):
        create_topic(kafka_cluster, name, partitions=1, replication=2)
    plain = Producer(confluent_config(kafka_cluster))
    for i in range(6):
        plain.produce(source, value=b"in-%d" % i)
    assert plain.flush(WAIT_S) == 0

    group = f"{topic}-g"
    consumer = Consumer(confluent_config(kafka_cluster, group_id=group,
                                         auto_offset_reset="earliest",
                                         enable_auto_commit=False, session_timeout_ms=10_000))
    producer = txn_producer(kafka_cluster, f"{topic}-txn")
    try:
        consumer.subscribe([source])
        inputs = consume_confluent(consumer, 6)
        # Transaction 1: inputs 0-2, committed with the group's offset 3.
        producer.begin_transaction()
        for m in inputs[:3]:
            producer.produce(out_a, value=b"A:" + m.value())
            producer.produce(out_b, value=b"B:" + m.value())
        producer.send_offsets_to_transaction([TopicPartition(source, 0, 3)],
                                             consumer.consumer_group_metadata(), WAIT_S)
        producer.commit_transaction(WAIT_S)
        # Transaction 2: inputs 3-5, aborted with its offset 6.
        producer.begin_transaction()
        for m in inputs[3:]:
            producer.produce(out_a, value=b"A:" + m.value())
            producer.produce(out_b, value=b"B:" + m.value())
        producer.send_offsets_to_transaction([TopicPartition(source, 0, 6)],
                                             consumer.consumer_group_metadata(), WAIT_S)
        producer.flush(WAIT_S)
        producer.abort_transaction(WAIT_S)
        [committed] = consumer.committed([TopicPartition(source, 0)], WAIT_S)
    finally:
        consumer.close()
    assert committed.offset == 3, "the group's offset is the committed transaction's, not the aborted one's"

    want = sorted([(out_a, b"A:in-%d" % i) for i in range(3)] +
                  [(out_b, b"B:in-%d" % i) for i in range(3)])
    assert sorted(read_all(kafka_cluster, [out_a, out_b], "read_committed", 6)) == want
    everything = read_all(kafka_cluster, [out_a, out_b], "read_uncommitted", 12)
    assert sorted(everything) == sorted(want + [(out_a, b"A:in-%d" % i) for i in range(3, 6)]
                                        + [(out_b, b"B:in-%d" % i) for i in range(3, 6)])


def test_open_transaction_held_back_until_commit(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    producer = txn_producer(kafka_cluster, f"{topic}-txn")
    producer.begin_transaction()
    producer.produce(topic, value=b"pending")
    assert producer.flush(WAIT_S) == 0
    consumer = Consumer(confluent_config(kafka_cluster, group_id=f"{topic}-r",
                                         auto_offset_reset="earliest", enable_auto_commit=False,
                                         isolation_level="read_committed"))
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        early = [m for m in consumer.consume(num_messages=10, timeout=1.5) if m.error() is None]
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), WAIT_S)
        producer.commit_transaction(WAIT_S)
        late = consume_confluent(consumer, 1)
        after = consumer.get_watermark_offsets(TopicPartition(topic, 0), WAIT_S)
    finally:
        consumer.close()
    assert early == [], "an open transaction's record was read before its commit"
    # read_committed's latest offset (ListOffsets isolation_level 1) is the LSO: the open
    # record's offset, then past the record and its commit marker.
    assert (low, high) == (0, 0)
    assert after == (0, 2)
    assert [m.value() for m in late] == [b"pending"]


def test_second_instance_fences_the_first(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    tid = f"{topic}-txn"
    first = txn_producer(kafka_cluster, tid)
    first.begin_transaction()
    first.produce(topic, value=b"zombie")
    assert first.flush(WAIT_S) == 0
    second = txn_producer(kafka_cluster, tid)       # aborts what the first left open
    second.begin_transaction()
    second.produce(topic, value=b"live")
    second.commit_transaction(WAIT_S)
    with pytest.raises(KafkaException) as refused:
        first.commit_transaction(WAIT_S)
    assert refused.value.args[0].fatal(), refused.value.args[0]
    assert "fenced" in refused.value.args[0].str().lower()
    assert read_all(kafka_cluster, [topic], "read_committed", 1) == [(topic, b"live")]


def test_kera_producer_aborted_records_invisible_to_kafka_reader(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    producer = kera.Producer(kafka_cluster.bootstrap, transactional_id=f"{topic}-kera")
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(topic, b"kera-aborted", streamlet=0)
        producer.flush()
        producer.abort_transaction()
        producer.begin_transaction()
        producer.send(topic, b"kera-committed", streamlet=0)
        producer.commit_transaction()
    finally:
        producer.close()
    assert read_all(kafka_cluster, [topic], "read_committed", 1) == [(topic, b"kera-committed")]
    assert sorted(read_all(kafka_cluster, [topic], "read_uncommitted", 2)) == \
        [(topic, b"kera-aborted"), (topic, b"kera-committed")]


def test_kafka_python_transactional_producer(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    producer = kafka_python_producer(kafka_cluster, transactional_id=f"{topic}-kp",
                                     transaction_timeout_ms=TXN_TIMEOUT_MS)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i in range(4):
            producer.send(topic, value=b"kept-%d" % i, partition=i % 2)
        producer.commit_transaction()
        producer.begin_transaction()
        for i in range(4):
            producer.send(topic, value=b"dropped-%d" % i, partition=i % 2)
        producer.flush()
        producer.abort_transaction()
    finally:
        producer.close(timeout=5)
    got = read_all(kafka_cluster, [topic], "read_committed", 4)
    assert sorted(v for _, v in got) == [b"kept-%d" % i for i in range(4)]
