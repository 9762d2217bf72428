"""A backup that registers again was restarted: its in-memory replicas are gone even if the
coordinator never declared it dead (tests/sim seed 108: it crashed and came back while the
coordinator was down). The broker sees the new `registered_version` in the `cluster` reply and
re-replicates every virtual segment that had a replica on it, as after a death."""

from kera.codec import chunk
from kera.broker.backups import BackupPool
from kera.broker.core import Broker, BrokerConfig

ME = 7


def entries(*specs):
    """(id, alive, registered_version) -> `cluster` reply backup entries."""
    return [{"id": i, "address": f"127.0.0.1:{9000 + i}", "node": f"node{i}", "alive": alive,
             "registered_version": version} for i, alive, version in specs]


# --------------------------------------------------------------------------- the pool

def test_a_new_registered_version_reports_the_backup_as_lost():
    pool = BackupPool("x")
    assert pool.update(entries((1, True, 3), (2, True, 4))) == []     # first seen: nothing lost
    assert pool.update(entries((1, True, 3), (2, True, 4))) == []
    assert pool.update(entries((1, True, 3), (2, True, 12))) == [2]   # restarted, never seen dead
    assert pool.alive(2) and pool.update(entries((1, True, 3), (2, True, 12))) == []


def test_a_coordinator_restart_is_not_a_backup_restart():
    pool = BackupPool("x")
    pool.update(entries((1, True, 3), (2, True, 4)))
    # The restarted coordinator has heard no `register` yet: 0 says nothing about the backups.
    assert pool.update(entries((1, True, 0), (2, False, 0))) == [2]   # (2 is dead for now)
    assert pool.update(entries((1, True, 0), (2, True, 0))) == []
    # Backup 1 registers with it: a restart, whatever the broker saw before.
    assert pool.update(entries((1, True, 15), (2, True, 0))) == [1]


def test_an_unknown_version_keeps_the_one_seen_before():
    # A coordinator that does not report it (0) must not make the broker forget which
    # registration it saw: the same one reported again later is no restart, a newer one is.
    pool = BackupPool("x")
    pool.update(entries((2, True, 4)))
    assert pool.update(entries((2, True, 0))) == []
    assert pool.update(entries((2, True, 4))) == []
    assert pool.update(entries((2, True, 0))) == []
    assert pool.update(entries((2, True, 9))) == [2]


def test_death_then_registration_reports_each_once():
    pool = BackupPool("x")
    pool.update(entries((1, True, 3)))
    assert pool.update(entries((1, False, 3))) == [1]
    assert pool.update(entries((1, True, 9))) == [1]   # back, empty: nothing on it to lose, though
    assert pool.update(entries((1, False, 11))) == [1]   # registered again and died: once


def test_a_bad_registered_version_skips_the_entry():
    pool = BackupPool("x")
    bad = [{**e, "registered_version": v} for e, v in zip(entries((1, True, 0), (2, True, 0)), ("3", -1))]
    pool.update(bad + entries((3, True, 2)))
    assert list(pool.backups) == [3]
    assert pool.update(entries((3, True, 2)) + [{"id": 4, "address": "h:1"}]) == []  # optional


# --------------------------------------------------------------------------- the broker

def desc(R):
    return {"name": "s", "id": 1, "streamlets": 1, "active_groups": 1, "replication": R,
            "group_segments": 16, "segment_size_bytes": 1 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [ME], "brokers": {}, "version": 1, "ready": True}


def acked_broker(R, versions):
    """A broker whose first chunk is acknowledged by R-1 of the backups in `versions`."""
    b = Broker("node0", BrokerConfig(replication_timeout_s=2.0), broker_id=ME)
    b.apply_metadata([desc(R)], 1)
    b.placement.set_backups(entries(*((i, True, v) for i, v in versions.items())), 0.0)
    b.produce("a", [chunk.encode(1, 0, 1, 0, [b"r"] * 4)], 0.0)
    writes = b.sync(0.0)
    for w in writes:
        b.write_done(w, {"length": w.end_bytes}, None, 0.0)
    assert [t for t, _ in b.take_replies()] == ["a"]
    assert b.sync(0.0) == []
    return b, [w.backup_id for w in writes]


def test_replicas_on_a_restarted_backup_are_rebuilt_elsewhere():
    b, [holder] = acked_broker(2, {1: 3, 2: 4})
    other = 3 - holder
    versions = {1: 3, 2: 4}
    versions[holder] += 10   # it restarted within the dead window: alive all along
    b.placement.set_backups(entries(*((i, True, v) for i, v in versions.items())), 1.0)
    [w] = b.sync(1.0)
    assert w.backup_id == other and w.fields["offset"] == 0 and w.fields["reset"] is True
    assert w.chunks == 1
    assert b.stats()["replicas_lost"] == 1


def test_with_no_other_backup_the_restarted_one_is_rewritten_from_zero():
    b, holders = acked_broker(3, {1: 3, 2: 4})
    assert sorted(holders) == [1, 2]
    b.placement.set_backups(entries((1, True, 3), (2, True, 20)), 1.0)
    [w] = b.sync(1.0)
    assert w.backup_id == 2 and w.fields["offset"] == 0 and w.fields["reset"] is True
    b.write_done(w, {"length": w.end_bytes}, None, 1.0)
    assert b.sync(1.0) == []


def test_a_coordinator_restart_does_not_rereplicate():
    b, _ = acked_broker(2, {1: 3, 2: 4})
    b.placement.set_backups(entries((1, True, 0), (2, True, 0)), 1.0)
    assert b.sync(1.0) == [] and b.stats().get("replicas_lost", 0) == 0


def test_an_unsettled_coordinator_declares_no_backup_lost():
    # Right after a coordinator restart its list says "not alive" for every backup it has not
    # heard from yet; that is no evidence of a death, so nothing is re-replicated.
    pool = BackupPool("x")
    pool.update(entries((1, True, 3), (2, True, 4)))
    assert pool.update(entries((1, False, 0), (2, False, 0)), settled=False) == []
    assert pool.alive(1) and pool.alive(2)
    assert pool.update([], settled=False) == [] and pool.live_count() == 2
    # Once settled, a backup still not heard from is dead.
    assert pool.update(entries((1, True, 0), (2, False, 0)), settled=True) == [2]
    assert not pool.alive(2)
