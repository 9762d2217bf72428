"""Positions carry the epoch of the streamlet history they point into (kera.broker.history_epoch):
a consumer resuming from positions saved before an R=1 broker lost its data hears of it
(`position_lost`) or restarts as its `on_lost_position` says, and never silently skips the
records produced after the loss; a history that continues (reload from the data dir, failover
of a replicated stream) keeps its epoch, so positions resume with no gap and no duplicate."""

from __future__ import annotations

import shutil

import pytest

from kera import Consumer, Producer
from kera.errors import PositionLost

from tests.integration.test_produce_consume import (check_exactly_once_in_order, drain,
                                                    identities, values_for)


def produce(cluster, stream, producer_id, start, n):
    with Producer(cluster.bootstrap, producer_id=producer_id) as p:
        p.send_batch(stream, values_for(producer_id, start, n))
        p.flush(timeout=60)
        assert p.stats["acked"] == n and p.stats["records_failed"] == 0


def read_all_and_save(cluster, stream, n):
    with Consumer(cluster.bootstrap, stream) as c:
        recs = identities(drain(c, n))
        positions = c.positions()
    assert all(p.epoch is not None for p in positions), positions
    return recs, positions


@pytest.fixture
def lost(fresh_cluster):
    """An R=1 stream whose broker was killed and restarted with its segment files wiped, after
    a consumer saved its positions at the end of 300 records; 1000 records produced since:
    more than before, so the saved offsets fall inside the new history's group (read there,
    they would skip its first 300 records without a word)."""
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    with cluster.admin() as admin:
        admin.create_stream("r1", streamlets=1, replication=1)
    produce(cluster, "r1", 0, 0, 300)
    _, positions = read_all_and_save(cluster, "r1", 300)
    cluster.kill_broker(0)
    shutil.rmtree(cluster.data_dir / "broker-0" / "segments", ignore_errors=True)
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready("r1", 20.0)
    produce(cluster, "r1", 1, 0, 1000)
    return cluster, positions


def test_lost_position_raises_by_default(lost):
    cluster, positions = lost
    with Consumer(cluster.bootstrap, "r1", start=positions) as c:
        with pytest.raises(PositionLost) as info:
            drain(c, 1, timeout_s=30)
    assert "streamlet 0" in str(info.value) and "epoch" in str(info.value)


def test_lost_position_earliest_reads_every_record_produced_after_the_loss(lost):
    cluster, positions = lost
    with Consumer(cluster.bootstrap, "r1", start=positions, on_lost_position="earliest") as c:
        recs = identities(drain(c, 1000, timeout_s=30))
        assert c.poll(0.5) is None
        after = c.positions()
    check_exactly_once_in_order(recs, {1: 1000})
    assert after[0].epoch != positions[0].epoch
    # The new positions are of the new history: they resume exactly.
    produce(cluster, "r1", 2, 0, 100)
    with Consumer(cluster.bootstrap, "r1", start=after) as c:
        check_exactly_once_in_order(identities(drain(c, 100, timeout_s=30)), {2: 100})


def test_lost_position_latest_starts_at_the_end(lost):
    cluster, positions = lost
    with Consumer(cluster.bootstrap, "r1", start=positions, on_lost_position="latest") as c:
        assert c.poll(1.0) is None   # the reset to the end happened: nothing before it is read
        produce(cluster, "r1", 2, 0, 100)
        recs = identities(drain(c, 100, timeout_s=30))
        assert c.poll(0.5) is None
    check_exactly_once_in_order(recs, {2: 100})


def test_orderly_restart_keeps_the_epoch_and_positions_resume(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    with cluster.admin() as admin:
        admin.create_stream("r1", streamlets=1, replication=1)
    produce(cluster, "r1", 0, 0, 2000)
    _, positions = read_all_and_save(cluster, "r1", 2000)
    d = cluster.brokers[0]
    d.signal(15)    # an orderly stop writes every segment: the restart reloads the history
    assert d.wait(30.0) == 0
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready("r1", 20.0)
    produce(cluster, "r1", 1, 0, 300)
    with Consumer(cluster.bootstrap, "r1", start=positions) as c:
        recs = identities(drain(c, 300, timeout_s=30))
        assert c.poll(0.5) is None
        assert {p.epoch for p in c.positions()} == {positions[0].epoch}
    check_exactly_once_in_order(recs, {1: 300})


def test_failover_of_a_replicated_stream_keeps_positions(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=2, log_level="WARNING")
    with cluster.admin() as admin:
        admin.create_stream("r2", streamlets=2, replication=2)
    produce(cluster, "r2", 0, 0, 4000)
    first, positions = read_all_and_save(cluster, "r2", 4000)
    cluster.kill_broker(0)          # its streamlets fail over to broker 1, rebuilt from backups
    with cluster.admin() as admin:
        admin.wait_ready("r2", 30.0)
    produce(cluster, "r2", 1, 0, 1000)
    with Consumer(cluster.bootstrap, "r2", start=positions) as c:
        recs = identities(drain(c, 1000, timeout_s=60))
        assert c.poll(0.5) is None
    check_exactly_once_in_order(recs, {1: 1000})
