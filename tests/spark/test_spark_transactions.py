"""The kera Spark source reads transactional streams as Spark's Kafka source does with
read_committed: a committed transaction's rows appear, an aborted one's never do, and an open
transaction neither shows nor holds a batch back until it times out: the source's latest
offset of a streamlet stops at its last stable position (issue 39)."""

from __future__ import annotations

import time

import pytest

from kera.client.admin import Admin
from kera.producer import Producer

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

# Far longer than the test: a read that waited for the open transaction to time out would
# hit the pytest timeout instead of passing.
OPEN_TXN_TIMEOUT_MS = 600_000
ROWS = 20


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=0)


def transaction(cluster, txn_id: str, stream: str, tag: str):
    """A transactional producer with an open transaction of ROWS records `tag-i`."""
    p = Producer(cluster.bootstrap, transactional_id=txn_id,
                 transaction_timeout_ms=OPEN_TXN_TIMEOUT_MS)
    p.init_transactions()
    p.begin_transaction()
    for i in range(ROWS):
        p.send(stream, f"{tag}-{i}".encode(), key=f"k{i}".encode())
    p.flush()
    return p


def values(spark, cluster, stream) -> list[str]:
    df = spark.read.format("kera").option("bootstrap", cluster.bootstrap) \
        .option("stream", stream).load()
    return sorted(bytes(r.value).decode() for r in df.select("value").collect())


def test_a_batch_read_has_committed_rows_only_and_is_not_held_by_an_open_transaction(
        spark, cluster):
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream("txn-spark", streamlets=2)
    committed = transaction(cluster, "spark-a", "txn-spark", "committed")
    committed.commit_transaction()
    aborted = transaction(cluster, "spark-b", "txn-spark", "aborted")
    aborted.abort_transaction()
    opened = transaction(cluster, "spark-c", "txn-spark", "open")   # left open
    try:
        started = time.monotonic()
        assert values(spark, cluster, "txn-spark") == sorted(f"committed-{i}" for i in range(ROWS))
        took_s = time.monotonic() - started
        opened.commit_transaction()
        assert values(spark, cluster, "txn-spark") == sorted(
            [f"committed-{i}" for i in range(ROWS)] + [f"open-{i}" for i in range(ROWS)])
        print(f"read with a transaction open: {took_s:.1f} s")
    finally:
        for p in (committed, aborted, opened):
            p.close()
