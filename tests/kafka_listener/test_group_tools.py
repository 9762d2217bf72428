"""Kafka groups through kera's own tools, and the Kafka APIs that move offsets and starts:
`kera group describe` (lag, members) and `kera group reset-positions` on a Kafka group (refused
while it has members), OffsetDelete (kafka-python), DeleteRecords (kafka-python and
confluent-kafka) and ListOffsets by max timestamp (confluent-kafka), checked record by record
against what real clients read."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from confluent_kafka import Consumer, TopicPartition as CTopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from kafka import TopicPartition
from kafka.errors import GroupSubscribedToTopicError, NoError

from kafkit import (
    confluent_config, consume_confluent, create_topic, kafka_python_admin,
    kafka_python_producer, wait_for, wait_topic_ready)

CLI_TIMEOUT_S = 60
PARTITIONS = 2


def kera_cli(cluster, *args) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "kera", *args, "--bootstrap", cluster.bootstrap],
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


def produce(cluster, topic: str, values: list[bytes], **kw) -> dict[int, list[bytes]]:
    """Send `values` round-robin over the partitions; {partition: values in offset order}."""
    producer = kafka_python_producer(cluster, **kw)
    by_part: dict[int, list[bytes]] = {}
    try:
        for i, v in enumerate(values):
            p = i % PARTITIONS
            producer.send(topic, value=v, partition=p).get(timeout=15)
            by_part.setdefault(p, []).append(v)
    finally:
        producer.close(timeout=10)
    return by_part


def group_consumer(cluster, group: str, topic: str) -> Consumer:
    c = Consumer(confluent_config(cluster, group_id=group, auto_offset_reset="earliest",
                                  enable_auto_commit=False, session_timeout_ms=10_000))
    c.subscribe([topic])
    return c


def committed(cluster, group: str) -> dict[int, int]:
    admin = kafka_python_admin(cluster)
    try:
        got = admin.list_group_offsets({group: None})[group]
    finally:
        admin.close()
    return {tp.partition: meta.offset for tp, meta in got.items()}


def describe_json(cluster, group: str) -> dict:
    code, out = kera_cli(cluster, "group", "describe", group, "--json")
    assert code == 0, out
    return json.loads(out)


def test_kera_group_describes_and_resets_a_kafka_group(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=PARTITIONS)
    first = produce(kafka_cluster, topic, [f"a{i}".encode() for i in range(20)])
    group = f"g-{topic}"
    c = group_consumer(kafka_cluster, group, topic)
    try:
        assert len(consume_confluent(c, 20)) == 20
        c.commit(asynchronous=False)
        later = produce(kafka_cluster, topic, [f"b{i}".encode() for i in range(6)])
        d = describe_json(kafka_cluster, group)
        assert d["state"] == "Stable" and len(d["members"]) == 1
        rows = {r["partition"]: r for r in d["partitions"]}
        for p in range(PARTITIONS):
            assert (rows[p]["committed"], rows[p]["end"], rows[p]["lag"]) == \
                (len(first[p]), len(first[p]) + len(later[p]), len(later[p]))
            assert rows[p]["member"] == d["members"][0]["member_id"]
        code, out = kera_cli(kafka_cluster, "group", "describe", group)
        assert code == 0 and "LAG" in out and d["members"][0]["member_id"] in out, out
        code, out = kera_cli(kafka_cluster, "group", "reset-positions", group, "--stream",
                             topic, "--to", "earliest", "--execute")
        assert code != 0 and "members" in out and "group_not_empty" in out, out
        assert committed(kafka_cluster, group) == {p: len(first[p]) for p in range(PARTITIONS)}
    finally:
        c.close()   # leaves the group: it is Empty at once
    _resets(kafka_cluster, topic, group, first, later)


def _resets(cluster, topic: str, group: str, first: dict, later: dict) -> None:
    ends = {p: len(first[p]) + len(later[p]) for p in range(PARTITIONS)}
    for args, want in ((["--to", "earliest"], {p: 0 for p in ends}),
                       (["--to", "latest"], ends),
                       (["--to-offset", "3"], {p: 3 for p in ends}),
                       (["--to-offset", "999"], ends)):
        code, out = kera_cli(cluster, "group", "reset-positions", group, "--stream", topic, *args,
                             "--execute")
        assert code == 0, out
        assert committed(cluster, group) == want, args
    code, out = kera_cli(cluster, "group", "reset-positions", group, "--stream", topic,
                         "--to-datetime", str(int(time.time() * 1000) + 3_600_000), "--execute")
    assert code == 0 and committed(cluster, group) == ends, out
    for args, want in ((["--shift-by", "-2"], {p: end - 2 for p, end in ends.items()}),
                       (["--to-current"], {p: end - 2 for p, end in ends.items()}),
                       (["--shift-by", "99"], ends)):
        code, out = kera_cli(cluster, "group", "reset-positions", group, "--stream", topic,
                             *args, "--execute")
        assert code == 0 and committed(cluster, group) == want, (args, out)
    code, out = kera_cli(cluster, "group", "reset-positions", group, "--all-streams",
                         "--to-offset", "4")   # a dry run: prints, changes nothing
    assert code == 0 and committed(cluster, group) == ends, out
    kera_cli(cluster, "group", "reset-positions", group, "--all-streams", "--to-offset", "4",
             "--execute")
    assert describe_json(cluster, group)["state"] == "Empty"
    c = group_consumer(cluster, group, topic)
    try:
        got = consume_confluent(c, sum(ends.values()) - 4 * PARTITIONS)
    finally:
        c.close()
    values = {p: first[p] + later[p] for p in ends}
    for m in got:
        assert m.offset() >= 4 and m.value() == values[m.partition()][m.offset()]
    assert len({(m.partition(), m.offset()) for m in got}) == len(got), "no duplicate"


def test_offset_delete_refuses_a_subscribed_topic_and_forgets_the_others(kafka_cluster, topic):
    other = f"{topic}-other"
    for name in (topic, other):
        create_topic(kafka_cluster, name, partitions=PARTITIONS)
        produce(kafka_cluster, name, [b"x"] * 4)
    group = f"g-{topic}"
    c = group_consumer(kafka_cluster, group, topic)
    admin = kafka_python_admin(kafka_cluster)
    try:
        consume_confluent(c, 4)
        c.commit(asynchronous=False)
        c.commit(offsets=[CTopicPartition(other, 0, 1)], asynchronous=False)
        result = admin.delete_group_offsets(group, [TopicPartition(topic, 0),
                                                    TopicPartition(other, 0)])
        assert result == {TopicPartition(topic, 0): GroupSubscribedToTopicError,
                          TopicPartition(other, 0): NoError}
        assert sorted(committed(kafka_cluster, group)) == [0, 1]
        c.close()
        result = admin.delete_group_offsets(group, [TopicPartition(topic, 0)])
        assert result == {TopicPartition(topic, 0): NoError}
        assert committed(kafka_cluster, group) == {1: 2}
        admin.delete_group_offsets(group, [TopicPartition(topic, 1)])
        with pytest.raises(Exception, match="GroupIdNotFound"):
            admin.delete_group_offsets(group, [TopicPartition(topic, 1)])
    finally:
        admin.close()


def test_delete_records_moves_the_start_by_whole_groups(kafka_cluster, topic):
    # Small groups (one 4 KiB segment each), so that many close as records arrive.
    with kafka_cluster.admin() as admin:
        admin.create_stream(topic, streamlets=1, replication=2, group_segments=1,
                            segment_size_bytes=4096)
    wait_topic_ready(kafka_cluster, topic, 1)
    producer = kafka_python_producer(kafka_cluster, linger_ms=0)
    values = [bytes([65 + i % 26]) * 900 + str(i).encode() for i in range(40)]
    for v in values:
        producer.send(topic, value=v, partition=0).get(timeout=15)
    producer.close(timeout=10)
    admin = kafka_python_admin(kafka_cluster)
    tp = TopicPartition(topic, 0)
    try:
        low = admin.delete_records({tp: 25})[tp]["low_watermark"]
        assert 0 < low <= 25, "groups wholly below 25 went, the one holding 25 stays"
        assert _earliest(admin, tp) == low
        _read_from(kafka_cluster, topic, low, values)
        # To the end: the open group closes; it goes once the partition's numbering is kept
        # by the coordinator (a heartbeat), at a retention pass after: no second request.
        assert admin.delete_records({tp: -1})[tp]["low_watermark"] <= len(values)
        wait_for(lambda: _earliest(admin, tp) == len(values), what="the start to reach the end")
    finally:
        admin.close()
    more = produce_one(kafka_cluster, topic, b"after")
    assert more == len(values), "numbering goes on after the deleted records"
    _read_from(kafka_cluster, topic, len(values), values + [b"after"])


def produce_one(cluster, topic: str, value: bytes) -> int:
    producer = kafka_python_producer(cluster)
    try:
        return producer.send(topic, value=value, partition=0).get(timeout=15).offset
    finally:
        producer.close(timeout=10)


def _earliest(admin, tp) -> int:
    from kafka.admin import OffsetSpec as KOffsetSpec
    return admin.list_partition_offsets({tp: KOffsetSpec.EARLIEST})[tp].offset


def _read_from(cluster, topic: str, low: int, values: list[bytes]) -> None:
    c = Consumer(confluent_config(cluster, group_id=f"r-{topic}-{low}",
                                  auto_offset_reset="earliest", enable_auto_commit=False))
    c.assign([CTopicPartition(topic, 0, -2)])
    try:
        got = consume_confluent(c, len(values) - low)
    finally:
        c.close()
    assert [(m.offset(), m.value()) for m in got] == list(enumerate(values))[low:]


def test_list_offsets_by_max_timestamp_and_delete_records_with_confluent(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1)
    producer = kafka_python_producer(kafka_cluster)
    stamps = [1_000, 5_000, 3_000, 5_000, 2_000]
    for i, ms in enumerate(stamps):
        producer.send(topic, value=str(i).encode(), partition=0, timestamp_ms=ms).get(timeout=15)
    producer.close(timeout=10)
    admin = AdminClient(confluent_config(kafka_cluster))
    tp = CTopicPartition(topic, 0)
    got = admin.list_offsets({tp: OffsetSpec.max_timestamp()},
                             request_timeout=15)[tp].result(timeout=30)
    assert (got.offset, got.timestamp) == (1, 5_000), "the first record with the largest"
    deleted = admin.delete_records([CTopicPartition(topic, 0, 2)],
                                   request_timeout=15)[tp].result(timeout=30)
    # One group holds all five records: nothing is wholly below 2, the start stays at 0.
    assert deleted.low_watermark == 0
