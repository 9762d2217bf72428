"""A dead broker's streamlets recovered by their new owner (kera.broker.recovery) against real
replica stores (kera.backup.store) and the backup's fencing and filters
(kera.backup.incarnations), without sockets: list, read, rebuild, re-replicate, report;
another copy when one is damaged; what a new owner makes readable and when."""

import random

import pytest

from kera.codec import chunk
from kera.backup.incarnations import Incarnations, keep
from kera.backup.store import DiskRead, ReplicaStore
from kera.broker.core import Broker, BrokerConfig
from kera.broker.recovery import Recovery, reset_incarnation
from kera.errors import BadRequest, CorruptChunk, KeraError, NotReady, Timeout

SID = 1
DEAD, NEW = 0, 1          # broker ids
DEAD_EPOCH, NEW_EPOCH = 5, 9


def desc(owner, *, R=3, streamlets=2, Q=2, recovering=None, durability="memory"):
    d = {"name": "s", "id": SID, "streamlets": streamlets, "active_groups": Q, "replication": R,
         "group_segments": 2, "segment_size_bytes": 4096, "durability": durability,
         "replication_capacity": 0, "placement": [owner] * streamlets, "brokers": {},
         "version": 1, "ready": True}
    if recovering is not None:
        d["recovering"] = recovering
    return d


def backup_list(ids, alive=lambda i: True):
    return [{"id": i, "address": f"127.0.0.1:{9000 + i}", "node": f"n{i}", "alive": alive(i)}
            for i in ids]


class Backups:
    """Real replica stores behind a fake network: replication writes and recovery requests."""

    def __init__(self, ids=(1, 2, 3)):
        self.stores = {i: ReplicaStore() for i in ids}
        self.fences = {i: Incarnations(s) for i, s in self.stores.items()}
        self.dead: set[int] = set()
        self.corrupt: set[int] = set()   # backups whose reads fail verification
        self.reads: dict[int, int] = {i: 0 for i in ids}
        self.files: dict[tuple, bytes] = {}  # (backup, replica key) -> what its disk holds

    def replicate(self, broker, writes, now):
        for w in writes:
            bid = w.backup_id
            f = w.fields
            key = (f["broker_id"], f["vlog"], f["vseg"])
            if bid in self.dead:
                broker.write_done(w, None, Timeout("dead"), now)
                continue
            if self.fences[bid].blocked(key):
                broker.write_done(w, None, NotReady("fenced"), now)
                continue
            length = self.stores[bid].replicate(key, f["offset"], [bytes(x) for x in w.frames],
                                                f["durability"], f["close"], None, now)
            broker.write_done(w, {"length": length}, None, now)

    def serve(self, req):
        """(header, frames, error) for a recovery request."""
        bid = int(req.address.rsplit(":", 1)[1]) - 9000
        if bid in self.dead:
            return None, None, Timeout("dead")
        f = req.fields
        store = self.stores[bid]
        if req.op == "list_replicas":
            self.fences[bid].fence(f["broker_id"], f.get("fence", []))
            return {"replicas": store.list_replicas(f["broker_id"])}, [], None
        assert req.op == "read_replica"
        self.reads[bid] += 1
        if bid in self.corrupt:
            return None, None, CorruptChunk("damaged on disk")
        key = (f["broker_id"], f["vlog"], f["vseg"])
        try:
            chunks = store.read(key, f["offset"], f["max_bytes"])
        except KeraError as err:
            return None, None, err
        if isinstance(chunks, DiskRead):       # what the backup's disk reader would send
            chunks = whole_chunks(self.files[(bid, key)], f["offset"], f["max_bytes"])
        end = f["offset"] + sum(map(len, chunks))
        wanted = {tuple(x) for x in f["streamlets"]} if "streamlets" in f else None
        return {"end": end, "length": store.replicas[key].length}, keep(chunks, wanted), None


def dead_broker(backups, n_chunks=40, seed=1):
    """A broker that stored and replicated chunks of two producers in two streamlets."""
    b = Broker("a", BrokerConfig(virtual_logs=2, virtual_segment_bytes=2048), broker_id=DEAD)
    b.set_epoch(DEAD_EPOCH)
    b.apply_metadata([desc(DEAD)], 1)
    b.placement.set_backups(backup_list(backups.stores), 0.0)
    rng = random.Random(seed)
    seqs = {}
    for i in range(n_chunks):
        p, sl = rng.randrange(3), rng.randrange(2)
        seq = seqs.get((p, sl), 0)
        seqs[(p, sl)] = seq + 1
        b.produce(i, [chunk.encode(p, seq, SID, sl, [b"%d-%d-%d-%d" % (p, sl, seq, k) for k in range(5)])], 0.0)
        backups.replicate(b, b.sync(0.0), 0.0)
    return b, seqs


def contents(b, sl):
    """(group, base, bytes) of every readable chunk of a streamlet, attributes included."""
    out = []
    for g in b.streams[SID].streamlets[sl].groups:
        views, _, _ = g.read(0, 1 << 30, True, 1 << 20)
        out += [(g.id, chunk.read_header(c).base_offset, bytes(c))
                for v in views for c in chunk.frame_chunks(v)]
    return out


def new_owner(backups, alive=lambda i: True, durability="memory"):
    b = Broker("b", BrokerConfig(virtual_logs=2), broker_id=NEW)
    b.set_epoch(NEW_EPOCH)
    descs = [desc(NEW, recovering=[[0, [[DEAD, DEAD_EPOCH]]], [1, [[DEAD, DEAD_EPOCH]]]],
                  durability=durability)]
    b.apply_metadata(descs, 2)
    b.placement.set_backups(backup_list(backups.stores, alive), 1.0)
    rec = Recovery(b, read_bytes=1500)
    assert rec.apply(descs, 1.0)
    return b, rec


def run(b, rec, backups, now=2.0, steps=200, replicate=True, until_installed=False):
    """Drive requests and replication until every streamlet is reported (or installed)."""
    for _ in range(steps):
        if until_installed and not b.recovering:
            return
        for req in rec.take_requests(now):
            header, frames, error = backups.serve(req)
            rec.on_reply(req, header, frames, error, now)
        if replicate:
            backups.replicate(b, b.sync(now), now)
        due = rec.reports_due()
        if due:
            rec.reported(due, now)
        if not rec.active:
            return
        now += 0.01
    raise AssertionError(f"recovery did not finish: {rec.stats()}")


def test_recovery_rebuilds_every_streamlet_exactly_and_reports_once_re_replicated():
    backups = Backups()
    dead, seqs = dead_broker(backups)
    b, rec = new_owner(backups)
    assert set(b.recovering) == {(SID, 0), (SID, 1)}
    with pytest.raises(NotReady):
        b.reads.fetch([[SID, 0, {}, 100]]) and b.reads.offsets(SID, 0)
    assert rec.take_requests(1.5) == []          # waits for a fresh list of backups
    rec.set_backups(backup_list(backups.stores), 1.5)
    run(b, rec, backups)
    for sl in (0, 1):
        assert contents(b, sl) == contents(dead, sl) and contents(b, sl)
    assert not b.recovering and b.counters["recovery_dropped_chunks"] == 0
    # The duplicate-detection table came back: every producer's last chunk is a duplicate.
    for (p, sl), n in seqs.items():
        assert b.producers.get((p, SID, sl)).sequence == n - 1
    # Every recovered chunk is now also on R-1 backups under the new incarnation.
    for sl in (0, 1):
        for g in b.streams[SID].streamlets[sl].groups:
            assert g.finished
    new_replicas = [k for s in backups.stores.values() for k in s.replicas
                    if k[0] == NEW and k[2] >> 32 == NEW_EPOCH]
    assert new_replicas
    # The dead incarnation is fenced wherever it was listed.
    assert all(f.blocked((DEAD, 0, DEAD_EPOCH << 32)) for f in backups.fences.values())


def test_a_damaged_copy_is_skipped_for_another():
    backups = Backups()
    dead, _ = dead_broker(backups, seed=2)
    backups.corrupt.add(1)
    b, rec = new_owner(backups)
    rec.set_backups(backup_list(backups.stores), 1.5)
    run(b, rec, backups)
    assert backups.reads[1] > 0 and b.counters["recovery_read_failures"] > 0
    for sl in (0, 1):
        assert contents(b, sl) == contents(dead, sl)
    assert b.counters.get("recovery_bytes_unreadable", 0) == 0


def test_readable_at_once_with_r_minus_1_copies_else_after_re_replication():
    backups = Backups()
    dead, _ = dead_broker(backups, seed=3)
    b, rec = new_owner(backups)
    rec.set_backups(backup_list(backups.stores), 1.5)
    run(b, rec, backups, replicate=False, until_installed=True)   # nothing re-replicated yet
    assert rec.active and rec.reports_due() == []
    assert contents(b, 0) == contents(dead, 0)       # every chunk still on 2 backups: readable

    backups = Backups()
    dead, _ = dead_broker(backups, seed=3)
    backups.dead.add(2)                                # one copy of some segments is gone
    b, rec = new_owner(backups, alive=lambda i: i != 2)
    rec.set_backups(backup_list(backups.stores, lambda i: i != 2), 1.5)
    run(b, rec, backups, replicate=False, until_installed=True)
    readable = sum(g.durable for sl in (0, 1) for g in b.streams[SID].streamlets[sl].groups)
    total = sum(g.head for sl in (0, 1) for g in b.streams[SID].streamlets[sl].groups)
    assert readable < total                            # not on R copies yet
    backups.dead.clear()
    run(b, rec, backups)                               # re-replicated to the live backups
    for sl in (0, 1):
        assert contents(b, sl) == contents(dead, sl)


def whole_chunks(data: bytes, offset: int, max_bytes: int) -> list[bytes]:
    """The chunks of `data` from `offset` up to `max_bytes` (at least one)."""
    out, at = [], offset
    while at < len(data) and (not out or at + chunk.chunk_size(data, at) - offset <= max_bytes):
        out.append(data[at:at + chunk.chunk_size(data, at)])
        at += len(out[-1])
    return out


def flush_all(backups, now=1.0):
    """Each store writes what it holds to its disk (the flusher's work, kept by the fake)."""
    for bid, store in backups.stores.items():
        while jobs := store.take_flush_jobs(now + 10.0):
            for job in jobs:
                key = (bid, job.key)
                backups.files[key] = backups.files.get(key, b"") + b"".join(map(bytes, job.buffers))
                store.flush_done(job, None, now)


@pytest.mark.parametrize("flushed", [False, True])
def test_a_disk_streams_unflushed_replica_bytes_are_not_a_copy(flushed):
    backups = Backups()
    dead, _ = dead_broker(backups, seed=3)      # replicas in the backups' memory only
    if flushed:
        flush_all(backups)
    b, rec = new_owner(backups, durability="disk")
    rec.set_backups(backup_list(backups.stores), 1.5)
    run(b, rec, backups, replicate=False, until_installed=True)
    groups = [g for sl in (0, 1) for g in b.streams[SID].streamlets[sl].groups]
    total = sum(g.head for g in groups)
    readable = sum(g.durable for g in groups)
    # A backup acknowledges a "disk" write once flushed: bytes it holds only in memory would
    # be lost with it, so they wait for the new owner's own replication before anyone reads.
    assert total > 0 and readable == (total if flushed else 0)


def test_no_backup_answering_never_installs_an_empty_streamlet():
    backups = Backups()
    dead_broker(backups)
    backups.dead.update(backups.stores)
    b, rec = new_owner(backups)
    rec.set_backups(backup_list(backups.stores), 1.5)
    now = 2.0
    for _ in range(30):
        for req in rec.take_requests(now):
            rec.on_reply(req, *backups.serve(req), now)
        now += 1.0
    assert set(b.recovering) == {(SID, 0), (SID, 1)}   # still waiting, nothing invented
    assert b.counters["recovery_list_restarts"] >= 1


def test_reset_incarnation_forgets_replicated_streams_and_fails_waiting_produce_as_not_owner():
    backups = Backups()
    b, _ = dead_broker(backups, n_chunks=5)
    b.produce("late", [chunk.encode(9, 0, SID, 0, [b"x"])], 1.0)   # waits for replication
    reset_incarnation(b)
    replies = dict(b.take_replies())
    assert replies["late"].code == "not_owner" and replies["late"].retriable
    assert not b.streams and not b.vlog_list and len(b.producers) == 0


def test_reset_incarnation_keeps_unreplicated_streams_whole():
    # R=1 streamlets are not failed over (no replica holds them): they stay placed on their
    # broker, which keeps their records and producers through the reset.
    backups = Backups()
    b, _ = dead_broker(backups, n_chunks=5)
    r1 = {**desc(DEAD, R=1), "id": SID + 1, "name": "r1"}
    b.apply_metadata([desc(DEAD), r1], 2)
    records = [chunk.encode(4, seq, SID + 1, 0, [b"r1-%d" % seq]) for seq in range(3)]
    assert [r[0] for r in b.produce("r1", records, 1.0)] == [0, 0, 0]
    reset_incarnation(b)
    assert set(b.streams) == {SID + 1}
    results, frames = b.reads.fetch([[SID + 1, 0, {"low": 0, "offsets": {}}, 1 << 20]])
    assert results[0][0] is None
    assert sum(len(bytes(f)) for f in frames) == sum(len(r) for r in records)
    # A retried chunk is still recognised as a duplicate (the producer table kept it).
    assert b.produce("again", [records[2]], 2.0)[0][0] == 0
    assert b.stats()["chunks_appended"] - 5 == 3


def test_backup_filter_and_fence():
    store = ReplicaStore()
    inc = Incarnations(store)
    c1 = chunk.encode(1, 0, 1, 0, [b"a"])
    c2 = chunk.encode(1, 0, 1, 1, [b"b"])
    c3 = chunk.encode(1, 0, 2, 0, [b"c"])
    store.replicate((4, 0, 3 << 32), 0, [c1 + c2 + c3], "memory", False, None, 0.0)
    store.replicate((4, 0, 7 << 32), 0, [c1], "memory", False, None, 0.0)
    chunks = store.read((4, 0, 3 << 32), 0, 1 << 20)
    assert [bytes(c) for c in keep(chunks, {(1, 1), (2, 0)})] == [c2, c3]
    assert inc.held() == [[4, 3, 1, len(c1 + c2 + c3)], [4, 7, 1, len(c1)]]
    inc.fence(4, [3])
    assert inc.blocked((4, 5, 3 << 32 | 9)) and not inc.blocked((4, 0, 7 << 32))
    assert inc.free([[4, 3], ["bad"]]) == []
    assert list(store.replicas) == [(4, 0, 7 << 32)]
    with pytest.raises(BadRequest):
        from kera.backup.incarnations import parse_filter
        from kera.codec.wire import Fields
        parse_filter(Fields({"streamlets": [[1, "x"]]}))


def test_owner_dying_before_it_reported_is_recovered_from_both_incarnations():
    backups = Backups()
    dead, seqs = dead_broker(backups, seed=4)
    b, rec = new_owner(backups)
    rec.set_backups(backup_list(backups.stores), 1.5)
    run(b, rec, backups, replicate=False, until_installed=True)
    # It takes new chunks (replicated under its own epoch), then dies before reporting.
    for i, ((p, sl), n) in enumerate(sorted(seqs.items())):
        b.produce(f"n{i}", [chunk.encode(p, n, SID, sl, [b"after-%d" % i] * 3)], 3.0)
        seqs[(p, sl)] = n + 1
    backups.replicate(b, b.sync(3.0), 3.0)
    assert rec.active   # not reported: the coordinator still names the dead incarnation
    c = Broker("c", BrokerConfig(virtual_logs=2), broker_id=2)
    c.set_epoch(12)
    srcs = [[DEAD, DEAD_EPOCH], [NEW, NEW_EPOCH]]
    descs = [desc(2, recovering=[[0, srcs], [1, srcs]])]
    c.apply_metadata(descs, 3)
    c.placement.set_backups(backup_list(backups.stores), 4.0)
    rec2 = Recovery(c, read_bytes=2000)
    rec2.apply(descs, 4.0)
    rec2.set_backups(backup_list(backups.stores), 4.1)
    run(c, rec2, backups, now=5.0)
    for sl in (0, 1):
        assert contents(c, sl) == contents(b, sl)
    assert c.counters["recovery_duplicate_chunks"] > 0       # the same chunks from both
    assert c.counters["recovery_dropped_chunks"] == 0
    for (p, sl), n in seqs.items():
        assert c.producers.get((p, SID, sl)).sequence == n - 1


def test_passing_read_failures_are_retried_not_taken_for_lost_data():
    backups = Backups()
    dead, _ = dead_broker(backups, seed=5)
    b, rec = new_owner(backups)
    rec.set_backups(backup_list(backups.stores), 1.5)
    serve = backups.serve
    timeouts = {i: 2 for i in backups.stores}   # every backup times out twice first

    def flaky(req):
        bid = int(req.address.rsplit(":", 1)[1]) - 9000
        if req.op == "read_replica" and timeouts[bid] > 0:
            timeouts[bid] -= 1
            return None, None, Timeout("slow")
        return serve(req)

    backups.serve = flaky
    run(b, rec, backups, steps=2000)
    for sl in (0, 1):
        assert contents(b, sl) == contents(dead, sl)
    assert b.counters["recovery_read_failures"] == 6
    assert b.counters.get("recovery_bytes_unreadable", 0) == 0


def test_recovery_waits_for_a_settled_view_with_live_backups():
    backups = Backups()
    dead, _ = dead_broker(backups, seed=6)
    b, rec = new_owner(backups)
    # Right after a coordinator restart no backup has heartbeated yet: not a usable view.
    rec.set_backups(backup_list(backups.stores, lambda i: False), 1.5, settled=False)
    rec.set_backups(backup_list(backups.stores, lambda i: False), 1.6)
    assert rec.take_requests(2.0) == [] and b.counters["recovery_waits_for_backups"] >= 1
    assert set(b.recovering) == {(SID, 0), (SID, 1)}
    rec.set_backups(backup_list(backups.stores), 2.5, settled=False)   # ignored
    assert rec.take_requests(2.6) == []
    rec.set_backups(backup_list(backups.stores), 3.0)
    run(b, rec, backups, now=3.1)
    for sl in (0, 1):
        assert contents(b, sl) == contents(dead, sl)


def test_backups_the_coordinator_calls_dead_are_asked_too():
    # The coordinator may only be cut off from a backup that still holds the only copy.
    backups = Backups(ids=(1, 2))
    dead, _ = dead_broker(backups, seed=7)   # R=3 on two backups: each holds every segment
    b, rec = new_owner(backups)
    rec.set_backups(backup_list(backups.stores, lambda i: i != 2), 1.5)
    backups.dead.add(1)                      # and the one it calls alive does not answer
    now = 2.0
    for _ in range(400):
        for req in rec.take_requests(now):
            rec.on_reply(req, *backups.serve(req), now)
        if not b.recovering:
            break
        now += 0.5
    assert not b.recovering and backups.reads[2] > 0
    for sl in (0, 1):   # all there; readable once on R-1 backups again (one answers)
        heads = lambda br: [(g.id, g.head) for g in br.streams[SID].streamlets[sl].groups]
        assert heads(b) == heads(dead) and heads(b)


def test_recovery_phases_move_only_along_their_transitions():
    from kera.broker.recovery import TRANSITIONS, Job, Phase
    job = Job(1, 0.0, {}, {}, {})
    for phase in (Phase.LISTING, Phase.BACKUPS, Phase.LISTING, Phase.READING, Phase.INSTALLING,
                  Phase.REPLICATING, Phase.DONE):
        job.enter(phase)
    assert job.phase is Phase.DONE and not TRANSITIONS[Phase.DONE]
    with pytest.raises(AssertionError, match="done -> listing"):
        job.enter(Phase.LISTING)
    fresh = Job(2, 0.0, {}, {}, {})
    with pytest.raises(AssertionError):
        fresh.enter(Phase.READING)      # reading before listing: a bug
    assert set(TRANSITIONS) == set(Phase)
