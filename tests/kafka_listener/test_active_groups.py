"""Topics whose streams have several active groups per streamlet (Q = 2): partition p is slot
p % 2 of streamlet p // 2 (kera.broker.kafka.slots), each with dense offsets. confluent-kafka
produces to and consumes from each partition; kera's Consumer reads the same records at the
same (streamlet, number); kera's Producer writes the partition of its slot; CreatePartitions
adds whole streamlets; DescribeConfigs shows the setting."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from confluent_kafka import Consumer as ConfluentConsumer, Producer as ConfluentProducer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions

from kafkit import (WAIT_S, confluent_config, consume_confluent, create_topic, wait_for,
                    wait_topic_ready)
from kera.consumer import Consumer
from kera.producer import Producer

Q = 2
ACTIVE_GROUPS = {"kera.active.groups": str(Q)}


def _produce(cluster, topic: str, n: int, idempotent: bool, tag: str) -> dict:
    """n records to partitions 0..3 in turn; {value: (partition, offset)} from the reports."""
    reports: list = []
    producer = ConfluentProducer(confluent_config(cluster, linger_ms=5,
                                                  enable_idempotence=idempotent,
                                                  message_timeout_ms=WAIT_S * 1000))
    for i in range(n):
        producer.produce(topic, value=b"%s-%d" % (tag.encode(), i), key=b"k%d" % i,
                         partition=i % (2 * Q),
                         on_delivery=lambda err, msg: reports.append(
                             (err, msg.value(), msg.partition(), msg.offset())))
    assert producer.flush(WAIT_S) == 0
    assert [r for r in reports if r[0] is not None] == []
    return {value: (p, o) for _, value, p, o in reports}


def _consume_all(cluster, topic: str, partitions: int, count: int) -> dict:
    """{value: (partition, offset)} of `count` records read from every partition's start;
    the group's commit of where it stopped is checked too (OffsetCommit, OffsetFetch)."""
    consumer = ConfluentConsumer(confluent_config(cluster, group_id=f"{topic}-g",
                                                  auto_offset_reset="earliest",
                                                  enable_auto_commit=False))
    parts = [TopicPartition(topic, p) for p in range(partitions)]
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        got = consume_confluent(consumer, count)
        extra = consumer.consume(num_messages=10, timeout=0.5)
        consumer.commit(asynchronous=False)
        committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=WAIT_S)}
    finally:
        consumer.close()
    ends = {p: 1 + max((m.offset() for m in got if m.partition() == p), default=-1)
            for p in range(partitions)}
    assert committed == {p: end for p, end in ends.items() if end} | \
        {p: -1001 for p, end in ends.items() if not end}, "each partition's own next offset"
    assert not extra, "a record beyond those produced"
    read = {m.value(): (m.partition(), m.offset()) for m in got}
    assert len(read) == count, "a record read twice"
    return read


def _dense(where: dict) -> None:
    for p in {p for p, _ in where.values()}:
        offsets = sorted(o for q, o in where.values() if q == p)
        assert offsets == list(range(len(offsets))), f"partition {p}: offsets not dense from 0"


def test_kafka_clients_write_and_read_each_streamlet_slot(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2 * Q, replication=2, configs=ACTIVE_GROUPS)
    with kafka_cluster.admin() as admin:
        d = admin.describe_stream(topic)
    assert (d["streamlets"], d["active_groups"]) == (2, Q)
    sent = _produce(kafka_cluster, topic, 100, True, "idem")
    sent.update(_produce(kafka_cluster, topic, 100, False, "anon"))
    assert {p for p, _ in sent.values()} == {0, 1, 2, 3}
    _dense(sent)
    assert _consume_all(kafka_cluster, topic, 2 * Q, len(sent)) == sent
    # kera's Consumer reads the same records: partition p is streamlet p // Q, same number
    got = {}
    deadline = time.monotonic() + WAIT_S
    with Consumer(kafka_cluster.bootstrap, topic, start="earliest",
                  request_timeout_s=10.0) as consumer:
        while len(got) < len(sent):
            assert time.monotonic() < deadline, f"kera read {len(got)} of {len(sent)}"
            r = consumer.poll(timeout_s=0.2)
            if r is not None:
                got[r.value] = (r.streamlet, r.number)
    assert got == {v: (p // Q, o) for v, (p, o) in sent.items()}
    _group_tools_see_each_slot(kafka_cluster, topic, sent)


def _group_tools_see_each_slot(cluster, topic: str, sent: dict) -> None:
    """`kera group describe` and `reset-positions` on the Kafka group, per partition (slot)."""
    group, ends = f"{topic}-g", {}
    for p, o in sent.values():
        ends[p] = max(ends.get(p, 0), o + 1)
    rows = {r["partition"]: r for r in json.loads(_kera(cluster, "group", "describe", group,
                                                        "--json"))["partitions"]}
    assert {p: (r["committed"], r["end"], r["lag"]) for p, r in rows.items()} == \
        {p: (end, end, 0) for p, end in ends.items()}
    _kera(cluster, "group", "reset-positions", group, "--stream", topic, "--to-offset", "3",
          "--execute")
    rows = {r["partition"]: r for r in json.loads(_kera(cluster, "group", "describe", group,
                                                        "--json"))["partitions"]}
    assert {p: r["lag"] for p, r in rows.items()} == {p: end - 3 for p, end in ends.items()}


def _kera(cluster, *args) -> str:
    proc = subprocess.run([sys.executable, "-m", "kera", *args, "--bootstrap", cluster.bootstrap],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_create_partitions_and_configs_of_a_topic_with_active_groups(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2 * Q, replication=2, configs=ACTIVE_GROUPS)
    admin = AdminClient(confluent_config(kafka_cluster))
    [(_, future)] = admin.describe_configs([ConfigResource("topic", topic)]).items()
    configs = future.result(timeout=WAIT_S)
    assert configs["kera.active.groups"].value == str(Q)
    [(_, future)] = admin.create_partitions([NewPartitions(topic, 5)]).items()
    try:
        future.result(timeout=WAIT_S)
        raise AssertionError("5 partitions of a Q=2 topic were accepted")
    except Exception as err:   # KafkaException(INVALID_PARTITIONS)
        assert "multiple of 2" in str(err), err
    [(_, future)] = admin.create_partitions([NewPartitions(topic, 6)]).items()
    future.result(timeout=WAIT_S)
    with kafka_cluster.admin() as kera_admin:
        wait_for(lambda: kera_admin.describe_stream(topic)["streamlets"] == 3,
                 what="3 streamlets")
    wait_topic_ready(kafka_cluster, topic, 6)


def test_kera_producer_writes_the_partition_of_its_slot(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2 * Q, replication=2, configs=ACTIVE_GROUPS)
    expected = {}
    # a kera producer with id i writes slot i % Q of the streamlet: partition streamlet*Q + i % Q
    for pid, streamlets in ((1001, (0, 1)), (1002, (1,))):
        with Producer(kafka_cluster.bootstrap, producer_id=pid, linger_ms=5) as producer:
            for sl in streamlets:
                for i in range(30):
                    value = b"p%d-s%d-%d" % (pid, sl, i)
                    producer.send(topic, value, key=b"k", streamlet=sl)
                    expected[value] = (sl * Q + pid % Q, i)
            producer.flush(timeout=WAIT_S)
    assert _consume_all(kafka_cluster, topic, 2 * Q, len(expected)) == expected
