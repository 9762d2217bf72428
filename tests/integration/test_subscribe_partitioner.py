"""Two Kafka-shaped habits against a real local cluster (issue 36 items 8 and 13): a stream's
default partitioner places a kera Producer's keys as Kafka's murmur2 does, and a consumer's
subscribe() / unsubscribe() change what it reads (in a group of two: the group rebalances, the
new stream's records arrive, none of the dropped stream's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from crc32c import crc32c

from kera import Consumer, Producer
from kera.codec.partitioner import murmur2

SETTLE_TIMEOUT_S = 30.0
QUIET_S = 1.0      # how long a consumer must stay silent to show it reads nothing more
STREAMLETS = 5


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=1, log_level="WARNING")


def kafka_streamlet(key: bytes, streamlets: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % streamlets   # Kafka's Utils.toPositive(murmur2) % n


def test_a_murmur2_stream_places_a_producers_keys_as_kafka_does(cluster):
    env = dict(os.environ, KERA_BOOTSTRAP=cluster.bootstrap)
    create = subprocess.run([sys.executable, "-m", "kera", "stream", "create", "keyed",
                             "--streamlets", str(STREAMLETS), "--partitioner", "murmur2"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert create.returncode == 0, create.stderr
    shown = subprocess.run([sys.executable, "-m", "kera", "stream", "describe", "keyed", "--json"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(shown.stdout)["partitioner"] == "murmur2", shown.stderr
    keys = [b"K%d" % i for i in range(30)]
    assert any(kafka_streamlet(k, STREAMLETS) != crc32c(k) % STREAMLETS for k in keys)
    with Producer(cluster.bootstrap) as p:                       # names no partitioner
        default = [p.send("keyed", b"v", key=k) for k in keys]
    with Producer(cluster.bootstrap, partitioner="crc32c") as p:  # an explicit one wins
        explicit = [p.send("keyed", b"v", key=k) for k in keys]
    assert [f.result(10).streamlet for f in default] == [kafka_streamlet(k, STREAMLETS)
                                                        for k in keys]
    assert [f.result(10).streamlet for f in explicit] == [crc32c(k) % STREAMLETS for k in keys]


def produce(cluster, stream: str, start: int, n: int) -> None:
    with Producer(cluster.bootstrap) as p:
        for i in range(start, start + n):
            p.send(stream, b"%d" % i, key=b"%d" % i)


def read(consumers, got: list, count: int) -> None:
    """Poll every consumer in turn until `got` holds `count` (stream, value) pairs, then stay
    polling QUIET_S longer: anything more read is there to fail the caller's comparison."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} records read: {got}"
        for c in consumers:
            r = c.poll(timeout_s=0.05)
            if r is not None:
                got.append((r.stream, int(r.value)))
    quiet_until = time.monotonic() + QUIET_S
    while time.monotonic() < quiet_until:
        for c in consumers:
            r = c.poll(timeout_s=0.05)
            if r is not None:
                got.append((r.stream, int(r.value)))


def until(condition, what: str, consumers=()) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {SETTLE_TIMEOUT_S} s: {what}"
        for c in consumers:          # members rebalance while they poll
            assert c.poll(timeout_s=0.05) is None, "a record read while settling"


def parts(stream: str, n: int = 2) -> set:
    return {(stream, sl) for sl in range(n)}


def test_a_group_of_two_follows_subscribe_and_unsubscribe(cluster):
    with cluster.admin() as admin:
        for name in ("sub-a", "sub-b"):
            admin.create_stream(name, streamlets=2)
    a = Consumer(cluster.bootstrap, "sub-a", group="subs", auto_commit_interval_ms=None)
    b = Consumer(cluster.bootstrap, "sub-a", group="subs", auto_commit_interval_ms=None)
    with a, b:
        produce(cluster, "sub-a", 0, 20)
        got: list = []
        read([a, b], got, 20)
        until(lambda: set(a.assignment()) | set(b.assignment()) == parts("sub-a")
              and a.assignment() and b.assignment(), "one streamlet each", [a, b])
        for c in (a, b):
            c.subscribe(["sub-b"])
        until(lambda: set(a.assignment()) | set(b.assignment()) == parts("sub-b")
              and a.assignment() and b.assignment(), "the group moves to sub-b", [a, b])
        until(lambda: a.lag_of(a.committed(parts("sub-a"))) == dict.fromkeys(parts("sub-a"), 0),
              "the revoked streamlets' positions, committed at their end", [a, b])
        produce(cluster, "sub-a", 20, 20)     # no longer subscribed: never read
        produce(cluster, "sub-b", 100, 20)
        read([a, b], got, 40)
        assert sorted(got) == [("sub-a", i) for i in range(20)] + [("sub-b", i)
                                                                   for i in range(100, 120)]
        b.unsubscribe()
        until(lambda: set(a.assignment()) == parts("sub-b") and not b.assignment(),
              "b holds nothing and a takes both streamlets", [a, b])
        produce(cluster, "sub-b", 200, 10)
        more: list = []
        read([a], more, 10)
        assert sorted(more) == [("sub-b", i) for i in range(200, 210)]
        assert b.poll(timeout_s=0.2) is None and b.assignment() == []


def test_a_consumer_without_a_group_reads_the_streams_it_subscribes_to(cluster):
    with cluster.admin() as admin:
        for name in ("solo-a", "solo-b"):
            admin.create_stream(name, streamlets=2)
    with Consumer(cluster.bootstrap, "solo-a") as c:
        c.subscribe(["solo-b"])
        assert set(c.assignment()) == parts("solo-b")
        produce(cluster, "solo-a", 0, 10)
        produce(cluster, "solo-b", 0, 10)
        got: list = []
        read([c], got, 10)
        assert sorted(got) == [("solo-b", i) for i in range(10)]
        c.unsubscribe()
        assert c.assignment() == [] and c.poll(timeout_s=0.2) is None


def test_a_group_member_made_from_a_config_dict_reads_once_it_subscribes(cluster):
    with cluster.admin() as admin:
        admin.create_stream("late-sub", streamlets=2)
    produce(cluster, "late-sub", 0, 10)
    conf = {"bootstrap.servers": cluster.bootstrap, "group.id": "late",
            "auto.offset.reset": "earliest"}
    with Consumer(conf) as c:                 # confluent-kafka's shape: no stream yet
        assert c.poll(timeout_s=0.2) is None and c.assignment() == []
        c.subscribe(["late-sub"])
        got: list = []
        read([c], got, 10)
    assert sorted(got) == [("late-sub", i) for i in range(10)]
