"""confluent-kafka (librdkafka) against kera's Kafka listener: every compression codec, with
and without idempotence, read back exactly once and in order by a consumer group; a group of
two consumers sharing a topic's partitions, committing, and a third resuming from the
commits."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kafkit import (CLIENT_TIMEOUT_MS, WAIT_S, Wire, confluent_config, consume_confluent,
                    create_topic, fetch_request, fetched_partition, metadata_request,
                    record_batches, wait_for)

CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
RECORDS = 1_500


@pytest.mark.parametrize("idempotence", [True, False], ids=["idempotent", "plain"])
@pytest.mark.parametrize("codec", list(CODECS))
def test_every_codec_delivered_and_read_once_in_order(kafka_cluster, topic, codec, idempotence):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    reports: list = []
    producer = Producer(confluent_config(
        kafka_cluster, compression_type=codec, enable_idempotence=idempotence,
        linger_ms=20, acks="all", message_timeout_ms=WAIT_S * 1000))

    def delivered(err, msg):
        reports.append((err, msg.partition(), msg.offset(), msg.key(), msg.value(), msg.headers()))

    # Compressible values, so a compressed batch is smaller than a plain one.
    values = [b"%06d:" % i + b"abcdefgh" * (i % 20) for i in range(RECORDS)]
    for i, value in enumerate(values):
        producer.produce(topic, value=value, key=b"k%d" % (i % 13),
                         headers=[("seq", b"%d" % i)], on_delivery=delivered)
        if i % 200 == 0:
            producer.poll(0)
    assert producer.flush(WAIT_S) == 0, "records left undelivered"
    errors = [r for r in reports if r[0] is not None]
    assert not errors and len(reports) == RECORDS, errors[:3]
    acked = {(p, o): (k, v) for _, p, o, k, v, _ in reports}
    assert len(acked) == RECORDS, "two records acknowledged at one offset"

    consumer = Consumer(confluent_config(kafka_cluster, group_id=f"{topic}-group",
                                         auto_offset_reset="earliest",
                                         enable_auto_commit=False,
                                         session_timeout_ms=10_000))
    try:
        consumer.subscribe([topic])
        got = consume_confluent(consumer, RECORDS)
        extra = consumer.consume(num_messages=10, timeout=1.0)
    finally:
        consumer.close()
    assert not extra, "records read beyond those produced"
    read = [(m.partition(), m.offset(), m.key(), m.value()) for m in got]
    assert len({(p, o) for p, o, _, _ in read}) == RECORDS, "a record read twice"
    assert {(p, o): (k, v) for p, o, k, v in read} == acked
    assert all(dict(m.headers())["seq"] == b"%d" % int(m.value().split(b":")[0]) for m in got)
    for p in (0, 1):
        in_partition = [(o, int(v.split(b":")[0])) for q, o, _, v in read if q == p]
        assert in_partition, f"partition {p} got nothing"
        assert [o for o, _ in in_partition] == list(range(len(in_partition))), \
            f"partition {p}: offsets not dense from 0, in order"
        sent_order = [n for _, n in in_partition]
        assert sent_order == sorted(sent_order), f"partition {p}: not in the order sent"

    # Batches are kept as produced: compressed ones are served compressed, with their codec.
    served = _served_codecs(kafka_cluster, topic)
    assert served == {CODECS[codec]}, served


def _served_codecs(cluster, topic: str) -> set[int]:
    with Wire(cluster.kafka_addresses[0]) as wire:
        meta = wire.request(metadata_request([topic]))
    nodes = {b.node_id: f"{b.host}:{b.port}" for b in meta.brokers}
    codecs = set()
    for p in meta.topics[0].partitions:
        with Wire(nodes[p.leader_id]) as wire:
            reply = wire.request(fetch_request(topic, p.partition_index, 0, max_bytes=8 << 20))
        part = fetched_partition(reply)
        assert part.error_code == 0
        codecs |= {b["codec"] for b in record_batches(part.records)}
    return codecs


def _group_consumer(cluster, group: str, **kw) -> Consumer:
    return Consumer(confluent_config(cluster, group_id=group, auto_offset_reset="earliest",
                                     enable_auto_commit=False, session_timeout_ms=10_000,
                                     heartbeat_interval_ms=500,
                                     partition_assignment_strategy="range", **kw))


def test_a_group_shares_partitions_commits_and_a_new_member_resumes(kafka_cluster, topic):
    partitions, per_partition = 4, 50
    create_topic(kafka_cluster, topic, partitions=partitions, replication=2)
    producer = Producer(confluent_config(kafka_cluster, linger_ms=5))
    for p in range(partitions):
        for i in range(per_partition):
            producer.produce(topic, value=b"%d-%d" % (p, i), partition=p)
    assert producer.flush(WAIT_S) == 0
    group = f"{topic}-group"

    first, second = _group_consumer(kafka_cluster, group), _group_consumer(kafka_cluster, group)
    consumers = (first, second)
    seen: dict[int, list[tuple[int, bytes]]] = {id(c): [] for c in consumers}
    try:
        for c in consumers:
            c.subscribe([topic])

        def shared() -> bool:
            for c in consumers:
                for m in c.consume(num_messages=5, timeout=0.1):
                    assert m.error() is None, m.error()
                    seen[id(c)].append((m.partition(), m.offset()))
            mine = [{tp.partition for tp in c.assignment()} for c in consumers]
            return all(mine) and not (mine[0] & mine[1]) and \
                mine[0] | mine[1] == set(range(partitions))
        wait_for(shared, WAIT_S, "both members assigned, disjointly, every partition")

        # Each reads from its own partitions a little more, and commits where it is.
        def read_some() -> bool:
            for c in consumers:
                for m in c.consume(num_messages=5, timeout=0.1):
                    assert m.error() is None, m.error()
                    seen[id(c)].append((m.partition(), m.offset()))
            return all(len(v) >= 20 for v in seen.values())
        wait_for(read_some, WAIT_S, "both members to read records")
        for c in consumers:
            c.commit(asynchronous=False)
        committed = {}
        for c in consumers:
            for tp in c.committed(c.assignment(), timeout=CLIENT_TIMEOUT_MS / 1000):
                assert tp.error is None
                if tp.offset >= 0:     # (-1001: nothing read from it, nothing committed)
                    committed[tp.partition] = tp.offset
        positions = {tp.partition: tp.offset
                     for c in consumers for tp in c.position(c.assignment())}
        assert committed == {p: o for p, o in positions.items() if o >= 0} and committed
    finally:
        for c in consumers:
            c.close()

    resumed = _group_consumer(kafka_cluster, group)
    try:
        resumed.subscribe([topic])
        expected = sum(per_partition - committed.get(p, 0) for p in range(partitions))
        got = consume_confluent(resumed, expected)
        extra = resumed.consume(num_messages=10, timeout=1.0)
        again = resumed.committed([TopicPartition(topic, p) for p in committed],
                                  timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        resumed.close()
    assert not extra
    for p in range(partitions):
        offsets = [m.offset() for m in got if m.partition() == p]
        start = committed.get(p, 0)
        assert offsets == list(range(start, per_partition)), \
            f"partition {p}: resumed at {offsets[:1]}, committed {start}"
    assert {tp.partition: tp.offset for tp in again} == committed



def test_admin_client_lists_every_topic(kafka_cluster, topic):
    from confluent_kafka.admin import AdminClient
    create_topic(kafka_cluster, topic, partitions=3)
    listed = AdminClient(confluent_config(kafka_cluster)).list_topics(timeout=10)
    assert topic in listed.topics and len(listed.topics[topic].partitions) == 3
    assert len(listed.brokers) == len(kafka_cluster.brokers)
