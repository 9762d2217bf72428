"""One FetchState for many streams: one request per broker, parts keyed by (stream, streamlet),
a sought part's in-flight read dropped, and lag arithmetic. Sans-IO."""

from kera.codec import chunk
from kera.config import STALL_PROBE_INTERVAL_S, STALL_PROBE_S
from kera.consumer import fetching
from kera.consumer.cursor import ChunkItem, FetchCursor, GroupInfo
from kera.consumer.fetching import FetchState
from kera.consumer.lag import lag_records, watermarks

IDS = {"a": 3, "b": 4}


def stamped(sid, sl, group, base, values):
    buf = bytearray(chunk.encode(1, 0, sid, sl, values))
    chunk.stamp(buf, group, 0, base)
    return bytes(buf)


def state(parts):
    return FetchState(dict(IDS), {p: FetchCursor(p[1]) for p in parts}, fetch_max_bytes=1 << 20,
                      request_timeout_s=1.0, idle_wait_s=0.005)


def one_broker(sid, sl):
    return "b1"


def test_every_part_of_every_stream_on_a_broker_rides_one_request():
    st = state([("a", 0), ("a", 1), ("b", 0)])
    reqs = st.build(0.0, one_broker)
    assert len(reqs) == 1
    broker, reads, parts = reqs[0]
    assert parts == [("a", 0), ("a", 1), ("b", 0)]
    assert [(r[0], r[1]) for r in reads] == [(3, 0), (3, 1), (4, 0)]


def test_reply_items_carry_their_stream():
    st = state([("a", 0), ("b", 0)])
    st.sent("b1", 1, [("a", 0), ("b", 0)], 0.0)
    frames = [stamped(3, 0, 0, 0, [b"x"]), stamped(4, 0, 0, 0, [b"y", b"z"])]
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 1, []], [None, 1, []]]},
                        frames, 0.0)
    assert [(type(i), i.stream, i.streamlet, i.count) for i in items] == [
        (ChunkItem, "a", 0, 1), (ChunkItem, "b", 0, 2)]


def test_chunk_of_the_other_stream_is_refused():
    st = state([("a", 0)])
    st.sent("b1", 1, [("a", 0)], 0.0)
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 1, []]]},
                        [stamped(4, 0, 0, 0, [b"y"])], 0.0)
    assert items == [] and st.cursors[("a", 0)].offsets == {}


def test_a_stalled_fetch_asks_for_owners_then_goes_to_the_new_one():
    st = FetchState(dict(IDS), {("a", 0): FetchCursor(0), ("b", 0): FetchCursor(0)},
                    fetch_max_bytes=1 << 20, request_timeout_s=10.0, idle_wait_s=0.005)
    st.sent("b1", 1, [("a", 0), ("b", 0)], 0.0)
    st.probe_stalled(STALL_PROBE_S / 2, one_broker)
    assert st.want_refresh == set(), "a healthy wait is not probed"
    st.probe_stalled(STALL_PROBE_S, one_broker)
    assert st.want_refresh == {"a", "b"} and "b1" in st.in_flight
    assert st.next_wake(STALL_PROBE_S) == STALL_PROBE_S + STALL_PROBE_INTERVAL_S
    moved = lambda sid, sl: "b9" if sid == IDS["a"] else "b1"   # noqa: E731  a failover moved "a"
    st.probe_stalled(STALL_PROBE_S + STALL_PROBE_INTERVAL_S, moved)
    assert "b1" not in st.in_flight
    reqs = {broker: parts for broker, _, parts in st.build(STALL_PROBE_S + 0.5, moved)}
    assert reqs == {"b9": [("a", 0)], "b1": [("b", 0)]}, "both fetched again, a from its new owner"
    late = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 1, []], [None, 1, []]]},
                       [stamped(3, 0, 0, 0, [b"x"]), stamped(4, 0, 0, 0, [b"y"])], 2.0)
    assert late == [], "the stalled request's late reply is ignored"


def test_read_in_flight_of_a_sought_or_removed_part_is_dropped():
    st = state([("a", 0), ("b", 0)])
    st.sent("b1", 1, [("a", 0), ("b", 0)], 0.0)
    st.set_cursor(("a", 0), FetchCursor(0, 0, {0: 5}))   # seek while the fetch is in flight
    st.remove(("b", 0))
    frames = [stamped(3, 0, 0, 0, [b"x"]), stamped(4, 0, 0, 0, [b"y"])]
    items = st.on_reply("b1", {"id": 1, "ok": True, "results": [[None, 1, []], [None, 1, []]]},
                        frames, 0.0)
    assert items == []
    assert st.cursors[("a", 0)].wire() == {"low": 0, "offsets": {0: 5}}
    assert ("b", 0) not in st.cursors


def test_more_parts_than_a_request_carries_are_read_in_turn(monkeypatch):
    monkeypatch.setattr(fetching, "FETCH_READS_MAX", 2)
    st = state([("a", 0), ("a", 1), ("b", 0)])
    seen = []
    for turn in range(3):
        (broker, reads, parts), = st.build(float(turn), one_broker)
        assert len(parts) == 2
        seen += parts
        st.sent(broker, turn, parts, float(turn))
        st.on_reply(broker, {"id": turn, "ok": True, "results": [[None, 0, []]] * 2}, [], float(turn))
    assert set(seen) == {("a", 0), ("a", 1), ("b", 0)}


def test_watermarks_and_lag_count_durable_records_of_retained_groups():
    groups = [GroupInfo(4, 0, 0, 10, True), GroupInfo(5, 1, 0, 7, False), GroupInfo(6, 0, 0, 3, False)]
    assert watermarks(groups) == (0, 20)
    assert lag_records(groups, 0, {}) == 20                 # a reader before the retained groups
    assert lag_records(groups, 5, {5: 2}) == 5 + 3          # group 4 consumed, 2 of group 5
    assert lag_records(groups, 7, {}) == 0


def test_a_timed_out_read_does_not_back_off_a_part_sought_since():
    st = state([("a", 0), ("b", 0)])
    st.sent("b1", 1, [("a", 0), ("b", 0)], 0.0)
    st.set_cursor(("a", 0), FetchCursor(0, 0, {0: 5}))
    st.expire(1.0)
    assert ("a", 0) not in st.retry_at and st.retry_at[("b", 0)] > 1.0
