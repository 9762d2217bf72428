"""Tiering against a real local cluster: a broker with a small memory limit ingests several
times that amount and a consumer reads all of it back exactly; its memory stays near the limit;
an orderly restart from its data dir keeps every acknowledged record, a killed one keeps what
was tiered; producers are throttled (not dropped) when memory and disk are full."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kera import Consumer, Producer

from kera.net import rpc
from kera.broker.memory import resident_bytes

from tests.integration.test_produce_consume import check_exactly_once_in_order, drain, identities, values_for

MiB = 1 << 20
LIMIT = 4 * MiB
_names = iter(range(10**6))


def broker_stats(cluster, i=0) -> dict:
    header, _ = rpc.call(cluster.brokers[i].address, "stats", timeout_s=5.0)
    return header["stats"]


def new_stream(cluster, **kw):
    name = f"tier-{next(_names)}"
    kw.setdefault("segment_size_bytes", 1 * MiB)
    kw.setdefault("group_segments", 4)
    with cluster.admin() as admin:
        admin.create_stream(name, **kw)
    return name


def drain_idle(consumer, idle_s: float = 2.0, timeout_s: float = 60.0) -> list:
    """poll_batch until nothing new arrives for idle_s."""
    batches = []
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    while time.monotonic() - last < idle_s:
        assert time.monotonic() < deadline, "the stream did not go quiet"
        got = consumer.poll_batch(timeout_s=0.2)
        if got:
            batches += got
            last = time.monotonic()
    return batches


def produce(cluster, stream, producer_id, n, batch=20_000):
    with Producer(cluster.bootstrap, producer_id=producer_id) as p:
        for a in range(0, n, batch):
            p.send_batch(stream, values_for(producer_id, a, min(batch, n - a)))
        p.flush()
        assert p.stats["acked"] == n and p.stats["records_failed"] == 0
    return {producer_id: n}


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=1, log_level="WARNING",
                         extra_broker_args=["--memory-limit", f"{LIMIT}"])


def test_ingest_several_times_the_memory_limit_and_read_it_all_back(cluster):
    stream = new_stream(cluster, streamlets=2, replication=2)
    n = 200_000                                          # 100-byte values: ~20 MiB, 5x the limit
    sent = produce(cluster, stream, 0, n // 2)
    sent.update(produce(cluster, stream, 1, n // 2))
    s = broker_stats(cluster)
    assert s["memory_bytes"] <= LIMIT
    assert s["tiered_bytes"] >= 12 * MiB and s["tier_writes"] > 0
    pid = cluster.brokers[0].pid
    rss = resident_bytes(pid)
    # Segments are anonymous shared maps (RssShmem): about the limit, not the 20 MiB ingested.
    assert rss.get("RssShmem", 0) < 2 * LIMIT
    files = list((cluster.data_dir / "broker-0" / "segments").rglob("*.seg"))
    assert files
    with Consumer(cluster.bootstrap, stream) as c:
        recs = identities(drain(c, n))
    check_exactly_once_in_order(recs, sent)
    assert broker_stats(cluster)["tier_maps"] > 0         # served from the files


def test_consumer_positions_resume_exactly_across_tiered_data(cluster):
    stream = new_stream(cluster, streamlets=1)
    sent = produce(cluster, stream, 2, 60_000)
    batches, got = [], 0
    with Consumer(cluster.bootstrap, stream) as c:
        deadline = time.monotonic() + 60
        while got < 25_000 and time.monotonic() < deadline:
            for b in c.poll_batch(timeout_s=0.5, max_chunks=1):
                batches.append(b)
                got += len(b)
        positions = c.positions()
    first = identities(batches)
    with Consumer(cluster.bootstrap, stream, start=positions) as c:
        rest = identities(drain(c, 60_000 - got))

    check_exactly_once_in_order(np.concatenate([first, rest]), sent)


def restart_and_read(cluster, stream, expected: int) -> np.ndarray:
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready(stream, 20.0)
    with Consumer(cluster.bootstrap, stream) as c:
        return identities(drain(c, expected))


def test_orderly_restart_keeps_every_acknowledged_record(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                            extra_broker_args=["--memory-limit", f"{LIMIT}"])
    stream = new_stream(cluster, streamlets=2, active_groups=2, replication=2)
    sent = produce(cluster, stream, 0, 50_000)
    sent.update(produce(cluster, stream, 1, 50_000))
    d = cluster.brokers[0]
    d.signal(15)                                        # SIGTERM: writes what is in memory
    assert d.wait(30.0) == 0
    assert (cluster.data_dir / "broker-0" / "clean_shutdown").exists()
    check_exactly_once_in_order(restart_and_read(cluster, stream, 100_000), sent)
    # The restarted broker appends after what it holds.
    sent.update(produce(cluster, stream, 2, 10_000))
    with Consumer(cluster.bootstrap, stream) as c:
        recs = identities(drain(c, 110_000))
    check_exactly_once_in_order(recs, sent)



# With R=1 the broker's own disk is the only copy: the coordinator leaves R=1 streamlets on
# their broker (no replica could rebuild them elsewhere), so a restarted broker serves what it
# reloaded from its data directory.
def test_orderly_restart_r1_reloads_every_acknowledged_record(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING",
                            extra_broker_args=["--memory-limit", f"{LIMIT}"])
    stream = new_stream(cluster, streamlets=2, active_groups=2)
    sent = produce(cluster, stream, 0, 50_000)
    sent.update(produce(cluster, stream, 1, 50_000))
    d = cluster.brokers[0]
    d.signal(15)
    assert d.wait(30.0) == 0
    check_exactly_once_in_order(restart_and_read(cluster, stream, 100_000), sent)


def test_r1_streams_hold_only_their_open_segments_in_memory(fresh_cluster):
    # Far above what is written: only settling (kera.broker.tier) lets sealed segments go.
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING",
                            extra_broker_args=["--memory-limit", "1GiB"])
    stream = new_stream(cluster, streamlets=2, active_groups=2)
    sent = produce(cluster, stream, 0, 50_000)
    sent.update(produce(cluster, stream, 1, 50_000))       # ~11 MiB into 1 MiB segments
    s = broker_stats(cluster)
    assert s["tier_r1_settled"] >= 5
    assert s["memory_bytes"] <= 2 * 2 * MiB                 # 2 streamlets x 2 open groups
    with Consumer(cluster.bootstrap, stream) as c:
        check_exactly_once_in_order(identities(drain(c, 100_000)), sent)
    cluster.kill_broker(0)
    check_exactly_once_in_order(restart_and_read(cluster, stream, 100_000), sent)


def test_killed_broker_restart_keeps_what_was_tiered(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING",
                            extra_broker_args=["--memory-limit", f"{LIMIT}"])
    stream = new_stream(cluster, streamlets=1)
    produce(cluster, stream, 0, 100_000)
    tiered = broker_stats(cluster)["tiered_bytes"]
    assert tiered > 4 * MiB
    cluster.kill_broker(0)                              # SIGKILL: memory is lost (R=1)
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready(stream, 20.0)
    with Consumer(cluster.bootstrap, stream) as c:
        recs = identities(drain_idle(c))
    # What was reloaded is a prefix of what producer 0 sent, in order, without gaps. A record
    # takes 112 bytes in a segment (100 of value, 8 of timestamp, 4 of offset) plus its share
    # of a 64-byte chunk header.
    assert len(recs) * 112 >= tiered * 0.95
    assert (recs["s"] == np.arange(len(recs))).all()


def test_producers_are_throttled_not_dropped_when_memory_is_full(fresh_cluster):
    # No room on disk: once memory is full, appends are refused as `throttled` (retriable);
    # the producer retries and reports failure only after its retries, never silently.
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING",
                            extra_broker_args=["--memory-limit", f"{2 * MiB}", "--disk-limit", "1"])
    stream = new_stream(cluster, streamlets=1)
    with Producer(cluster.bootstrap, producer_id=0, send_timeout_s=5.0, retries_max=3) as p:
        p.send_batch(stream, values_for(0, 0, 40_000))    # ~4 MiB: twice the limit
        with pytest.raises(Exception):
            p.flush(timeout=20.0)
        acked, failed = p.stats["acked"], p.stats["records_failed"]
    assert broker_stats(cluster)["produce_throttled_memory"] > 0
    assert acked + failed == 40_000 and acked > 0 and failed > 0
    with Consumer(cluster.bootstrap, stream) as c:
        recs = identities(drain_idle(c))
    # Exactly what was acknowledged is stored: nothing dropped silently, nothing twice.
    assert len(recs) == acked and len(np.unique(recs["s"])) == acked

