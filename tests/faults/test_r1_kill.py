"""An R=1 stream on a broker with a data dir keeps every acknowledged record through a kill -9 of
the broker's process (the chunks reach the page cache of their segment file before the ack,
kera.broker.tier_files `.live`), as Kafka does at replication 1: the restart from the same
--id/--dir reloads them, producers' sequences included, and the history keeps its epoch, so a
consumer's saved positions resume with no gap, no duplicate and no PositionLost."""

from __future__ import annotations

import pytest

from kera import Consumer

from tests.integration.test_lost_positions import produce, read_all_and_save
from tests.integration.test_produce_consume import (check_exactly_once_in_order, drain,
                                                    identities)

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = pytest.mark.security_modes

# Far above what the test writes, so nothing is tiered on its own before the kill.
MEMORY_LIMIT = "1GiB"
RECORDS = 3000


def test_acknowledged_r1_records_survive_kill_9(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING",
                            extra_broker_args=["--memory-limit", MEMORY_LIMIT])
    with cluster.admin() as admin:
        admin.create_stream("r1", streamlets=2, replication=1)
    produce(cluster, "r1", 0, 0, RECORDS)
    produce(cluster, "r1", 1, 0, RECORDS)
    _, positions = read_all_and_save(cluster, "r1", 2 * RECORDS)
    segs = list((cluster.data_dir / "broker-0" / "segments").rglob("*.meta"))
    assert not segs, f"segments were tiered before the kill: {segs}"
    cluster.kill_broker(0)
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready("r1", 20.0)
    with Consumer(cluster.bootstrap, "r1") as c:
        recs = identities(drain(c, 2 * RECORDS, timeout_s=30))
        assert c.poll(0.5) is None
    check_exactly_once_in_order(recs, {0: RECORDS, 1: RECORDS})
    produce(cluster, "r1", 2, 0, 500)
    with Consumer(cluster.bootstrap, "r1", start=positions) as c:
        after = identities(drain(c, 500, timeout_s=30))
        assert c.poll(0.5) is None
        assert {p.epoch for p in c.positions()} == {p.epoch for p in positions}
    check_exactly_once_in_order(after, {2: 500})
    # A second kill -9: the reloaded segments and the new ones come back again.
    cluster.kill_broker(0)
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready("r1", 20.0)
    with Consumer(cluster.bootstrap, "r1") as c:
        recs = identities(drain(c, 2 * RECORDS + 500, timeout_s=30))
        assert c.poll(0.5) is None
    check_exactly_once_in_order(recs, {0: RECORDS, 1: RECORDS, 2: 500})
