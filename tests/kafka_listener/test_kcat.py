"""kcat (Debian's package, librdkafka underneath) against kera's Kafka listener: keyed records
with headers produced with `kcat -P -K: -H`, read back exactly with `kcat -C -e`, and `kcat -L`
listing the topic, its partitions' leaders and both brokers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kafkit import create_topic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/debian.py
from debian import install_if_missing  # noqa: E402

KCAT_TIMEOUT_S = 60          # one kcat run, metadata and delivery included
METADATA_S = "15"            # kcat's -m: its own metadata/request timeout


@pytest.fixture(scope="module")
def kcat() -> str:
    if shutil.which("apt-get") is None and shutil.which("kcat") is None:
        pytest.skip("kcat is not installed and apt-get is unavailable to install it")
    path, why = install_if_missing("kcat", lambda: shutil.which("kcat"))
    if path is None:
        pytest.fail(why)        # apt is there (CI's Debian machine): not having kcat is a failure
    return path


def run_kcat(kcat: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([kcat, *args], input=stdin, capture_output=True, text=True,
                          timeout=KCAT_TIMEOUT_S)
    assert done.returncode == 0, f"kcat {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done


def produce(kcat: str, cluster, topic: str, lines: list[str], headers: list[str]) -> None:
    """`key:value` lines through `kcat -P -K:`, every record with `headers` (h=v each)."""
    args = ["-b", cluster.kafka_bootstrap, "-P", "-t", topic, "-K:", "-m", METADATA_S,
            "-X", "message.timeout.ms=30000", "-X", "acks=all"]
    for h in headers:
        args += ["-H", h]
    done = run_kcat(kcat, *args, stdin="".join(line + "\n" for line in lines))
    # kcat reports undelivered messages on stderr (and may still exit 0).
    assert "fail" not in done.stderr.lower() and "error" not in done.stderr.lower(), done.stderr


def consume(kcat: str, cluster, topic: str, fmt: str) -> list[str]:
    done = run_kcat(kcat, "-b", cluster.kafka_bootstrap, "-C", "-t", topic, "-o", "beginning",
                    "-e", "-m", METADATA_S, "-f", fmt)
    assert "error" not in done.stderr.lower(), done.stderr
    return done.stdout.splitlines()


def test_keyed_records_with_headers_round_trip(kafka_cluster, topic, kcat):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    # Three kcat runs, each with its own headers (kcat puts -H on every record of a run).
    runs = [
        ([f"k{i}:value-{i}" for i in range(40)], ["h=v"]),
        ([f"k{i % 7}:second-{i}" for i in range(25)], ["h=w", "trace=abc-123"]),
        (["colon:v:with:colons", "sp ace:v with spaces"], ["h=x"]),
    ]
    expected: list[str] = []
    for lines, headers in runs:
        produce(kcat, kafka_cluster, topic, lines, headers)
        for line in lines:
            key, _, value = line.partition(":")
            expected.append(f"{key} {value} {','.join(headers)}")

    got = consume(kcat, kafka_cluster, topic, "%k %s %h\\n")
    assert Counter(got) == Counter(expected)
    assert len(got) == 67

    # Partition by partition: offsets dense from 0, records in the order they were produced.
    placed = consume(kcat, kafka_cluster, topic, "%p %o %k %s\\n")
    assert len(placed) == len(expected)
    produced_order = [line.replace(":", " ", 1) for lines, _ in runs for line in lines]
    by_partition: dict[int, list[tuple[int, str]]] = {}
    for row in placed:
        p, o, rest = row.split(" ", 2)
        by_partition.setdefault(int(p), []).append((int(o), rest))
    assert set(by_partition) <= {0, 1}
    for p, rows in by_partition.items():
        assert [o for o, _ in rows] == list(range(len(rows))), f"partition {p} offsets"
        records = [r for _, r in rows]
        assert records == [r for r in produced_order if r in set(records)], \
            f"partition {p} out of produced order"
    # One key, one partition.
    key_partitions: dict[str, set[int]] = {}
    for p, rows in by_partition.items():
        for _, r in rows:
            key_partitions.setdefault(r.split(" ", 1)[0], set()).add(p)
    assert all(len(ps) == 1 for ps in key_partitions.values()), key_partitions


def test_metadata_lists_topic_and_both_brokers(kafka_cluster, topic, kcat):
    create_topic(kafka_cluster, topic, partitions=3, replication=2)
    text = run_kcat(kcat, "-b", kafka_cluster.kafka_bootstrap, "-L", "-m", METADATA_S).stdout
    assert re.search(r"^ 2 brokers:$", text, re.M), text
    listed = set(re.findall(r"^\s+broker (\d+) at (\S+)", text, re.M))
    assert {address for _, address in listed} == set(kafka_cluster.kafka_addresses), text
    assert len({broker for broker, _ in listed}) == 2, text
    assert f'topic "{topic}" with 3 partitions:' in text, text

    # The same as JSON, for exact partition-leader checks.
    meta = json.loads(run_kcat(kcat, "-b", kafka_cluster.kafka_bootstrap, "-L", "-J",
                               "-t", topic, "-m", METADATA_S).stdout)
    brokers = {b["id"]: b["name"] for b in meta["brokers"]}
    assert sorted(brokers.values()) == sorted(kafka_cluster.kafka_addresses)
    [t] = meta["topics"]
    assert t["topic"] == topic and "error" not in t, t
    assert sorted(p["partition"] for p in t["partitions"]) == [0, 1, 2]
    for p in t["partitions"]:
        assert p["leader"] in brokers, p
        assert "error" not in p, p
        assert [r["id"] for r in p["replicas"]] == [p["leader"]], p
        assert [r["id"] for r in p["isrs"]] == [p["leader"]], p
