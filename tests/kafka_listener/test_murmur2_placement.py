"""A keyed topic written by a Kafka client (kafka-python: murmur2, as Java's client) and by
kera's Producer with partitioner="murmur2": every key's records land in one streamlet, and
the kera Producer's placement of a key is the Kafka client's."""

from __future__ import annotations

import time

from kafkit import WAIT_S, create_topic, kafka_python_producer
from kera.consumer import Consumer
from kera.producer import Producer

KEYS = [b"user-%d" % i for i in range(60)]


def test_kera_murmur2_and_a_kafka_client_put_each_key_in_one_streamlet(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=4)
    producer = kafka_python_producer(kafka_cluster)
    try:
        for key in KEYS:
            producer.send(topic, key=key, value=b"kafka")
        producer.flush(timeout=WAIT_S)
    finally:
        producer.close()
    with Producer(kafka_cluster.bootstrap, partitioner="murmur2") as p:
        p.send_batch(topic, [b"kera"] * len(KEYS), keys=KEYS)
        p.flush()
    where: dict[bytes, set] = {}
    deadline = time.monotonic() + WAIT_S
    with Consumer(kafka_cluster.bootstrap, topic, start="earliest") as c:
        while sum(len(v) for v in where.values()) < 2 * len(KEYS) or len(where) < len(KEYS):
            assert time.monotonic() < deadline, f"read {len(where)} keys"
            r = c.poll(timeout_s=0.2)
            if r is not None:
                where.setdefault(r.key, set()).add((r.streamlet, r.value))
    spread = {k: {sl for sl, _ in v} for k, v in where.items()}
    assert all(len(sls) == 1 for sls in spread.values()), spread
    assert all({v for _, v in where[k]} == {b"kafka", b"kera"} for k in KEYS)
    assert len({next(iter(s)) for s in spread.values()}) == 4   # the keys use every streamlet
