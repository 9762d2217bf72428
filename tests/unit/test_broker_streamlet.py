"""Streamlets: slots by producer, groups created lazily and densely, full groups replaced."""

from kera.codec import chunk
from kera.broker.streamlet import Streamlet


class Listener:
    def __init__(self):
        self.events = []

    def group_opened(self, g):
        self.events.append(("open", g.id, g.slot))

    def group_closed(self, g):
        self.events.append(("close", g.id, g.slot))


def make(producer, seq, n=2):
    return chunk.encode(producer, seq, 4, 0, [b"abc"] * n)


def put(sl, producer, seq, n=2):
    c = make(producer, seq, n)
    return sl.append(c, len(c), n, producer)


def test_producer_goes_to_slot_p_mod_q_and_groups_open_lazily():
    lis = Listener()
    sl = Streamlet(4, 0, active_groups=3, group_segments=4, segment_size_bytes=4096, listener=lis)
    assert sl.groups == []
    g, _, _ = put(sl, 7, 0)       # 7 % 3 == 1
    assert (g.id, g.slot) == (0, 1)
    g2, _, _ = put(sl, 3, 0)      # slot 0
    assert (g2.id, g2.slot) == (1, 0)
    g3, _, _ = put(sl, 10, 0)     # slot 1 again: same group as producer 7
    assert g3 is g
    assert lis.events == [("open", 0, 1), ("open", 1, 0)]


def test_full_group_is_closed_and_replaced_in_its_slot():
    lis = Listener()
    size = len(make(1, 0))
    sl = Streamlet(4, 0, active_groups=2, group_segments=2, segment_size_bytes=size, listener=lis)
    groups = [put(sl, 1, s)[0].id for s in range(5)]
    assert groups == [0, 0, 1, 1, 2]
    assert sl.groups[0].closed and sl.groups[1].closed and not sl.groups[2].closed
    assert ("close", 0, 1) in lis.events and ("open", 2, 1) in lis.events
    assert sl.groups[2].head == 2  # offsets restart at 0 in a new group
    assert [g.id for g in sl.groups] == [0, 1, 2]


def test_find_chunk_scans_the_producer_slot_newest_first():
    sl = Streamlet(4, 0, active_groups=2, group_segments=8, segment_size_bytes=4096)
    for s in range(4):
        put(sl, 2, s)
        put(sl, 4, s)   # same slot (even), interleaved
        put(sl, 1, s)   # other slot
    g, seg, i, seq = sl.find_chunk(2, None, 100)
    assert seq == 3 and chunk.read_header(seg.view(i)).producer_id == 2
    g, seg, i, seq = sl.find_chunk(4, 1, 100)
    assert seq == 1 and seg.bases[i] == 2 * 2 * 1 + 2   # chunks of 2 records: p2s0 p4s0 p2s1 p4s1
    assert sl.find_chunk(9, None, 100) is None
    assert sl.find_chunk(2, 0, 2) is None   # scan bound reached
