"""Retention without sockets: whole groups deleted by time and by size, oldest first and only
once finished; readers before the retained range get offset_out_of_range, `earliest` readers
start at the first retained group; replicas nothing references are dropped on the backups;
the coordinator's retention fields and alter_stream; the backup's drop_replica."""

from pathlib import Path

import pytest

from kera.codec import chunk
from kera.backup.store import DropJob, ReplicaStore
from kera.broker import tier_files
from kera.broker.core import Broker, BrokerConfig
from kera.broker.streams import StreamInfo
from kera.broker.tier import TierConfig
from kera.consumer.cursor import FetchCursor, GroupInfo
from kera.coordinator.core import Coordinator
from kera.coordinator.validate import StreamSpec
from kera.errors import BadRequest
from kera.spark import offsets as ko

from tests.unit.test_tier import make, read_all, run_jobs

ME = 3
KiB = 1024
MIN = 60_000


def desc(sid=1, *, R=1, Q=1, G=1, seg=4 * KiB, retention_ms=0, retention_bytes=0, version=1):
    return {"name": f"s{sid}", "id": sid, "streamlets": 1, "active_groups": Q, "replication": R,
            "group_segments": G, "segment_size_bytes": seg, "durability": "memory",
            "placement": [ME], "brokers": {}, "version": version, "ready": True,
            "retention_ms": retention_ms, "retention_bytes": retention_bytes}


def broker(*streams, root=None, backups=()):
    b = Broker("n", BrokerConfig(tier=TierConfig(root=root, memory_limit_bytes=1 << 30)),
               broker_id=ME)
    b.apply_metadata(list(streams), 1)
    if backups:
        b.placement.set_backups([{"id": i, "address": f"127.0.0.1:{9000 + i}", "node": f"n{i}",
                        "alive": True} for i in backups], 0.0)
    return b


def fill(b, n, start=0, wall_ms=0, producer=1):
    """n chunks of ~1 KiB: with 4 KiB one-segment groups, a group closes every 4 chunks."""
    b.set_wall_clock(wall_ms)
    for seq in range(start, start + n):
        b.produce(seq, [make(seq, producer=producer, n=4, size=200)], 0.0)


def acknowledge_floors(b):
    """What the coordinator's heartbeat reply does: the floors sent are kept."""
    b.retention.floors_acknowledged(b.retention.floors_to_send())


def fetch(b, low, offsets=None, **cursor):
    results, frames = b.reads.fetch([[1, 0, {"low": low, "offsets": offsets or {}, **cursor}, 1 << 20]])
    return results[0], frames


def test_time_retention_deletes_old_finished_groups():
    b = broker(desc(retention_ms=MIN))
    fill(b, 16, wall_ms=0)                      # groups 0..3 (3 closed, 1 open)
    fill(b, 8, start=16, wall_ms=MIN)           # closes group 3, fills 4, opens 5
    groups = [g[0] for g in b.reads.offsets(1, 0)]
    assert b.enforce_retention(MIN + 1) == 4    # groups 0..3 last written at 0
    assert [g[0] for g in b.reads.offsets(1, 0)] == groups[4:] and b.reads.first_group(1, 0) == 4
    assert b.enforce_retention(MIN + 2) == 0
    assert b.stats()["groups_deleted"] == 4


def test_an_open_group_is_closed_by_time_then_deleted():
    b = broker(desc(retention_ms=MIN, G=8, seg=64 * KiB))
    fill(b, 2, wall_ms=0)
    fill(b, 1, start=2, wall_ms=MIN // 2)
    assert b.enforce_retention(MIN // 2) == 0
    assert not b.reads.offsets(1, 0)[0][4]            # still open
    assert b.enforce_retention(MIN) == 0        # closed (created a retention period ago) ...
    assert b.reads.offsets(1, 0)[0][4]
    assert b.enforce_retention(MIN + MIN // 2) == 0   # ... expired, but the slot's last group:
    acknowledge_floors(b)                             # it goes once its floor is kept
    assert b.enforce_retention(MIN + MIN // 2) == 1

    fill(b, 1, start=3, wall_ms=2 * MIN)        # the slot's next chunk opens group 1
    assert [g[0] for g in b.reads.offsets(1, 0)] == [1]


def test_size_retention_keeps_at_least_the_limit():
    b = broker(desc(retention_bytes=10 * KiB))
    fill(b, 40)                                 # ~10 groups of ~4 KiB
    b.enforce_retention(0)
    kept = b.streams[1].streamlets[0].groups
    total = sum(s.used_bytes for g in kept for s in g.segments)
    oldest = sum(s.used_bytes for s in kept[0].segments)
    assert total >= 10 * KiB and total - oldest < 10 * KiB
    assert b.reads.first_group(1, 0) > 0


def test_readers_before_the_retained_range_get_a_clear_error():
    b = broker(desc(retention_ms=MIN))
    fill(b, 12, wall_ms=0)
    fill(b, 4, start=12, wall_ms=10 * MIN)
    b.enforce_retention(10 * MIN)
    first = b.reads.first_group(1, 0)
    assert first == 3
    (err, n, groups), _ = fetch(b, 0)
    assert err[0] == "offset_out_of_range" and err[2] is False
    assert "no longer available" in err[1] and "deleted by retention" in err[1]
    # A reader that had read every deleted group to its end lost nothing.
    (err, n, groups), frames = fetch(b, 2, {2: 16})
    assert err is None and groups[0][0] == first
    # An "earliest" reader starts at the first retained group.
    (err, n, groups), frames = fetch(b, 0, earliest=True)
    assert err is None and n > 0 and groups[0][0] == first
    assert chunk.read_header(frames[0]).group == first


def test_consumer_cursor_follows_earliest_to_the_first_retained_group():
    c = FetchCursor(0, 0, {}, earliest=True)
    assert c.wire()["earliest"] is True
    low = c.on_groups([GroupInfo(7, 0, 0, 10, False)])
    assert low == 7 and c.low == 7 and "earliest" not in c.wire()
    latest = FetchCursor.at_end(0, [GroupInfo(7, 0, 0, 10, True), GroupInfo(8, 0, 0, 3, False)], 7)
    assert latest.low == 8 and latest.offsets[8] == 3


def test_spark_offsets_know_the_first_retained_group():
    infos = ko.Groups([ko.GroupInfo(5, 0, 0, 10, True), ko.GroupInfo(6, 0, 0, 4, False)])
    infos.first_group = 5
    assert ko.earliest(infos).next == 5
    assert ko.check_loss(ko.earliest(infos), infos, "s/0") == []
    problems = ko.check_loss(ko.Cursor(2, {}), infos, "s/0")
    assert problems and "deleted by retention" in problems[0]
    empty = ko.Groups()
    empty.first_group = 9
    assert ko.latest(empty).next == 9


def test_tiered_groups_are_deleted_from_disk(tmp_path):
    b = broker(desc(retention_ms=MIN), root=tmp_path)
    b.tier.tier_at_bytes = 1                    # tier everything sealed and durable
    fill(b, 20, wall_ms=0)
    run_jobs(b, tmp_path)
    assert len(list(tmp_path.rglob("*.seg"))) >= 4
    fill(b, 1, start=20, wall_ms=5 * MIN)
    b.enforce_retention(5 * MIN)
    run_jobs(b, tmp_path)
    assert not list(tmp_path.rglob("*.seg")) and b.tier.disk_bytes == 0
    assert tier_files.read_first_groups(tmp_path) == {(1, 0): 5}   # checksummed marker


class Backups:
    """Acknowledge every replication write as a backup would."""

    @staticmethod
    def ack(b, now=0.0):
        for _ in range(10):
            writes = b.sync(now)
            if not writes:
                return
            for w in writes:
                b.write_done(w, {"length": w.end_bytes}, None, now)


def test_replicas_are_dropped_once_nothing_references_them():
    b = broker(desc(R=2, retention_ms=MIN), backups=(1,))
    b.cfg.virtual_segment_bytes = 4 * KiB
    for vlog in b.vlog_list:
        vlog.segment_bytes = 4 * KiB
    fill(b, 12, wall_ms=0)
    for vlog in b.vlog_list:
        vlog.close_open()
    Backups.ack(b)
    b.take_replies()
    fill(b, 4, start=12, wall_ms=5 * MIN)
    Backups.ack(b)
    vlog = b.vlog_list[0]
    finished_before = [vs for vs in vlog.vsegs if vs.finished]
    assert finished_before
    b.enforce_retention(5 * MIN)
    drops = b.retention.take_drops()
    assert drops and all(d.fields["broker_id"] == ME and d.backup_id == 1 for d in drops)
    dropped = {d.fields["vseg"] for d in drops}
    assert dropped == {vs.number + vlog.vseg_base for vs in vlog.vsegs if vs.replicas == []}
    # What is still referenced stays; nothing is dropped twice.
    assert b.enforce_retention(5 * MIN) == 0 and b.retention.take_drops() == []
    assert read_all(b, low=b.reads.first_group(1, 0))


# ---------------------------------------------------------------------- coordinator

def test_coordinator_retention_create_alter_persist():
    c = Coordinator(0.0)
    c.register(0.0, "broker", "127.0.0.1:1", "n")
    d = c.create_stream(StreamSpec("s", retention_ms=1000))
    assert d["retention_ms"] == 1000 and d["retention_bytes"] == 0
    v = d["version"]
    d = c.handle("alter_stream", {"name": "s", "retention_bytes": 1 << 20}, 0.0)["stream"]
    assert d["retention_ms"] == 1000 and d["retention_bytes"] == 1 << 20 and d["version"] > v
    assert not d["ready"]                       # until the broker applies it
    with pytest.raises(BadRequest):
        c.handle("alter_stream", {"name": "s"}, 0.0)
    with pytest.raises(BadRequest):
        c.handle("alter_stream", {"name": "s", "retention_ms": -1}, 0.0)
    with pytest.raises(BadRequest):
        c.handle("create_stream", {"name": "t", "retention_bytes": "big"}, 0.0)
    c2 = Coordinator(0.0, state=c.to_state())
    assert c2.describe_stream("s")["retention_bytes"] == 1 << 20
    # State written before retention existed still loads.
    old = c.to_state()
    for s in old["streams"]:
        del s["retention_ms"], s["retention_bytes"]
    assert Coordinator(0.0, state=old).describe_stream("s")["retention_ms"] == 0


# ---------------------------------------------------------------------- backup

def test_backup_drop_replica_frees_memory_and_queues_file_removal():
    store = ReplicaStore()
    c = chunk.encode(1, 0, 1, 0, [b"x" * 100] * 4)
    key = (ME, 0, 5)
    assert store.replicate(key, 0, [c], "memory", True, "t", 0.0) == len(c)
    jobs = store.take_flush_jobs(0.0)
    assert len(jobs) == 1
    known, replies = store.drop(key)            # a flush is out: dropped once it is done
    assert known and replies == [] and key in store.replicas
    store.flush_done(jobs[0], None, 0.0)
    assert key not in store.replicas and store.memory_bytes == 0 and store.unflushed_bytes == 0
    assert store.take_flush_jobs(0.0) == [DropJob(key)]
    assert not store.idle()
    store.flush_done(DropJob(key), None, 0.0)
    assert store.idle() and store.stats()["replicas"] == 0
    assert store.drop(key) == (False, [])       # idempotent
    with pytest.raises(BadRequest):
        store.read(key, 0, 100)


def test_backup_disk_remove(tmp_path):
    from kera.backup import disk
    from kera.backup.meta import Meta
    from kera.backup.store import FlushJob
    c = chunk.encode(1, 0, 1, 0, [b"x"] * 2)
    key = (1, 2, 3)
    disk.run(tmp_path, FlushJob(key, 0, (memoryview(c),), Meta(1, 2, 3, len(c), True)))
    assert disk.scan(tmp_path)
    disk.run(tmp_path, DropJob(key))
    assert disk.scan(tmp_path) == [] and not list(Path(tmp_path).rglob("*.seg"))


@pytest.mark.parametrize("retention_ms", [0, MIN])
def test_retain_until_consumed_deletes_only_what_every_group_consumed(retention_ms):
    d = desc(retention_ms=retention_ms)
    d["retain_until_consumed"] = True
    b = broker(d)
    fill(b, 24, wall_ms=0)                      # groups 0..5, the last ones finished
    b.set_wall_clock(10 * MIN)
    b.retention.enforce(10 * MIN)
    assert b.reads.first_group(1, 0) == 0             # no marks yet: nothing consumed, nothing goes
    b.retention.set_consumed([[1, [3]]], 7)     # every consumer group is past groups 0..2
    b.retention.enforce(10 * MIN)
    assert b.reads.first_group(1, 0) == 3 and b.retention.consumed_at == 7
    b.retention.set_consumed([[1, [2]]], 8)     # marks never bring data back
    b.retention.enforce(10 * MIN)
    assert b.reads.first_group(1, 0) == 3
    with pytest.raises(BadRequest):
        b.retention.set_consumed([[1, "x"]], 9)


def test_retain_until_consumed_still_waits_for_retention_ms():
    d = desc(retention_ms=MIN)
    d["retain_until_consumed"] = True
    b = broker(d)
    fill(b, 24, wall_ms=0)
    b.retention.set_consumed([[1, [5]]], 1)
    b.set_wall_clock(MIN // 2)
    b.retention.enforce(MIN // 2)
    assert b.reads.first_group(1, 0) == 0             # consumed, but younger than retention_ms


# ---------------------------------------------------------------------- number floors

def test_a_slots_last_group_goes_once_the_coordinator_holds_where_its_numbering_goes_on():
    b = broker(desc(retention_ms=MIN, G=8, seg=64 * KiB))
    fill(b, 3, wall_ms=0)                       # records 0..11 in group 0
    assert b.enforce_retention(MIN) == 0        # closed by age, expired, but kept for now:
    assert b.retention.floors_to_send() == [[1, 0, 1, [12]]]   # first group 1, next number 12
    assert b.enforce_retention(MIN + 1) == 0    # not acknowledged yet: still kept
    acknowledge_floors(b)
    assert b.enforce_retention(MIN + 2) == 1 and b.retention.floors_to_send() == []
    fill(b, 1, start=3, wall_ms=2 * MIN)        # the same broker goes on by itself
    (err, n, groups), frames = fetch(b, 1)
    assert err is None and chunk.read_header(frames[0]).number == 12
    assert b.retention.floors_to_send() == []   # a slot holding a group needs no floor


def test_a_new_owner_of_an_emptied_streamlet_goes_on_from_its_floor():
    d = desc(G=8, seg=64 * KiB)
    b = broker({**d, "floors": [[0, 1, [12]]]})   # as the coordinator hands it over
    fill(b, 1, start=0, producer=7)
    (err, n, groups), frames = fetch(b, 1)
    header = chunk.read_header(frames[0])
    assert err is None and (header.group, header.number) == (1, 12)
    assert b.streams[1].streamlets[0].locks.floor == 11   # earlier locks: written just below


def test_floors_in_descriptors_are_checked():
    d = desc()
    for bad in ([[0, 1]], [[5, 1, [3]]], [[0, 1, [3, 4]]], [[0, -1, [3]]], "x"):
        with pytest.raises(BadRequest):
            StreamInfo.from_descriptor({**d, "floors": bad})


def test_only_a_slot_losing_its_last_group_waits_for_its_floor_and_only_once():
    b = broker(desc(retention_ms=MIN, Q=2, G=1, seg=4 * KiB))
    fill(b, 16, wall_ms=0, producer=2)          # slot 0 only (producer 2 % 2): slot 1 unused
    fill(b, 8, start=16, wall_ms=MIN, producer=2)
    assert b.enforce_retention(MIN + 1) > 0
    assert b.retention.floors_to_send() == []   # slot 0 keeps later groups; slot 1 had none
    fill(b, 2, start=0, wall_ms=2 * MIN, producer=3)   # slot 1: records 0..7, then idle
    fill(b, 8, start=24, wall_ms=3 * MIN, producer=2)  # slot 0 goes on
    left = len(b.streams[1].streamlets[0].groups)
    assert b.enforce_retention(3 * MIN + 1) > 0  # slot 0's old groups go; slot 1's last waits
    sent = b.retention.floors_to_send()
    assert sent == [[1, 0, 0, [0, 8]]]           # groups are left: no first group; slot 1: 8
    assert b.streams[1].streamlets[0].groups[0].slot == 1
    acknowledge_floors(b)
    assert b.enforce_retention(3 * MIN + 2) == 1  # now it goes
    fill(b, 8, start=32, wall_ms=4 * MIN, producer=2)
    assert b.enforce_retention(4 * MIN + 1) > 0  # slot 0 loses groups again, never its last
    assert b.retention.floors_to_send() == []    # nothing new for the coordinator
    assert left > len(b.streams[1].streamlets[0].groups) > 0
