"""The consumer's cursors and fetch bookkeeping: sans-IO, driven with stamped chunks."""

import pytest

from kera.codec import chunk
from kera.consumer.cursor import (ChunkItem, ConsumedCursor, ErrorItem, FetchCursor, GroupInfo,
                                  LowItem, cursors_from_positions, parse_groups)
from kera.consumer.fetching import FetchState
from kera.errors import BadRequest
from kera.codec.position import Position

SID = 3


def stamped(sl, group, base, values, sid=SID, seq=0):
    buf = bytearray(chunk.encode(1, seq, sid, sl, values))
    chunk.stamp(buf, group, 0, base)
    return bytes(buf)


def header(sl, group, base, n):
    return chunk.read_header(stamped(sl, group, base, [b"x"] * n))


# --------------------------------------------------------------------------- FetchCursor

def test_fetch_cursor_skips_records_before_a_resumed_offset():
    c = FetchCursor(0, 0, {0: 7})
    assert c.on_chunk(header(0, 0, 5, 4)) == 2      # records 5, 6 skipped; 7, 8 new
    assert c.offsets == {0: 9}
    assert c.on_chunk(header(0, 0, 5, 4)) is None   # nothing new in it any more
    assert c.on_chunk(header(0, 1, 0, 3)) == 0      # a group not in offsets starts at 0
    assert c.wire() == {"low": 0, "offsets": {0: 9, 1: 3}}


def test_fetch_cursor_moves_low_over_closed_groups_read_to_their_end():
    c = FetchCursor(0, 0, {0: 10, 1: 4, 2: 1})
    assert c.on_groups([GroupInfo(0, 0, 0, 10, True), GroupInfo(1, 1, 0, 5, True),
                        GroupInfo(2, 0, 0, 1, False)]) == 1
    assert c.wire() == {"low": 1, "offsets": {1: 4, 2: 1}}
    assert c.on_groups([GroupInfo(1, 1, 0, 5, True)]) is None  # group 1 not read to its end
    c.on_chunk(header(0, 1, 4, 1))
    assert c.on_groups([GroupInfo(1, 1, 0, 5, True), GroupInfo(2, 0, 0, 1, False)]) == 2
    assert c.on_chunk(header(0, 0, 0, 1)) is None  # a group below low is finished


def test_cursor_at_end_for_latest():
    c = FetchCursor.at_end(0, [GroupInfo(0, 0, 0, 8, True), GroupInfo(1, 1, 0, 3, False),
                               GroupInfo(2, 0, 0, 5, False)])
    assert (c.low, c.offsets) == (1, {1: 3, 2: 5})
    assert FetchCursor.at_end(0, []).wire() == {"low": 0, "offsets": {}}


def test_parse_groups_validates():
    assert parse_groups([[0, 0, 0, 5, False]]) == [GroupInfo(0, 0, 0, 5, False)]
    for bad in ([[0, 0, 0, 5]], [[0, 0, 0, -1, False]], [[0, 0, 0, 5, 1]], "x", [[0, 0, "0", 5, True]]):
        with pytest.raises(BadRequest):
            parse_groups(bad)


# --------------------------------------------------------------------------- ConsumedCursor

def test_consumed_positions_list_every_group_from_low_up():
    c = ConsumedCursor(2, 1, {0: 9, 1: 4})
    assert c.offsets == {1: 4}  # groups below low are finished
    c.consumed(3, 6)
    assert c.positions("s") == [Position("s", 2, 1, 4), Position("s", 2, 2, 0), Position("s", 2, 3, 6)]
    assert c.positions("s", partial=(1, 5))[0] == Position("s", 2, 1, 5)
    c.finished_below(3)
    assert c.positions("s") == [Position("s", 2, 3, 6)]
    assert ConsumedCursor(0, 4).positions("s") == [Position("s", 0, 4, 0)]


def test_positions_round_trip_into_cursors():
    c = ConsumedCursor(2, 1, {1: 4, 3: 6})
    d = ConsumedCursor(0, 0, {})
    starts = cursors_from_positions(c.positions("s") + d.positions("s"), "s")
    assert starts == {2: (1, {1: 4, 2: 0, 3: 6}), 0: (0, {0: 0})}
    with pytest.raises(BadRequest):
        cursors_from_positions([Position("other", 0, 0, 0)], "s")


# --------------------------------------------------------------------------- FetchState

def state(streamlets=(0, 1, 2), fetch_max=1 << 20):
    return FetchState({"s": SID}, {("s", sl): FetchCursor(sl) for sl in streamlets},
                      fetch_max_bytes=fetch_max,
                      request_timeout_s=1.0, idle_wait_s=0.005)


OWNERS = {0: "b1", 1: "b2", 2: "b1"}


def P(sl):
    return ("s", sl)


def address_of(sid, sl):
    assert sid == SID
    return OWNERS.get(sl)


def test_build_one_fetch_per_broker_with_each_streamlet_cursor():
    st = state()
    reqs = {b: (reads, sls) for b, reads, sls in st.build(0.0, address_of)}
    assert reqs["b1"][1] == [P(0), P(2)] and reqs["b2"][1] == [P(1)]
    assert reqs["b1"][0][0] == [SID, 0, {"low": 0, "offsets": {}}, (1 << 20) // 2]
    for b, (_, sls) in reqs.items():
        st.sent(b, 10, sls, 0.0)
    assert st.build(0.0, address_of) == []  # one fetch in flight per broker


def test_reply_becomes_chunk_items_and_low_moves_in_order():
    st = state(streamlets=(0, 2))
    st.sent("b1", 7, [P(0), P(2)], 0.0)
    frames = [stamped(0, 0, 0, [b"a", b"b"]), stamped(0, 0, 2, [b"c"]) + stamped(0, 1, 0, [b"d"])]
    reply = {"id": 7, "ok": True, "results": [
        [None, 2, [[0, 0, 0, 3, True], [1, 0, 0, 1, False]]],
        [None, 0, []]]}
    items = st.on_reply("b1", reply, frames, 0.0)
    assert [type(i) for i in items] == [ChunkItem, ChunkItem, ChunkItem, LowItem]
    assert [i.chunk.values() for i in items[:3]] == [[b"a", b"b"], [b"c"], [b"d"]]
    assert [(i.group, i.first, i.end) for i in items[:3]] == [(0, 0, 2), (0, 2, 3), (1, 0, 1)]
    assert items[3] == LowItem(P(0), 1)
    assert st.cursors[P(0)].wire() == {"low": 1, "offsets": {1: 1}}
    assert st.on_reply("b1", reply, frames, 0.0) == []  # a repeated / late reply is ignored


def test_empty_reply_backs_off_that_broker():
    st = state(streamlets=(1,))
    st.sent("b2", 1, [P(1)], 0.0)
    assert st.on_reply("b2", {"id": 1, "ok": True, "results": [[None, 0, []]]}, [], 0.0) == []
    assert st.build(0.001, address_of) == []
    assert len(st.build(0.006, address_of)) == 1


def test_corrupt_chunk_does_not_move_the_cursor():
    st = state(streamlets=(0,))
    st.sent("b1", 1, [P(0)], 0.0)
    bad = bytearray(stamped(0, 0, 0, [b"a"]))
    bad[-1] ^= 1
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 2, []]]},
                        [stamped(0, 0, 0, [b"z"]), bytes(bad)], 0.0)
    assert items == []
    assert st.cursors[P(0)].wire() == {"low": 0, "offsets": {}}
    assert st.retry_at[P(0)] > 0.0


def test_read_errors_retry_refresh_or_surface():
    st = state()
    st.sent("b1", 1, [P(0), P(2)], 0.0)
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [
        [["not_owner", "moved", True], 0, []],
        [["offset_out_of_range", "past the end", False], 0, []]]}, [], 0.0)
    assert st.want_refresh == {"s"} and st.retry_at[P(0)] > 0.0
    assert len(items) == 1 and isinstance(items[0], ErrorItem)
    assert items[0].error.code == "offset_out_of_range" and "streamlet 2" in items[0].error.message
    assert st.fatal and st.build(10.0, address_of) == []


def test_timeout_and_unreachable_broker_are_retried():
    st = state(streamlets=(0,))
    st.sent("b1", 1, [P(0)], 0.0)
    st.expire(0.5)
    assert "b1" in st.in_flight
    st.expire(1.0)
    assert "b1" not in st.in_flight and st.want_refresh == {"s"}
    st.send_failed("b1", [P(0)], 2.0)
    assert st.retry_at[P(0)] > 2.0 and not st.fatal


def test_malformed_reply_is_not_trusted():
    st = state(streamlets=(0, 2))
    st.sent("b1", 1, [P(0), P(2)], 0.0)
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 5, []], [None, 0, []]]},
                        [stamped(0, 0, 0, [b"a"])], 0.0)
    assert items == [] and st.cursors[P(0)].wire()["offsets"] == {}


def test_chunk_of_another_streamlet_is_rejected():
    st = state(streamlets=(0,))
    st.sent("b1", 1, [P(0)], 0.0)
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 1, []]]},
                        [stamped(1, 0, 0, [b"a"])], 0.0)
    assert items == [] and st.cursors[P(0)].offsets == {}
