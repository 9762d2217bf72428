"""Offsets and batch planning: exact, resumable, canonical; slot order; record budgets."""

import json

import pytest

from kera.spark import offsets as ko
from kera.spark.offsets import Cursor, GroupInfo


def G(g, slot=0, end=0, closed=False, start=0):
    return GroupInfo(g, slot, start, end, closed)


def records(start, end, infos=None):
    """Every (group, offset) a batch [start, end) reads."""
    return [(g, o) for g, s, e in ko.plan(start, end, infos) for o in range(s, e)]


def test_json_round_trip_is_canonical():
    c = Cursor(11, {3: 7, 1: 2, 10: 0})
    so = ko.StreamOffset(9, {2: c, 0: Cursor()})
    text = json.dumps(ko.to_json({"b": so, "a": so}))
    assert text.index('"a"') < text.index('"b"')
    back = ko.from_json(json.loads(text))
    assert back["a"].cursors[2] == c and back["a"].stream_id == 9
    assert json.dumps(ko.to_json(back)) == text
    # group keys ordered numerically: 1, 3, 10
    assert list(ko.to_json({"a": so})["a"]["streamlets"]["2"]["groups"]) == ["1", "3", "10"]


def test_cursor_positions():
    c = Cursor(4, {1: 10, 3: 0})
    assert c.position(0) is None      # below next and unlisted: finished
    assert c.position(1) == 10
    assert c.position(2) is None
    assert c.position(3) == 0
    assert c.position(4) == 0         # not seen yet: from its start
    assert c.position(99) == 0


@pytest.mark.parametrize("bad", [
    {"next": -1}, {"groups": {"0": -3}}, {"groups": {"x": 1}}, {"next": 1, "oops": 2}, [1, 2],
    {"groups": {"0": 1.5}}, {"next": True}])
def test_malformed_cursor_rejected(bad):
    with pytest.raises((ValueError, TypeError)):
        Cursor.from_json(bad)


def test_cursor_from_json_raises_next_over_listed_groups():
    assert Cursor.from_json({"groups": {"4": 2}}).next == 5


def test_advance_reads_every_durable_record_once_across_batches():
    infos = [G(0, 0, 5, closed=True), G(1, 0, 3)]
    c0 = Cursor()
    c1 = ko.advance(c0, infos)
    assert records(c0, c1) == [(0, i) for i in range(5)] + [(1, i) for i in range(3)]
    # group 0 finished in this batch: still listed at its end, so planning needs no lookup
    assert c1.groups == {0: 5, 1: 3} and c1.next == 2
    # nothing new: the next batch drops the finished group, then the offset is stable
    c2 = ko.advance(c1, infos)
    assert records(c1, c2) == [] and c2.groups == {1: 3}
    assert ko.advance(c2, infos) == c2
    # more data, a new group of another slot
    infos = [G(0, 0, 5, closed=True), G(1, 0, 6), G(2, 1, 2)]
    c3 = ko.advance(c2, infos)
    assert records(c2, c3) == [(1, 3), (1, 4), (1, 5), (2, 0), (2, 1)]


def test_slot_order_later_group_waits_for_earlier_one():
    # slot 0: group 0 still open (durable 4), group 2 cannot exist yet in practice, but if
    # the earlier group is not finished the later one must not advance.
    infos = [G(0, 0, 4, closed=False), G(1, 1, 3), G(2, 0, 7)]
    c = ko.advance(Cursor(), infos)
    assert c.groups[0] == 4 and c.groups[1] == 3 and c.groups[2] == 0


def test_budget_shares_records_and_keeps_slot_order():
    infos = [G(0, 0, 10, closed=True), G(1, 1, 10), G(2, 0, 10)]
    start = Cursor()
    seen = []
    cur = start
    for _ in range(20):
        nxt = ko.advance(cur, infos, max_records=7)
        batch = records(cur, nxt)
        assert len(batch) <= 7
        seen += batch
        if nxt == cur:
            break
        cur = nxt
    assert sorted(seen) == sorted({(g, o) for g in range(3) for o in range(10)})
    assert len(seen) == 30
    # group 2 (slot 0) is only read after group 0 (slot 0) is complete
    first2 = seen.index((2, 0))
    assert all(seen.index((0, o)) < first2 for o in range(10))


def test_budget_always_makes_progress():
    infos = [G(0, 0, 1), G(1, 1, 1), G(2, 2, 1)]
    c = ko.advance(Cursor(), infos, max_records=1)
    assert len(records(Cursor(), c)) == 1


def test_share():
    assert ko.share({"a": 10, "b": 30}, 8) == {"a": 2, "b": 6}
    assert ko.share({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}
    assert ko.share({"a": 3}, 10) == {"a": 3}
    assert sum(ko.share({"a": 7, "b": 5, "c": 0}, 11).values()) == 11


def test_cap_limits_to_target_and_ignores_new_groups():
    infos = [G(0, 0, 5)]
    target = ko.latest(infos)
    later = [G(0, 0, 9), G(1, 1, 4)]
    c = ko.advance(Cursor(), later, cap=target)
    assert records(Cursor(), c) == [(0, i) for i in range(5)]
    assert ko.advance(c, later, cap=target) == c


def test_earliest_latest_and_truncated_groups():
    infos = [G(0, 0, 5, closed=True, start=2), G(1, 0, 3)]
    assert ko.earliest(infos) == Cursor(0, {0: 2})
    assert ko.latest(infos) == Cursor(2, {0: 5, 1: 3})
    assert records(ko.latest(infos), ko.advance(ko.latest(infos), infos)) == []
    assert ko.check_loss(Cursor(), infos, "s/0") == ["s/0 group 0 records [0, 2) are gone"]
    assert ko.check_loss(Cursor(3, {0: 1}), infos, "x")
    assert ko.check_loss(Cursor(3, {7: 1}), infos, "x") == ["x group 7 is gone"]
    assert ko.check_loss(Cursor(0, {0: 4}), infos, "x") == []


def test_plan_user_end_with_finished_group_reads_to_its_final_offset():
    start, end = Cursor(0, {}), Cursor(2, {1: 2})
    infos = [G(0, 0, 4, closed=True), G(1, 1, 9)]
    assert records(start, end, infos) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    with pytest.raises(ValueError):
        ko.plan(start, Cursor(2, {0: 1}), [G(0, 0, 4, closed=True), G(1, 1, 9)])  # 1 still open
    # a group the broker no longer has (failOnDataLoss=false): nothing to read
    assert ko.plan(Cursor(2, {0: 1, 1: 3}), ko.advance(Cursor(2, {0: 1, 1: 3}), [G(1, 1, 9)]),
                   [G(1, 1, 9)]) == [(1, 3, 9)]


def test_parse_boundary():
    assert ko.parse_boundary("earliest", ["a"], ko.LATEST) == {"a": {"*": ko.EARLIEST}}
    spec = ko.parse_boundary('{"a": {"0": -1, "2": {"next": 1, "groups": {"0": 4}}}}', ["a", "b"], ko.EARLIEST)
    assert spec["a"][0] == ko.LATEST and spec["a"][2] == Cursor(1, {0: 4})
    assert ko.resolve(spec["a"], 1, [G(0, 0, 3)]) == Cursor(0, {})
    assert ko.resolve(spec["b"], 0, [G(0, 0, 3)]) == Cursor(0, {})
    with pytest.raises(ValueError):
        ko.parse_boundary('{"zzz": {}}', ["a"], ko.EARLIEST)
    with pytest.raises(ValueError):
        ko.parse_boundary("yesterday", ["a"], ko.EARLIEST)


def test_group_infos_validates_broker_reply():
    assert ko.group_infos([[1, 0, 0, 3, True], [0, 1, 0, 2, False]])[0].group == 0
    for bad in ([[0, 0, 0]], [[0, 0, 5, 3, False]], [[-1, 0, 0, 0, False]], ["x"]):
        with pytest.raises(Exception):
            ko.group_infos(bad)


def test_a_cursor_as_consumer_group_positions():
    # Nothing read yet, or every group below `next` finished: the next group from 0.
    assert ko.group_positions(Cursor(), []) == [[0, 0, None]]
    assert ko.group_positions(Cursor(3, {}, 5), []) == [[3, 0, 5]]
    # Open groups listed as they are, and one above `next`.
    assert ko.group_positions(Cursor(2, {0: 40, 1: 7}), None) == [[0, 40, None], [1, 7, None]]
    # Group 1 finished (unlisted) between open group 0 and group 2: listed at its end.
    c = Cursor(3, {0: 40, 2: 9}, 4)
    assert ko.finished_below_next(c) and not ko.finished_below_next(Cursor(2, {0: 40, 1: 7}))
    infos = [G(0, 0, 50), G(1, 1, 120, closed=True), G(2, 1, 30)]
    assert ko.group_positions(c, infos) == [[0, 40, 4], [1, 120, 4], [2, 9, 4]]
