"""Groups: dense offsets, closing when full, reads of whole durable chunks."""

import pytest

from kera.codec import chunk
from kera.broker.group import Group


def make(n, seq=0, value=b"x" * 10):
    return chunk.encode(1, seq, 2, 0, [value] * n)


def fill(group, counts):
    locs = []
    for seq, n in enumerate(counts):
        c = make(n, seq)
        locs.append(group.append(c, len(c), n))
    return locs


def test_offsets_are_dense_and_stamped():
    g = Group(3, 1, max_segments=4, segment_size_bytes=4096)
    locs = fill(g, [2, 5, 1])
    assert g.head == 8 and g.durable == 0
    bases = [seg.bases[i] for seg, i in locs]
    assert bases == [0, 2, 7]
    h = chunk.verify(locs[1][0].view(locs[1][1]))
    assert (h.group, h.segment, h.base_offset, h.record_count) == (3, 0, 2, 5)


def test_full_group_closes_and_refuses_the_chunk():
    one = make(4)
    g = Group(0, 0, max_segments=2, segment_size_bytes=2 * len(one))
    locs = fill(g, [4, 4, 4, 4])
    assert [seg.number for seg, _ in locs] == [0, 0, 1, 1]
    assert list(g.seg_bases) == [0, 8]
    assert not g.closed
    assert g.append(one, len(one), 4) is None
    assert g.closed and g.head == 16
    with pytest.raises(AssertionError):
        g.append(one, len(one), 4)


FRAMES = 1 << 20   # no bound on the views of a read


def bases_read(g, offset, max_bytes=1 << 20, at_least_one=True, max_frames=FRAMES):
    """Base offsets of the chunks a read returns, and (views, bytes, chunks)."""
    views, nbytes, count = g.read(offset, max_bytes, at_least_one, max_frames)
    bases = [chunk.read_header(c).base_offset for v in views for c in chunk.frame_chunks(v)]
    assert count == len(bases) and nbytes == sum(len(v) for v in views)
    return bases, views


def test_read_never_passes_the_durable_head():
    g = Group(0, 0, max_segments=8, segment_size_bytes=3 * len(make(3)))
    fill(g, [3] * 10)   # several segments
    assert len(g.segments) > 1
    assert g.read(0, 1 << 20, True, FRAMES) == ([], 0, 0)
    g.set_durable(9)
    assert bases_read(g, 0)[0] == [0, 3, 6]
    g.set_durable(30)
    assert bases_read(g, 0)[0] == list(range(0, 30, 3))


def test_chunks_back_to_back_in_memory_go_as_one_view_per_segment():
    g = Group(0, 0, max_segments=8, segment_size_bytes=3 * len(make(3)))
    fill(g, [3] * 10)   # 3 chunks per segment: 4 segments
    g.set_durable(30)
    bases, views = bases_read(g, 3)
    assert bases == list(range(3, 30, 3)) and len(views) == 4
    bases, views = bases_read(g, 3, max_frames=2)   # the view bound stops at a segment's end
    assert bases == list(range(3, 18, 3)) and len(views) == 2


def test_read_from_the_middle_of_a_chunk_returns_that_chunk():
    g = Group(0, 0, max_segments=8, segment_size_bytes=3 * len(make(3)))
    fill(g, [3] * 10)
    g.set_durable(30)
    assert bases_read(g, 14)[0][0] == 12
    assert g.read(30, 1 << 20, True, FRAMES) == ([], 0, 0)


def test_read_budget_and_at_least_one():
    g = Group(0, 0, max_segments=8, segment_size_bytes=4096)
    fill(g, [3] * 6)
    g.set_durable(18)
    size = len(make(3))
    assert len(bases_read(g, 0, 2 * size)[0]) == 2
    assert len(bases_read(g, 0, 2 * size + 1)[0]) == 2
    assert len(bases_read(g, 0, 1)[0]) == 1
    assert g.read(0, 1, False, FRAMES) == ([], 0, 0)


def test_durable_head_never_passes_head_and_waiters_fire_in_order():
    g = Group(0, 0, max_segments=2, segment_size_bytes=4096)
    fill(g, [2, 2, 2])
    assert g.wait(4, "b") and g.wait(2, "a") and g.wait(6, "c")
    assert g.set_durable(3) == ["a"]
    assert g.set_durable(6) == ["b", "c"]
    assert not g.wait(6, "late")  # already durable
    with pytest.raises(AssertionError):
        g.set_durable(7)


def test_describe_reports_closed_only_once_wholly_durable():
    one = make(1)
    g = Group(5, 2, max_segments=1, segment_size_bytes=len(one))
    fill(g, [1])
    assert g.append(one, len(one), 1) is None and g.closed
    assert g.describe() == [5, 2, 0, 0, False]
    g.set_durable(1)
    assert g.describe() == [5, 2, 0, 1, True]
