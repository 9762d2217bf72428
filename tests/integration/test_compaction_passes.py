"""Compaction passes on real daemons (docs/COMPACTION.md): an R=2 compacted stream whose keys
are each updated many times, some then deleted, is compacted by its broker in the background
(the new chunks replicated through the group's virtual log, swapped in once durable); a
consumer from the beginning then reads exactly one record per key, its latest value (a
tombstone for a deleted key), in number order; a consumer reading while passes run sees every
key's latest value; a consumer group committing while passes run resumes from its committed
positions (which a swap never moves) with no record twice and every key's latest value."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kera import Consumer, Producer
from kera.net import rpc

KiB = 1024
KEYS = 500
UPDATES = 20
DELETED = 50               # keys whose last record is a tombstone
PADDING = 1500             # keys written once at the end, so every update lands in a finished group
VALUE = b"x" * 80
WAIT_S = 90.0


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=1, log_level="WARNING")


def write(cluster, stream) -> dict:
    """Every update, the deletes and the padding; returns each key's latest value."""
    latest: dict = {}
    with Producer(cluster.bootstrap) as p:
        for u in range(UPDATES):
            keys = [b"k%04d" % k for k in range(KEYS)]
            values = [b"%d:" % u + VALUE for _ in keys]
            p.send_batch(stream, values, keys=keys)
            latest.update(zip(keys, values))
        gone = [b"k%04d" % k for k in range(0, KEYS, KEYS // DELETED)]
        for key in gone:
            p.send(stream, None, key=key)
            latest[key] = None
        pad = [b"pad%05d" % i for i in range(PADDING)]
        p.send_batch(stream, [VALUE] * PADDING, keys=pad)
        latest.update((k, VALUE) for k in pad)
        p.flush()
    return latest


def read_from_start(cluster, stream, idle_s=1.0) -> list:
    out = []
    with Consumer(cluster.bootstrap, stream, start="earliest") as c:
        while True:
            r = c.poll(timeout_s=idle_s)
            if r is None:
                return out
            out.append(r)


def create_compacted(cluster, stream: str) -> None:
    """One streamlet, R=2, small segments and a dirty ratio that makes every pass due."""
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=1, replication=2, segment_size_bytes=32 * KiB,
                            group_segments=2, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01)


def assert_latest_once_in_order(got, latest: dict) -> None:
    """Exactly each key's latest value, once, in record-number order."""
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    assert [r.number for r in got] == sorted(r.number for r in got)


def test_compacted_stream_reads_one_latest_record_per_key(cluster):
    stream = "compacted-passes"
    create_compacted(cluster, stream)
    seen: dict = {}
    numbers: list = []
    stop = threading.Event()

    def follow():   # a consumer reading while passes run
        with Consumer(cluster.bootstrap, stream, start="earliest") as c:
            while not stop.is_set():
                r = c.poll(timeout_s=0.2)
                if r is not None:
                    seen[r.key] = r.value
                    numbers.append(r.number)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    latest = write(cluster, stream)
    written = KEYS * UPDATES + DELETED + PADDING
    deadline = time.monotonic() + WAIT_S
    while True:
        got = read_from_start(cluster, stream)
        if len(got) == len(latest) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert len(got) < written, "no pass compacted anything"
    stats = rpc.call(cluster.brokers[0].address, "stats", timeout_s=5.0)[0]["stats"]
    assert stats["compaction_passes"] >= 1
    assert stats["compaction_bytes_after"] < stats["compaction_bytes_before"]
    assert_latest_once_in_order(got, latest)
    while b"pad%05d" % (PADDING - 1) not in seen and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    reader.join(10)
    assert seen == latest
    assert numbers == sorted(set(numbers)), "the reader saw a record twice or out of order"


def poll_n(c, n: int, deadline: float) -> list:
    """The next `n` records `c` hands out (fewer if the deadline passes)."""
    out = []
    while len(out) < n and time.monotonic() < deadline:
        r = c.poll(timeout_s=0.2)
        if r is not None:
            out.append(r)
    return out


def test_a_group_committing_while_passes_run_resumes_where_it_committed(cluster):
    """A member reads and commits, passes swap compacted segments in under its positions, it
    reads and commits again; a new member of the group resumes at the committed position,
    inside the compacted range: no record twice, each in number order, every key's latest
    value seen by one of them."""
    stream = "compacted-group"
    with cluster.admin() as admin:   # min.compaction.lag.ms: the first commit comes first
        admin.create_stream(stream, streamlets=1, replication=2, segment_size_bytes=32 * KiB,
                            group_segments=2, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01, min_compaction_lag_ms=2000)
    latest = write(cluster, stream)
    broker = cluster.brokers[0].address
    deadline = time.monotonic() + WAIT_S
    with Consumer(cluster.bootstrap, stream, group="g-compacted",
                  auto_commit_interval_ms=None) as a:
        first = poll_n(a, KEYS * UPDATES // 4, deadline)
        a.commit()
        passes = lambda: rpc.call(broker, "stats", timeout_s=5.0)[0]["stats"][
            "compaction_streams"][stream]["passes"]
        while passes() < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        first += poll_n(a, KEYS * UPDATES // 4, deadline)
        a.commit()
        committed = {(p.stream, p.streamlet): p for p in a.committed()}
    assert passes() >= 1, "no pass ran while the group read"
    with Consumer(cluster.bootstrap, stream, group="g-compacted") as b:
        rest = []
        while b"pad%05d" % (PADDING - 1) not in {r.key for r in rest[-1:]}:
            more = poll_n(b, 1, deadline)
            assert more, "the second member did not reach the end"
            rest += more
    assert len(first) == KEYS * UPDATES // 2 and committed
    numbers = [r.number for r in first + rest]
    assert numbers == sorted(set(numbers)), "a record twice or out of order across the resume"
    seen = {}
    for r in first + rest:
        seen[r.key] = r.value
    assert seen == latest
    # Uncompacted, the records after the committed position outnumber the keys 3 to 1.
    assert len(rest) <= len(latest), "the second member did not read compacted segments"


def read_until(cluster, stream, want: dict, deadline: float) -> list:
    """Read from the beginning until exactly one record per key of `want` comes back (later
    passes may still be running), or the deadline passes; returns the last read."""
    while True:
        got = read_from_start(cluster, stream)
        if len(got) == len(want) or time.monotonic() > deadline:
            return got
        time.sleep(1.0)


def test_a_compacted_streamlet_fails_over_from_its_backups(fresh_cluster):
    """kill -9 of the broker after its passes: the new owner rebuilds each segment from the
    backups (a whole rewrite, else the original), serves every key's latest value, compacts on
    and takes appends after them."""
    cluster = fresh_cluster(brokers=2, backups=2, log_level="WARNING")
    stream = "compacted-failover"
    create_compacted(cluster, stream)
    latest = write(cluster, stream)
    deadline = time.monotonic() + WAIT_S
    got = read_until(cluster, stream, latest, deadline)
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    with Producer(cluster.bootstrap) as p:
        owner = p._meta.address_of(p.stream_info(stream).id, 0)
    cluster.kill_broker([d.address for d in cluster.brokers].index(owner))
    with cluster.admin() as admin:
        admin.wait_ready(stream, 30.0)
    got = read_until(cluster, stream, latest, deadline)
    assert_latest_once_in_order(got, latest)
    with Producer(cluster.bootstrap) as p:
        p.send(stream, b"after", key=b"k0001")
        p.flush()
    latest[b"k0001"] = b"after"
    got = read_from_start(cluster, stream)
    assert {r.key: r.value for r in got} == latest
    assert got[-1].key == b"k0001" and got[-1].number > got[-2].number


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_broker_restarted_after_its_passes_serves_them(fresh_cluster, how):
    """An orderly stop (the broker writes its segments, compacted ones included, to its data
    dir) or a kill -9, then the same broker again: every key's latest value, once each."""
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING")
    stream = "compacted-restart"
    create_compacted(cluster, stream)
    latest = write(cluster, stream)
    deadline = time.monotonic() + WAIT_S
    got = read_until(cluster, stream, latest, deadline)
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    broker = cluster.brokers[0]
    if how == "stop":
        broker.signal(signal.SIGTERM)
        assert broker.wait(30.0) is not None
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready(stream, 30.0)
    got = read_until(cluster, stream, latest, deadline)
    assert_latest_once_in_order(got, latest)


def test_a_backup_killed_while_passes_run(fresh_cluster):
    """kill -9 of a backup as passes start: the pass's chunks are re-replicated to the other
    backup like any others, swapped once durable there; every key's latest value, once."""
    cluster = fresh_cluster(brokers=1, backups=2, log_level="WARNING")
    stream = "compacted-backup-loss"
    create_compacted(cluster, stream)
    latest = write(cluster, stream)
    cluster.kill_backup(0)
    got = read_until(cluster, stream, latest, time.monotonic() + WAIT_S)
    assert_latest_once_in_order(got, latest)
