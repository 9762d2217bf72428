"""Rebuilding a streamlet from recovered chunks (kera.broker.rebuild), without sockets: exact
positions whatever the arrival order, duplicates dropped, the cut rules at gaps, the
duplicate-detection table, readability, and the slot-to-log rule recovery relies on."""

import random

import pytest

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.broker.rebuild import StreamletRebuild, install
from kera.errors import NotReady

ME = 4
SID = 1
SEG = 64 * 1024


def desc(*, R=3, streamlets=1, Q=2, G=4, seg=SEG, recovering=None):
    d = {"name": "s", "id": SID, "streamlets": streamlets, "active_groups": Q,
         "replication": R, "group_segments": G, "segment_size_bytes": seg,
         "durability": "memory", "replication_capacity": 0, "placement": [ME] * streamlets,
         "brokers": {}, "version": 1, "ready": True}
    if recovering:
        d["recovering"] = recovering
    return d


def backups(*ids):
    return [{"id": i, "address": f"127.0.0.1:{9000 + i}", "node": f"n{i}", "alive": True} for i in ids]


def stamped(pid, seq, g, base, n=2, sl=0):
    """A chunk as the dead broker stored it: stamped with its group and base offset."""
    buf = bytearray(chunk.encode(pid, seq, SID, sl, [b"p%d-s%d-%d" % (pid, seq, i) for i in range(n)]))
    chunk.stamp(buf, g, 0, base)
    return bytes(buf)


def history(slots, per_slot_groups=2, chunks_per_group=3, n=2):
    """Chunks of producers 0..slots-1 (producer p in slot p with Q = slots), each filling
    `per_slot_groups` groups of its slot; groups are numbered in opening order."""
    out = []
    gid = 0
    for _ in range(per_slot_groups):
        for p in range(slots):
            seq0 = len([c for c in out if chunk.read_header(c).producer_id == p])
            for k in range(chunks_per_group):
                out.append(stamped(p, seq0 + k, gid, k * n, n))
            gid += 1
    return out


def rebuild_of(chunks, Q=2, durable=True):
    rb = StreamletRebuild(SID, 0, Q, 4, SEG)
    for c in chunks:
        rb.add(memoryview(c), chunk.read_header(c), durable)
    return rb


def core(**kw):
    b = Broker("node", BrokerConfig(virtual_logs=2), broker_id=ME)
    b.set_epoch(7)
    b.apply_metadata([desc(**kw)], 1)
    b.placement.set_backups(backups(1, 2, 3), 0.0)
    return b


def read_all(b, sl=0):
    """(group, base, producer, sequence) of every readable chunk, in group order."""
    out = []
    for g in b.streams[SID].streamlets[sl].groups:
        views, _, _ = g.read(0, 1 << 30, True, 1 << 20)
        out += [(g.id, h.base_offset, h.producer_id, h.sequence)
                for h in (chunk.read_header(c) for v in views for c in chunk.frame_chunks(v))]
    return out


def positions(chunks):
    return sorted((h.group, h.base_offset, h.producer_id, h.sequence)
                  for h in map(chunk.read_header, chunks))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_any_arrival_order_rebuilds_exact_positions_and_drops_copies(seed):
    print("seed", seed)
    rng = random.Random(seed)
    chunks = history(2)
    arrival = chunks + rng.sample(chunks, 5)   # a few copies from other replicas
    rng.shuffle(arrival)
    rb = rebuild_of(arrival)
    assert rb.duplicates == 5 and rb.pending_bytes == 0
    b = core()
    inst = install(b, rb)
    assert rb.dropped == 0 and inst.chunks == len(chunks)
    assert sorted(read_all(b)) == positions(chunks)
    groups = b.streams[SID].streamlets[0].groups
    assert all(g.closed and g.finished for g in groups)
    assert [g.slot for g in groups] == [0, 1, 0, 1]


def test_producer_table_is_rebuilt_so_retries_are_duplicates_and_new_chunks_go_on():
    chunks = history(2)
    b = core()
    install(b, rebuild_of(chunks))
    sl = b.streams[SID].streamlets[0]
    before = sum(g.head for g in sl.groups)
    # Producer 0 retries its last chunk and an older one: acknowledged, stored nothing.
    last = max(chunk.read_header(c).sequence for c in chunks if chunk.read_header(c).producer_id == 0)
    for seq in (last, 1):
        fresh = chunk.encode(0, seq, SID, 0, [b"retry"])
        assert b.produce(f"r{seq}", [fresh], 1.0) is not None
    assert sum(g.head for g in sl.groups) == before and b.duplicates == 2
    # Its next chunk is appended to a new group of its slot (recovered groups are closed).
    res = b.produce("n", [chunk.encode(0, last + 1, SID, 0, [b"new"])], 1.0)
    assert res is None   # waits for replication (R=3)
    assert sl.groups[-1].id == 4 and sl.groups[-1].slot == 0 and sl.groups[-1].head == 1
    # A gap is refused, retriable.
    out = b.produce("g", [chunk.encode(0, last + 5, SID, 0, [b"gap"])], 1.0)
    assert out[0][0] == "sequence_gap" and out[0][2] is True


def test_hole_inside_a_group_cuts_it_and_the_slots_later_groups():
    chunks = history(2)   # groups 0 (p0), 1 (p1), 2 (p0), 3 (p1), 3 chunks each
    lost = [c for c in chunks if (chunk.read_header(c).group, chunk.read_header(c).base_offset) == (0, 2)]
    rb = rebuild_of([c for c in chunks if c not in lost])
    b = core()
    install(b, rb)
    got = read_all(b)
    assert [(g, base) for g, base, p, _ in got if p == 0] == [(0, 0)]   # cut at the hole
    assert [(g, base) for g, base, p, _ in got if p == 1] == [(1, 0), (1, 2), (1, 4), (3, 0), (3, 2), (3, 4)]
    assert rb.dropped == 1 + 3   # the chunk after the hole, and group 2 of slot 0
    groups = b.streams[SID].streamlets[0].groups
    assert [g.head for g in groups] == [2, 6, 0, 6]   # group 2 kept as an empty placeholder
    assert all(g.finished for g in groups)


def test_missing_tail_of_a_group_detected_by_the_producers_sequence():
    chunks = history(2)
    # The last chunk of group 0 (producer 0, sequence 2) is on no replica; its successor
    # (sequence 3, first chunk of group 2) is: it was never acknowledged, and is dropped.
    rb = rebuild_of([c for c in chunks if (chunk.read_header(c).producer_id,
                                           chunk.read_header(c).sequence) != (0, 2)])
    b = core()
    install(b, rb)
    got = read_all(b)
    assert [s for _, _, p, s in got if p == 0] == [0, 1]
    assert [s for _, _, p, s in got if p == 1] == list(range(6))
    # The producer retries 2, 3, ... : appended again, in order.
    assert b.producers.get((0, SID, 0)).sequence == 1
    assert b.produce("a", [chunk.encode(0, 2, SID, 0, [b"x"])], 1.0) is None


def numbered(pid, seq, g, base, number, n=2):
    """`stamped`, with the record number of its first record, as version 3 chunks carry."""
    buf = bytearray(chunk.encode(pid, seq, SID, 0, [b"p%d-s%d-%d" % (pid, seq, i) for i in range(n)]))
    chunk.stamp(buf, g, 0, base, number)
    return bytes(buf)


def test_a_jump_in_a_slots_record_numbers_drops_its_later_groups():
    # One slot: group 0 holds p0 s0, p0 s1 and p1 s0 (records 0-5); group 1 holds p2 s0 (6-7).
    chunks = [numbered(0, 0, 0, 0, 0), numbered(0, 1, 0, 2, 2), numbered(1, 0, 0, 4, 4),
              numbered(2, 0, 1, 0, 6)]
    b = core(Q=1)
    install(b, rebuild_of(chunks, Q=1))
    assert len(read_all(b)) == 4                      # numbers follow on: everything is kept
    # Group 0's tail (p1 s0) is on no replica, and p1 sent nothing later: no sequence shows
    # the hole, but group 1's records numbered from 6 after 4 do. Group 1 was never durable.
    rb = rebuild_of(chunks[:2] + chunks[3:], Q=1)
    b = core(Q=1)
    install(b, rb)
    assert read_all(b) == [(0, 0, 0, 0), (0, 2, 0, 1)] and rb.dropped == 1
    assert b.producers.get((2, SID, 0)) is None       # p2 s0 is appended again, numbered 4
    assert b.produce("a", [chunk.encode(2, 0, SID, 0, [b"x"])], 1.0) is None


def test_a_number_jump_into_a_group_cut_at_a_hole_drops_that_group_too():
    # As above, and group 1 also lost its second chunk: the hole rule alone would keep its
    # first one, numbered 6 after group 0's 4.
    chunks = [numbered(0, 0, 0, 0, 0), numbered(0, 1, 0, 2, 2), numbered(1, 0, 0, 4, 4),
              numbered(2, 0, 1, 0, 6), numbered(2, 1, 1, 2, 8), numbered(2, 2, 1, 4, 10)]
    rb = rebuild_of([chunks[i] for i in (0, 1, 3, 5)], Q=1)
    b = core(Q=1)
    install(b, rb)
    assert read_all(b) == [(0, 0, 0, 0), (0, 2, 0, 1)] and rb.dropped == 2


def test_first_chunk_of_a_producer_missing_is_a_gap_too():
    chunks = history(1, per_slot_groups=2)   # one slot: groups 0 and 1, sequences 0..5
    rb = rebuild_of([c for c in chunks if chunk.read_header(c).sequence != 0], Q=1)
    b = core(Q=1)
    install(b, rb)
    assert read_all(b) == [] and b.streams[SID].streamlets[0].groups == []
    assert b.producers.get((0, SID, 0)) is None   # sequence 0 is appended again


def test_readable_at_once_only_while_enough_replicas_hold_it():
    chunks = history(1, per_slot_groups=1, chunks_per_group=4)
    rb = StreamletRebuild(SID, 0, 1, 4, SEG)
    for i, c in enumerate(chunks):
        rb.add(memoryview(c), chunk.read_header(c), durable=(i != 2))   # chunk 2: one copy left
    b = core(Q=1)
    inst = install(b, rb)
    [g] = b.streams[SID].streamlets[0].groups
    assert g.durable == 4 and g.head == 8 and not g.finished   # readable up to chunk 2
    assert inst.readable_records == 4 and not inst.replicated()
    # Once the broker's own replication is acknowledged, all of it is.
    for t in range(1, 5):
        for w in b.sync(float(t)):
            assert w.fields["vseg"] >> 32 == 7   # named with this incarnation's epoch
            b.write_done(w, {"length": w.end_bytes}, None, float(t))
    assert g.finished and inst.replicated()


def test_recovering_streamlet_answers_not_ready_and_a_cursor_past_the_end_is_out_of_range():
    b = core(recovering=[[0, [[9, 3]]]])
    b.recovering[(SID, 0)] = object()
    with pytest.raises(NotReady):
        b.reads.offsets(SID, 0)
    out = b.produce("t", [chunk.encode(1, 0, SID, 0, [b"x"])], 0.0)
    assert out[0][0] == "not_ready" and out[0][2] is True
    del b.recovering[(SID, 0)]
    install(b, rebuild_of(history(2, per_slot_groups=1)))
    results, _ = b.reads.fetch([[SID, 0, {"low": 5, "offsets": {}}, 1000]])
    assert results[0][0][0] == "offset_out_of_range"
    results, _ = b.reads.fetch([[SID, 0, {"low": 0, "offsets": {"7": 3}}, 1000]])
    assert results[0][0][0] == "offset_out_of_range"
    results, frames = b.reads.fetch([[SID, 0, {"low": 0, "offsets": {}}, 1 << 20]])
    assert results[0][0] is None and len(frames) > 0


def test_a_slots_groups_share_one_virtual_log_until_the_previous_is_durable():
    b = Broker("node", BrokerConfig(virtual_logs=4), broker_id=ME)
    b.apply_metadata([desc(Q=2, G=1, seg=1024)], 1)
    b.placement.set_backups(backups(1, 2, 3), 0.0)
    seqs = {0: 0, 1: 0}
    for i in range(12):
        p = i % 2
        b.produce(i, [chunk.encode(p, seqs[p], SID, 0, [b"x" * 300])], 0.0)
        seqs[p] += 1
    groups = b.streams[SID].streamlets[0].groups
    assert len(groups) >= 6
    by_slot = {}
    for g in groups:
        by_slot.setdefault(g.slot, set()).add(g.vlog.id)
    assert all(len(v) == 1 for v in by_slot.values()) and len(set.union(*by_slot.values())) == 2
    # Once the previous group is wholly durable there is no order left to keep: free choice.
    from kera.broker.placement import _slot_vlog
    last = groups[-1]
    prev = next(g for g in reversed(groups[:-1]) if g.slot == last.slot)
    stream = b.streams[SID]
    assert _slot_vlog(stream, last) is prev.vlog
    for t in range(1, 4):
        for w in b.sync(float(t)):
            b.write_done(w, {"length": w.end_bytes}, None, float(t))
    assert prev.finished and _slot_vlog(stream, last) is None
