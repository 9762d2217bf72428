"""A topic created through the Kafka listener (kafka-python's admin client) is a stream whose
default partitioner is murmur2: kera's Producer, naming none, puts each key in the partition
Kafka's clients pick (issue 36 item 13)."""

from __future__ import annotations

from kafkit import create_topic
from kera.client.admin import Admin
from kera.codec.partitioner import murmur2
from kera.producer import Producer

KEYS = [b"user-%d" % i for i in range(40)]
PARTITIONS = 4


def test_a_kafka_created_topic_places_keys_as_kafka_clients_do(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=PARTITIONS)
    with Admin(kafka_cluster.bootstrap) as admin:
        assert admin.describe_stream(topic)["partitioner"] == "murmur2"
    with Producer(kafka_cluster.bootstrap) as p:
        futures = [p.send(topic, b"v", key=k) for k in KEYS]
    assert [f.result(10).streamlet for f in futures] == [
        (murmur2(k) & 0x7FFFFFFF) % PARTITIONS for k in KEYS]   # Kafka's toPositive % n
