"""A broker killed -9 under a Kafka idempotent producer: the partitions it led move to the other
broker, the client follows them (NOT_LEADER_OR_FOLLOWER, a metadata refresh), and every
acknowledged record is read exactly once afterwards (R=2: the broker and one backup)."""

from __future__ import annotations

import collections

from kafka import TopicPartition

from kafkit import (CLIENT_TIMEOUT_MS, create_topic, kafka_python_consumer,
                    kafka_python_producer, wait_for)

RECORDS = 2_000
FAILOVER_S = 60.0


def test_kafka_idempotent_producer_loses_and_doubles_nothing_when_a_leader_is_killed(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=1, kafka_port=0, heartbeat_interval_ms=100,
                            log_level="INFO")
    topic = "failover"
    create_topic(cluster, topic, partitions=2, replication=2)
    with cluster.admin() as admin:
        placement = admin.describe_stream(topic)["placement"]
    victim = placement[0]
    assert sorted(placement) == [0, 1], "each broker leads one partition"

    producer = kafka_python_producer(cluster, request_timeout_ms=5_000, linger_ms=5,
                                     delivery_timeout_ms=int(FAILOVER_S * 1000),
                                     max_block_ms=int(FAILOVER_S * 1000))
    assert producer.config["enable_idempotence"] and producer.config["acks"] == -1
    futures = []
    try:
        # Several acknowledged batches per partition first (Kafka sequences count records:
        # the broker taking a partition over must carry on from the last batch's)...
        for i in range(RECORDS // 5):
            futures.append(producer.send(topic, value=b"%d" % i, partition=i % 2))
            if i % 50 == 49:
                producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
        # ... then the leader of partition 0 killed with records in flight and queued.
        for i in range(RECORDS // 5, RECORDS // 2):
            futures.append(producer.send(topic, value=b"%d" % i, partition=i % 2))
        wait_for(lambda: sum(f.succeeded() for f in futures) >= RECORDS // 4, 30,
                 "a quarter of the records acknowledged")
        cluster.kill_broker(victim)
        for i in range(RECORDS // 2, RECORDS):
            futures.append(producer.send(topic, value=b"%d" % i, partition=i % 2))
        producer.flush(timeout=FAILOVER_S)
    finally:
        producer.close(timeout=10)

    failed = [(i, f.exception) for i, f in enumerate(futures) if f.failed()]
    acked = {b"%d" % i for i, f in enumerate(futures) if f.succeeded()}
    consumer = kafka_python_consumer(cluster, request_timeout_ms=CLIENT_TIMEOUT_MS + 5000)
    read: list[tuple[int, int, bytes]] = []
    try:
        parts = [TopicPartition(topic, p) for p in (0, 1)]
        consumer.assign(parts)
        consumer.seek_to_beginning()
        end = consumer.end_offsets(parts, timeout_ms=CLIENT_TIMEOUT_MS)

        def at_end() -> bool:
            for records in consumer.poll(timeout_ms=200).values():
                read.extend((r.partition, r.offset, r.value) for r in records)
            return all(consumer.position(tp) >= end[tp] for tp in parts)
        wait_for(at_end, 30, f"the consumer to read up to {end}")
        for records in consumer.poll(timeout_ms=500).values():
            read.extend((r.partition, r.offset, r.value) for r in records)
    finally:
        consumer.close()
    values = [v for _, _, v in read]
    lost = sorted(acked - set(values), key=int)
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {lost[:5]}"
    doubled = sorted((v for v, n in collections.Counter(values).items() if n > 1), key=int)
    assert not doubled, f"{len(doubled)} records stored twice, e.g. {doubled[:5]}"
    # With idempotence and retries a Kafka producer delivers every record across a failover.
    assert not failed, f"{len(failed)} records not delivered, first: {failed[:3]}"
    assert len(values) == RECORDS
    with cluster.admin() as admin:
        assert admin.describe_stream(topic)["placement"][0] != victim, "partition 0 did not move"
    for p in (0, 1):
        mine = [(o, int(v)) for q, o, v in read if q == p]
        assert [o for o, _ in mine] == list(range(len(mine))), f"partition {p}: offsets not dense"
        assert [n for _, n in mine] == sorted(n for _, n in mine), \
            f"partition {p}: records not in the order sent"
