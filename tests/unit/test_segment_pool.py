"""The segment pool: memory of segments that left memory is reused for new ones, only once no
view of it (a reply or replication frame not sent yet) is alive, within its byte bound; and a
broker whose retention deletes groups appends the next groups into the same memory, reading
back exactly the new chunks."""

import gc

import pytest
import zmq

from kera.broker.segment import Segment
from kera.broker.segment_pool import SegmentPool, in_use

from kera.codec import chunk
from tests.unit.test_retention_core import acknowledge_floors, broker, desc, fill
from tests.unit.test_tier import broker as tier_broker, make, read_all, run_jobs

KiB = 1024


def test_a_given_back_buffer_is_reused_for_the_same_capacity_only():
    pool = SegmentPool(1 << 20)
    buf = pool.take(64 * KiB)
    assert (pool.fresh, pool.reused) == (1, 0)
    pool.give(buf)
    other = pool.take(128 * KiB)                 # another capacity: new memory
    assert other is not buf and len(other) == 128 * KiB
    assert pool.take(64 * KiB) is buf
    assert (pool.fresh, pool.reused, pool.bytes) == (2, 1, 0)


@pytest.mark.parametrize("view", ["slice", "zmq frame"])
def test_a_buffer_still_viewed_is_not_reused_until_the_view_is_gone(view):
    pool = SegmentPool(1 << 20)
    buf = pool.take(64 * KiB)
    mv = memoryview(buf)
    held = mv[100:200] if view == "slice" else zmq.Frame(mv[100:200])
    del mv
    pool.give(buf)
    assert in_use(buf)
    assert pool.take(64 * KiB) is not buf        # still viewed: new memory instead
    assert pool.stats()["waiting"] == 1
    del held
    gc.collect()
    assert pool.take(64 * KiB) is buf


def test_the_pool_keeps_at_most_its_bound_dropping_the_oldest_free_first():
    pool = SegmentPool(2 * 64 * KiB)
    a, b, c = (pool.take(64 * KiB) for _ in range(3))
    pool.give(a)
    pool.give(b)
    pool.take(128 * KiB)                          # collects a and b as free
    pool.give(c)                                  # full: a, the oldest free, goes
    assert pool.bytes == 2 * 64 * KiB
    assert {id(pool.take(64 * KiB)), id(pool.take(64 * KiB))} == {id(b), id(c)}
    assert pool.bytes == 0


def test_a_full_pool_of_viewed_buffers_lets_a_new_one_go():
    pool = SegmentPool(64 * KiB)
    a, b = pool.take(64 * KiB), pool.take(64 * KiB)
    held = memoryview(a)[:10]
    pool.give(a)
    pool.give(b)                                 # no free buffer to drop: b is not kept
    assert pool.bytes == 64 * KiB and pool.stats()["waiting"] == 1
    del held


def test_a_pool_of_zero_bytes_keeps_nothing_and_a_negative_one_is_refused():
    pool = SegmentPool(0)
    pool.give(pool.take(4 * KiB))
    assert pool.bytes == 0 and pool.take(4 * KiB) is not None and pool.reused == 0
    with pytest.raises(ValueError, match="segment pool size"):
        SegmentPool(-1)


def test_a_segment_gives_its_memory_back_once_and_a_reused_one_holds_only_its_chunks():
    pool = SegmentPool(1 << 20)
    old = Segment(None, 0, 4 * KiB, pool)
    old.mv[:4 * KiB] = b"\xee" * (4 * KiB)       # stale bytes a reuse must never show
    memory = old.memory
    old.release()
    old.release()                                # twice: still given back only once
    assert pool.bytes == 4 * KiB and old.released
    new = Segment(None, 1, 4 * KiB, pool)
    assert new.memory is memory and pool.bytes == 0
    assert new.used_bytes == 0 and len(new) == 0


def test_retention_deletes_groups_and_the_next_groups_reuse_their_memory():
    b = broker(desc(retention_bytes=8 * KiB))    # one-segment groups of 4 KiB, 4 chunks each
    fill(b, 16)                                  # groups 0..3
    assert b.stats()["segment_pool_fresh"] >= 4
    acknowledge_floors(b)
    assert b.enforce_retention(1) >= 1
    fresh = b.stats()["segment_pool_fresh"]
    fill(b, 8, start=16)                         # groups 4 and 5
    stats = b.stats()
    assert stats["segment_pool_reused"] >= 1 and stats["segment_pool_fresh"] < fresh + 2
    chunks = read_all(b, low=b.reads.first_group(1, 0))   # each verified: no stale byte shows
    assert [chunk.read_header(c).sequence for c in chunks][-8:] == list(range(16, 24))


def test_segments_written_to_disk_give_their_memory_to_the_next_segments(tmp_path):
    b = tier_broker(tmp_path, 64 * KiB)
    for seq in range(200):                       # several times the memory budget
        b.produce(seq, [make(seq)], 0.0)
        run_jobs(b, tmp_path)
    stats = b.stats()
    assert stats["tier_writes"] > 10 and stats["segment_pool_reused"] > 10
    assert len(read_all(b)) == 200               # from disk and from reused memory alike
