"""A real single-broker Kafka cluster round-trips 10,000 messages exactly."""

import time

import pytest
from confluent_kafka import Consumer, Producer

from bench.kafka.cluster import KafkaCluster

pytestmark = pytest.mark.kafka

MESSAGES = 10_000
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with KafkaCluster(tmp_path_factory.mktemp("kafka"), brokers=1, heap="512m") as kafka:
        yield kafka


def _payload(i: int) -> bytes:
    return f"message-{i:05d}-".encode() + bytes([i % 256]) * (i % 100)


def _produce(bootstrap: str, topic: str) -> None:
    errors = []
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all",
                         "enable.idempotence": True, "linger.ms": 5})

    def on_delivery(err, _msg):
        if err is not None:
            errors.append(err)

    for i in range(MESSAGES):
        while True:
            try:
                producer.produce(topic, key=str(i).encode(), value=_payload(i),
                                 on_delivery=on_delivery)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.1)
        producer.poll(0)
    remaining = producer.flush(TIMEOUT_S)
    assert remaining == 0, f"{remaining} messages not delivered within {TIMEOUT_S}s"
    assert errors == []


def _consume(bootstrap: str, topic: str, count: int) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "test-kafka-cluster",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    received = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(received) < count and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=1000, timeout=1.0):
                assert msg.error() is None, msg.error()
                received.append((msg.key(), msg.value()))
        # Anything beyond `count` would be a duplicate: give it a moment to show up.
        received.extend((m.key(), m.value()) for m in consumer.consume(1000, timeout=1.0))
    finally:
        consumer.close()
    return received


def test_produce_and_consume_10k_messages(cluster):
    topic = "roundtrip"
    cluster.create_topic(topic, partitions=1, replication=1, min_insync=1)

    _produce(cluster.bootstrap, topic)
    received = _consume(cluster.bootstrap, topic, MESSAGES)

    expected = [(str(i).encode(), _payload(i)) for i in range(MESSAGES)]
    assert len(received) == MESSAGES
    assert received == expected  # one partition: exact content and order
