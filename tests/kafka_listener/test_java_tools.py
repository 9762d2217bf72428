"""Kafka's own Java tools (Kafka 4.1.2's jars, bench/kafka/pom.xml) against a kera cluster's
Kafka port: kafka-topics (TopicCommand) --create/--describe/--list, the console producer and
the console consumer with a group, kafka-consumer-groups (ConsumerGroupCommand) --describe
with lag and --reset-offsets --to-earliest --execute (refused while the group has a member),
and GetOffsetShell --time -3 (ListOffsets by max timestamp). Every record is checked: key,
value, partition, offset.

Each tool is a JVM (about a second each here, C1 only and a small heap): the steps are grouped
into two tests. Marked `kafka` like the other tests that run Kafka's JVM code; skipped only
when the classpath cannot be built (no java or Maven).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:     # `bench` importable under any rootdir
    sys.path.insert(0, str(REPO_ROOT))

from bench.kafka.cluster import (  # noqa: E402
    JVM_TOOL_OPTS, LOG4J_CONFIG, KafkaClusterError, _java, ensure_jars)
from kafkit import create_topic, kafka_python_admin, kafka_python_producer, wait_for  # noqa: E402

pytestmark = pytest.mark.kafka

TOPIC_COMMAND = "org.apache.kafka.tools.TopicCommand"
CONSOLE_PRODUCER = "org.apache.kafka.tools.ConsoleProducer"
CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
GET_OFFSET_SHELL = "org.apache.kafka.tools.GetOffsetShell"
TOOL_TIMEOUT_S = 120          # one tool JVM, start to exit (a second or two when well)
CONSUMER_WAIT_S = 60          # a console consumer's records, read as they come
RECORDS = 30
LATER = 5


class Tools:
    """Runs Kafka's tool mains on the built classpath against `bootstrap`."""

    def __init__(self, java: str, lib_dir: Path, logs_dir: Path, bootstrap: str):
        self.cmd = [java, *JVM_TOOL_OPTS, f"-Dkafka.logs.dir={logs_dir}",
                    f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", str(lib_dir / "*")]
        self.bootstrap = bootstrap

    def argv(self, main: str, *args: str) -> list[str]:
        return [*self.cmd, main, "--bootstrap-server", self.bootstrap, *args]

    def run(self, main: str, *args: str, stdin: str | None = None) -> str:
        """stdout of a tool that must succeed (its output in the failure otherwise)."""
        proc = subprocess.run(self.argv(main, *args), input=stdin, capture_output=True,
                              text=True, timeout=TOOL_TIMEOUT_S)
        assert proc.returncode == 0, f"{main} {args}: exit {proc.returncode}\n" \
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def output(self, main: str, *args: str) -> str:
        """stdout and stderr of a tool, whatever its exit code."""
        proc = subprocess.run(self.argv(main, *args), capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S)
        return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def tools(kafka_cluster, tmp_path_factory) -> Tools:
    try:
        lib_dir, java = ensure_jars(), _java()
    except KafkaClusterError as exc:
        pytest.skip(f"Kafka's Java tools need their classpath (bench/kafka/pom.xml): {exc}")
    return Tools(java, lib_dir, tmp_path_factory.mktemp("java-tools"),
                 kafka_cluster.kafka_bootstrap)


def test_kafka_topics_creates_describes_and_lists(kafka_cluster, tools, topic):
    out = tools.run(TOPIC_COMMAND, "--create", "--topic", topic, "--partitions", "3",
                    "--replication-factor", "1")
    assert f"Created topic {topic}." in out
    out = tools.run(TOPIC_COMMAND, "--describe", "--topic", topic)
    assert "PartitionCount: 3\tReplicationFactor: 1" in out, out
    with kafka_cluster.admin() as admin:
        placement = admin.describe_stream(topic)["placement"]
    leaders = {}
    for line in out.splitlines():
        fields = dict(f.split(": ", 1) for f in line.strip().split("\t") if ": " in f)
        if "Partition" in fields:
            leaders[int(fields["Partition"])] = fields["Leader"]
            assert fields["Replicas"] == fields["Isr"] == fields["Leader"], line
    assert leaders == {p: str(b) for p, b in enumerate(placement)}
    assert topic in tools.run(TOPIC_COMMAND, "--list").split()


def parse_consumed(line: str) -> tuple[int, int, int, str, str]:
    """(partition, offset, timestamp ms, key, value) of a console consumer line printed with
    print.timestamp, print.partition, print.offset and print.key."""
    labelled, rest = {}, []
    for part in line.split("\t"):
        label, sep, value = part.partition(":")
        if sep and label in ("CreateTime", "Partition", "Offset"):
            labelled[label] = int(value)
        else:
            rest.append(part)
    key, value = rest
    return labelled["Partition"], labelled["Offset"], labelled["CreateTime"], key, value


CONSUMER_ARGS = ("--from-beginning", "--property", "print.key=true", "--property",
                 "print.partition=true", "--property", "print.offset=true", "--property",
                 "print.timestamp=true", "--consumer-property", "auto.commit.interval.ms=100")


def check_consumed(lines: list[str], sent: list[tuple[str, str]]) -> dict[int, list]:
    """Every record sent came once, each partition's offsets dense from 0 in send order;
    returns {partition: [(offset, timestamp, key, value)]}."""
    by_part: dict[int, list] = {}
    for p, off, ts, key, value in map(parse_consumed, lines):
        by_part.setdefault(p, []).append((off, ts, key, value))
    for p, records in by_part.items():
        records.sort()
        assert [r[0] for r in records] == list(range(len(records))), f"partition {p}"
    got = sorted((k, v) for records in by_part.values() for _, _, k, v in records)
    assert got == sorted(sent)
    order = {kv: i for i, kv in enumerate(sent)}
    for records in by_part.values():
        assert [order[(k, v)] for *_, k, v in records] == \
            sorted(order[(k, v)] for *_, k, v in records), "one producer's order per partition"
    return by_part


def test_console_tools_and_consumer_groups(kafka_cluster, tools, topic):
    create_topic(kafka_cluster, topic, partitions=2)
    sent = [(f"k{i}", f"v{i}") for i in range(RECORDS)]
    tools.run(CONSOLE_PRODUCER, "--topic", topic, "--property", "parse.key=true",
              stdin="".join(f"{k}\t{v}\n" for k, v in sent))
    group = f"g-{topic}"
    lines = _while_consuming(kafka_cluster, tools, topic, group)
    by_part = check_consumed(lines, sent)
    later = [(f"later{i}", f"w{i}") for i in range(LATER)]
    ends = _produce_later(kafka_cluster, topic, later, by_part)
    rows = _describe(tools, group)
    assert {p: (r["CURRENT-OFFSET"], r["LOG-END-OFFSET"], r["LAG"]) for p, r in rows.items()} \
        == {p: (str(len(by_part[p])), str(ends[p]), str(ends[p] - len(by_part[p])))
            for p in ends}
    out = tools.run(GROUP_COMMAND, "--reset-offsets", "--to-earliest", "--execute",
                    "--group", group, "--topic", topic)
    assert _committed(kafka_cluster, group) == {p: 0 for p in ends}, out
    again = tools.run(CONSOLE_CONSUMER, "--topic", topic, "--group", group,
                      "--max-messages", str(RECORDS + LATER), "--timeout-ms", "30000",
                      *CONSUMER_ARGS).splitlines()
    everything = check_consumed(again, sent + later)
    _max_timestamps(tools, topic, everything)


def _while_consuming(cluster, tools: Tools, topic: str, group: str) -> list[str]:
    """Read every record with a console consumer in `group`; while it is a member, check that
    kafka-consumer-groups describes it and refuses a reset. Returns its lines."""
    proc = subprocess.Popen(tools.argv(CONSOLE_CONSUMER, "--topic", topic, "--group", group,
                                       *CONSUMER_ARGS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(lines) >= RECORDS, timeout_s=CONSUMER_WAIT_S,
                 what=f"the console consumer's {RECORDS} records")
        wait_for(lambda: sum(_committed(cluster, group).values()) == RECORDS,
                 what="the console consumer's commits")
        rows = _describe(tools, group)
        assert all(r["CONSUMER-ID"] != "-" and r["LAG"] == "0" for r in rows.values()), rows
        refused = tools.output(GROUP_COMMAND, "--reset-offsets", "--to-earliest", "--execute",
                               "--group", group, "--topic", topic)
        assert "inactive" in refused and "Stable" in refused, refused
        assert sum(_committed(cluster, group).values()) == RECORDS
    finally:
        proc.terminate()      # its shutdown hook closes the consumer: it leaves the group
        proc.wait(timeout=TOOL_TIMEOUT_S)
        reader.join(timeout=TOOL_TIMEOUT_S)
    return [line.rstrip("\n") for line in lines]


def _produce_later(cluster, topic: str, later: list, by_part: dict) -> dict[int, int]:
    """Send `later` with kafka-python; each partition's end offset after them."""
    producer = kafka_python_producer(cluster)
    ends = {p: len(records) for p, records in by_part.items()}
    try:
        for k, v in later:
            meta = producer.send(topic, key=k.encode(), value=v.encode()).get(timeout=15)
            ends[meta.partition] = max(ends.get(meta.partition, 0), meta.offset + 1)
    finally:
        producer.close(timeout=10)
    return ends


def _describe(tools: Tools, group: str) -> dict[int, dict]:
    """kafka-consumer-groups --describe's rows by partition, column name to value."""
    out = tools.run(GROUP_COMMAND, "--describe", "--group", group)
    lines = [line.split() for line in out.splitlines() if line.strip()]
    header = next(cols for cols in lines if cols[:2] == ["GROUP", "TOPIC"])
    rows = [dict(zip(header, cols)) for cols in lines
            if cols != header and len(cols) == len(header)]
    return {int(r["PARTITION"]): r for r in rows}


def _committed(cluster, group: str) -> dict[int, int]:
    admin = kafka_python_admin(cluster)
    try:
        got = admin.list_group_offsets({group: None})[group]
    finally:
        admin.close()
    return {tp.partition: meta.offset for tp, meta in got.items()}


def _max_timestamps(tools: Tools, topic: str, by_part: dict[int, list]) -> None:
    """GetOffsetShell --time -3: each partition's first record with its largest timestamp."""
    out = tools.run(GET_OFFSET_SHELL, "--topic", topic, "--time", "-3")
    got = {int(p): int(off) for _, p, off in (line.rsplit(":", 2) for line in out.split())}
    want = {}
    for p, records in by_part.items():
        top = max(ts for _, ts, _, _ in records)
        want[p] = min(off for off, ts, _, _ in records if ts == top)
    assert got == want
