"""Fixtures of the Kafka listener's tests: real kera clusters (LocalCluster with `kafka_port=0`),
driven by real Kafka clients and raw sockets (helpers in kafkit.py).

    def test_x(kafka_cluster, topic):          # module-scoped cluster, a fresh topic name
        producer = kafka_python_producer(kafka_cluster)

`kafka_cluster` is one cluster per module (2 brokers, 1 backup, topics created on first use);
a failing test prints its daemons' log tails. Every client is given timeouts; every wait polls
a condition under a deadline (`kafkit.wait_for`).
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:    # `import kafkit` from the test modules under any rootdir
    sys.path.insert(0, str(HERE))

from kafkit import Wire, metadata_request, wait_for  # noqa: E402

_names = itertools.count()


# ---------------------------------------------------------------------- clusters
@pytest.fixture(scope="module")
def kafka_cluster(local_cluster):
    """One cluster per module: 2 brokers, 1 backup, a Kafka listener on each broker."""
    cluster = local_cluster(brokers=2, backups=1, kafka_port=0, log_level="INFO")
    wait_for(lambda: _all_listeners_known(cluster), what="every broker in Kafka Metadata")
    return cluster


def _all_listeners_known(cluster) -> bool:
    """Whether Metadata (asked of every broker) lists every broker's Kafka address."""
    want = sorted(cluster.kafka_addresses)
    for address in cluster.kafka_addresses:
        try:
            with Wire(address) as wire:
                reply = wire.request(metadata_request(None))
        except OSError:
            return False
        if sorted(f"{b.host}:{b.port}" for b in reply.brokers) != want:
            return False
    return True


@pytest.fixture(autouse=True)
def _brokers_up_and_logs_on_failure(request):
    """Each test starts with every broker of the module's cluster running (one a previous
    test stopped, by a bug it found, is started again), and prints the logs if it fails."""
    if "kafka_cluster" in request.fixturenames:
        cluster = request.getfixturevalue("kafka_cluster")
        stopped = [i for i, d in enumerate(cluster.brokers) if not d.running()]
        for i in stopped:
            cluster.restart_broker(i)
        if stopped:
            wait_for(lambda: _all_listeners_known(cluster), what="every broker in Kafka Metadata")
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    if "kafka_cluster" in request.fixturenames:   # (fresh_cluster prints its own)
        cluster = request.getfixturevalue("kafka_cluster")
        sys.stderr.write(f"\n==== daemon logs of the cluster at {cluster.bootstrap}\n"
                         f"{cluster._tails()}\n")


@pytest.fixture
def topic(request) -> str:
    """A topic name of its own for this test (parametrised tests included)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:150]
    return f"{base}-{next(_names)}"


