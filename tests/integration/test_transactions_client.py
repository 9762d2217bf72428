"""kera's transactional producer and read_committed consumer against a real local cluster
(docs/TRANSACTIONS.md, step 6): a committed transaction's records appear all at once, an
aborted one's never; positions sent to a transaction are the group's exactly when it commits;
a second instance with the same transactional id fences the first; a producer stuck in a
transaction holds read_committed readers back for at most its timeout, then learns it timed
out, aborts and carries on; `kera txn` shows the ids.

Values are `b"<label>-<n>"`: every record read names its transaction.
"""

from __future__ import annotations

import itertools
import json
import time

import pytest

from kera import Consumer, Producer
from kera.coordinator.core import Coordinator
from kera.errors import InvalidTxnState, ProducerFenced, TransactionTimedOut

pytestmark = pytest.mark.skipif(
    "txn_init" not in Coordinator.OPS,
    reason="the coordinator has no txn_init op yet (transactions step 2 not in the tree)")

SETTLE_TIMEOUT_S = 30.0
TIMEOUT_MS_MIN = 1_000          # the shortest transaction timeout the coordinator allows
_names = itertools.count()


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=0, log_level="WARNING")


def new_stream(cluster, streamlets=1) -> str:
    name = f"txn-{next(_names)}"
    with cluster.admin() as admin:
        admin.create_stream(name, streamlets=streamlets)
    return name


def read_values(cluster, stream, until_value: bytes, isolation="read_committed",
                timeout_s=SETTLE_TIMEOUT_S) -> list[bytes]:
    """Every value of `stream` from its start until `until_value` is read."""
    out: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    with Consumer(cluster.bootstrap, stream, start="earliest", isolation_level=isolation) as c:
        while until_value not in out:
            assert time.monotonic() < deadline, f"{until_value!r} not read; read {out[-5:]}"
            r = c.poll(timeout_s=0.1)
            if r is not None:
                out.append(r.value)
    return out


def labelled(label: str, n: int) -> list[bytes]:
    return [f"{label}-{i}".encode() for i in range(n)]


def test_aborted_records_are_never_read_committed_and_committed_ones_all_are(cluster):
    stream = new_stream(cluster)
    with Producer(cluster.bootstrap, transactional_id=f"tid-{stream}") as p:
        p.init_transactions()
        p.begin_transaction()
        p.send_batch(stream, labelled("aborted", 50))
        p.flush()                                   # stored, then aborted
        p.abort_transaction()
        p.begin_transaction()
        for v in labelled("committed", 50):
            p.send(stream, v)
        p.commit_transaction()
    committed = read_values(cluster, stream, b"committed-49")
    assert committed == labelled("committed", 50)
    everything = read_values(cluster, stream, b"committed-49", isolation="read_uncommitted")
    assert everything == labelled("aborted", 50) + labelled("committed", 50)


def test_kafkas_state_errors_come_before_anything_is_sent(cluster):
    stream = new_stream(cluster)
    with Producer(cluster.bootstrap, transactional_id=f"tid-{stream}") as p:
        with pytest.raises(InvalidTxnState, match="init_transactions"):
            p.begin_transaction()
        p.init_transactions()
        with pytest.raises(InvalidTxnState, match="outside a transaction"):
            p.send(stream, b"x")
        with pytest.raises(InvalidTxnState, match="begin_transaction"):
            p.commit_transaction()
        p.begin_transaction()
        with pytest.raises(InvalidTxnState, match="commit_transaction"):
            p.begin_transaction()
        p.commit_transaction()                     # an empty transaction commits


def test_positions_join_the_group_exactly_when_the_transaction_commits(cluster):
    source, sink = new_stream(cluster), new_stream(cluster)
    group = f"g-{source}"
    with Producer(cluster.bootstrap) as plain:
        plain.send_batch(source, labelled("in", 20))
        plain.flush()
    consumer = Consumer(cluster.bootstrap, source, group=group, auto_commit_interval_ms=None)
    producer = Producer(cluster.bootstrap, transactional_id=f"tid-{source}")
    try:
        producer.init_transactions()
        seen = _read_n(consumer, 20)
        producer.begin_transaction()
        producer.send_batch(sink, [b"out-" + v for v in seen])
        producer.send_positions_to_transaction(consumer.positions(), consumer.group_metadata())
        producer.abort_transaction()
        assert consumer.committed() == []           # the abort dropped them
        producer.begin_transaction()
        producer.send_batch(sink, [b"out-" + v for v in seen])
        producer.send_positions_to_transaction(consumer.positions(), consumer.group_metadata())
        producer.commit_transaction()
        assert consumer.committed() == consumer.positions()
    finally:
        producer.close()
        consumer.close()
    assert read_values(cluster, sink, b"out-in-19") == [b"out-" + v for v in labelled("in", 20)]


def _read_n(consumer, n: int) -> list[bytes]:
    out: list[bytes] = []
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} read"
        r = consumer.poll(timeout_s=0.1)
        if r is not None:
            out.append(r.value)
    return out


def test_a_new_instance_fences_the_old_and_aborts_what_it_left_open(cluster):
    stream = new_stream(cluster)
    tid = f"tid-{stream}"
    old = Producer(cluster.bootstrap, transactional_id=tid)
    try:
        old.init_transactions()
        old.begin_transaction()
        old.send_batch(stream, labelled("zombie", 10))
        old.flush()
        with Producer(cluster.bootstrap, transactional_id=tid) as new:
            new.init_transactions()                 # fences `old`, aborts its transaction
            new.begin_transaction()
            new.send_batch(stream, labelled("new", 10))
            new.commit_transaction()
        with pytest.raises(ProducerFenced):
            old.commit_transaction()
        with pytest.raises(ProducerFenced):
            old.begin_transaction()
    finally:
        old.close()
    assert read_values(cluster, stream, b"new-9") == labelled("new", 10)


def test_a_stuck_producer_holds_read_committed_readers_back_at_most_its_timeout(cluster):
    stream = new_stream(cluster)
    stuck = Producer(cluster.bootstrap, transactional_id=f"stuck-{stream}",
                     transaction_timeout_ms=TIMEOUT_MS_MIN)
    try:
        stuck.init_transactions()
        stuck.begin_transaction()
        stuck.send_batch(stream, labelled("stuck", 5))
        stuck.flush()                               # stored, then never committed
        with Producer(cluster.bootstrap, transactional_id=f"live-{stream}") as live:
            live.init_transactions()
            live.begin_transaction()
            live.send_batch(stream, labelled("live", 5))
            live.commit_transaction()
        # `stuck` opened first: until its timeout aborts it, nothing after it is stable.
        assert read_values(cluster, stream, b"live-4") == labelled("live", 5)
        with pytest.raises(TransactionTimedOut):
            stuck.commit_transaction()
        stuck.abort_transaction()                  # takes a new epoch (KIP-588) and goes on
        stuck.begin_transaction()
        stuck.send_batch(stream, labelled("redone", 5))
        stuck.commit_transaction()
    finally:
        stuck.close()
    assert read_values(cluster, stream, b"redone-4") == labelled("live", 5) + labelled("redone", 5)


def test_kera_txn_lists_and_describes_the_ids(cluster, capsys):
    from kera.cli.main import main
    stream = new_stream(cluster)
    tid = f"tid-{stream}"
    with Producer(cluster.bootstrap, transactional_id=tid) as p:
        p.init_transactions()
        p.begin_transaction()
        p.send(stream, b"x")
        p.commit_transaction()
    capsys.readouterr()
    assert main(["txn", "list", "--bootstrap", cluster.bootstrap, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert tid in [t["transactional_id"] for t in listed]
    assert main(["txn", "describe", tid, "--bootstrap", cluster.bootstrap, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["transactional_id"] == tid and [stream, 0] in described["parts"]
    assert main(["txn", "describe", tid, "--bootstrap", cluster.bootstrap]) == 0
    assert f"transactional id '{tid}'" in capsys.readouterr().out
