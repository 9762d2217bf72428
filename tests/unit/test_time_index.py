"""Seeking by time (kera.broker.time_index): the first offset whose timestamp is >= T, per group,
exact for unordered timestamps, across segments, compressed chunks, and only durable records."""

import random

import pytest

from kera.codec import chunk
from kera.broker.group import Group
from kera.broker.streamlet import Streamlet
from kera.broker.time_index import IndexBudget, group_offset_at, streamlet_cursor_at
from kera.errors import NotReady


def append(group, timestamps, seq=0, compression=None):
    c = chunk.encode(1, seq, 2, 0, [b"v"] * len(timestamps), timestamps=timestamps,
                     compression=compression)
    assert group.append(c, len(c), len(timestamps)) is not None


def group_of(batches, segment_size_bytes=1 << 20, durable=True, compression=None):
    g = Group(0, 0, max_segments=64, segment_size_bytes=segment_size_bytes)
    for seq, ts in enumerate(batches):
        append(g, ts, seq, compression)
    if durable:
        g.set_durable(g.head)
    return g


def at(group, t):
    return group_offset_at(group, t, IndexBudget())


def expected(all_ts, t):
    """Kafka's answer by brute force: the first offset whose timestamp is >= t, else the end."""
    return next((i for i, ts in enumerate(all_ts) if ts >= t), len(all_ts))


def test_ordered_timestamps_at_between_and_beyond():
    g = group_of([[10, 20, 30], [40, 50], [60]])
    assert [at(g, t) for t in (0, 10, 11, 30, 31, 60, 61)] == [0, 0, 1, 2, 3, 5, 6]


def test_unordered_timestamps_give_the_earliest_offset_at_or_after():
    rng = random.Random(7)
    batches = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6))] for _ in range(40)]
    flat = [t for b in batches for t in b]
    # Small segments: the answer spans segment boundaries.
    g = group_of(batches, segment_size_bytes=400)
    assert len(g.segments) > 3
    for t in range(-1, 1002, 7):
        assert at(g, t) == expected(flat, t), t


def test_compressed_chunks_are_indexed():
    g = group_of([[5, 6], [7, 8]], compression="zstd")
    assert at(g, 7) == 2


def test_only_durable_records_are_seen_and_the_index_grows_with_appends():
    g = group_of([[10, 20]], durable=False)
    g.set_durable(0)
    assert at(g, 15) == 0                    # nothing durable: the durable end
    g.set_durable(2)
    assert at(g, 15) == 1
    append(g, [30, 40], seq=1)
    assert at(g, 35) == 2                    # appended, not durable yet
    g.set_durable(g.head)
    assert at(g, 35) == 3
    assert len(g.time_index.running_max_us) == 2


def test_a_rebuilt_group_gets_a_new_index():
    g = group_of([[10], [20], [30]], segment_size_bytes=200)
    assert at(g, 25) == 2
    del g.segments[1:], g.seg_bases[1:]                   # what recovery's truncation does
    g.head = g.durable = 1
    assert at(g, 25) == 1


def test_streamlet_cursor_skips_finished_groups_wholly_before_t():
    sl = Streamlet(2, 0, active_groups=1, group_segments=1, segment_size_bytes=300)
    for seq, ts in enumerate([[10, 11], [12, 13], [14, 15], [16, 17], [18, 19]]):
        c = chunk.encode(1, seq, 2, 0, [b"v" * 40] * 2, timestamps=ts)
        sl.append(c, len(c), 2, producer_id=1)
    for g in sl.groups:
        g.set_durable(g.head)
    # One chunk per group (a segment holds one): group k holds timestamps 10+2k, 11+2k.
    assert [g.head for g in sl.groups] == [2] * 5
    assert streamlet_cursor_at(sl, 15) == (2, {2: 1})      # groups 0, 1: finished, before
    assert streamlet_cursor_at(sl, 14) == (2, {})
    assert streamlet_cursor_at(sl, 0) == (0, {})
    # Beyond the last record: the open last group at its end.
    assert streamlet_cursor_at(sl, 100) == (4, {4: 2})


def test_empty_streamlet_cursor():
    sl = Streamlet(2, 0, active_groups=2, group_segments=1, segment_size_bytes=300)
    assert streamlet_cursor_at(sl, 5) == (0, {})


def test_indexing_work_per_request_is_bounded_and_resumes():
    g = group_of([[10], [20], [30], [40], [50]])
    for indexed in (2, 4):
        with pytest.raises(NotReady, match="ask again"):
            group_offset_at(g, 45, IndexBudget(chunks=2))
        assert len(g.time_index.running_max_us) == indexed   # kept for the next request
    assert group_offset_at(g, 45, IndexBudget(chunks=2)) == 4
    assert group_offset_at(g, 45, IndexBudget(chunks=0)) == 4  # all indexed: no work left
    big = group_of([[1] * 50, [2] * 50])
    with pytest.raises(NotReady):
        group_offset_at(big, 2, IndexBudget(nbytes=100))       # a chunk's bytes count too
