"""Kafka's Java transactional producer (Kafka 4.1.2's jars, bench/kafka/pom.xml) against
kera's Kafka listener: kafka-producer-perf-test with a transactional id commits a transaction
every 100 ms; a confluent-kafka read_committed consumer reads every record once and the
control batches never; kafka-transactions.sh lists the id and describes it CompleteCommit.
Marked `kafka` like the other tests that run Kafka's JVM code; skipped when the classpath
cannot be built."""

from __future__ import annotations

import subprocess

import pytest
from confluent_kafka import Consumer

from kafkit import confluent_config, consume_confluent, create_topic
from test_java_tools import TOOL_TIMEOUT_S, Tools  # (also puts the repository on sys.path)

from bench.kafka.cluster import KafkaClusterError, _java, ensure_jars  # noqa: E402

pytestmark = pytest.mark.kafka

PERF_TEST = "org.apache.kafka.tools.ProducerPerformance"
TRANSACTIONS = "org.apache.kafka.tools.TransactionsCommand"
RECORDS = 500
TRANSACTION_MS = 100


@pytest.fixture(scope="module")
def tools(kafka_cluster, tmp_path_factory) -> Tools:
    try:
        lib_dir, java = ensure_jars(), _java()
    except KafkaClusterError as exc:
        pytest.skip(f"Kafka's Java tools need their classpath (bench/kafka/pom.xml): {exc}")
    return Tools(java, lib_dir, tmp_path_factory.mktemp("java-txn"), kafka_cluster.kafka_bootstrap)


def perf_test(tools: Tools, topic: str, tid: str) -> str:
    """ProducerPerformance's stdout (it takes its bootstrap in --producer-props)."""
    argv = [*tools.cmd, PERF_TEST, "--topic", topic, "--num-records", str(RECORDS),
            "--record-size", "16", "--throughput", "-1", "--transactional-id", tid,
            "--transaction-duration-ms", str(TRANSACTION_MS),
            "--producer-props", f"bootstrap.servers={tools.bootstrap}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc.stdout


def test_java_transactional_producer_and_kafka_transactions_tool(kafka_cluster, tools, topic):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    tid = f"{topic}-java"
    out = perf_test(tools, topic, tid)
    assert f"{RECORDS} records sent" in out, out[-2000:]

    consumer = Consumer(confluent_config(kafka_cluster, group_id=f"{topic}-r",
                                         auto_offset_reset="earliest", enable_auto_commit=False,
                                         isolation_level="read_committed"))
    try:
        consumer.subscribe([topic])
        got = consume_confluent(consumer, RECORDS)
        extra = [m for m in consumer.consume(num_messages=100, timeout=1.5) if m.error() is None]
    finally:
        consumer.close()
    assert not extra and len({(m.partition(), m.offset()) for m in got}) == RECORDS

    listed = tools.run(TRANSACTIONS, "list")
    assert listed.count(tid) == 1, listed
    described = tools.run(TRANSACTIONS, "describe", "--transactional-id", tid)
    assert "CompleteCommit" in described, described
