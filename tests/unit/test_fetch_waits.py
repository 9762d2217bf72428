"""Held fetches (kera.broker.fetch_waits): a fetch that found nothing is held until records of
one of its streamlets become durable, or its deadline; and the consumer's side (FetchState):
when it asks to be held, and that a held empty reply is followed at once, not after the idle
back-off. Sans-IO."""

import pytest

from kera.broker.fetch_waits import FetchWaits
from kera.consumer.cursor import FetchCursor
from kera.consumer.fetching import FetchState
from tests.unit.test_broker_replication import FakeBackups, ack, broker, desc, make

A, B = (1, 0), (2, 0)   # (stream id, streamlet)


def test_a_held_fetch_is_released_once_by_records_of_one_of_its_streamlets():
    w = FetchWaits()
    assert w.park("f", frozenset({A, B}), deadline=10.0)
    w.wake(3, 0)
    assert w.take_ready() == [], "records of a streamlet it does not read"
    w.wake(*B)
    assert w.take_ready() == ["f"]
    assert w.watched == {}, "released from every streamlet it read, not only the one woken"
    w.wake(*A)
    w.expire(11.0)
    assert w.take_ready() == [], "released once"
    assert w.stats() == {"fetch_held": 1, "fetch_held_now": 0, "fetch_held_woken": 1,
                         "fetch_held_expired": 0}


def test_a_held_fetch_is_released_at_its_deadline_and_not_before():
    w = FetchWaits()
    w.park("early", frozenset({A}), deadline=1.0)
    w.park("late", frozenset({A}), deadline=2.0)
    w.expire(0.999)
    assert w.take_ready() == []
    w.expire(1.0)
    assert w.take_ready() == ["early"]
    w.wake(*A)
    assert w.take_ready() == ["late"]
    w.expire(3.0)
    assert w.take_ready() == [] and w.idle, "the woken one is not released again at its deadline"
    assert w.stats()["fetch_held_expired"] == 1 and w.stats()["fetch_held_woken"] == 1


def test_held_reads_are_bounded_and_a_fetch_past_the_bound_is_answered_at_once():
    w = FetchWaits(reads_max=3)
    assert w.park("two", frozenset({A, B}), 1.0)
    assert not w.park("two more", frozenset({(3, 0), (4, 0)}), 1.0)
    assert w.park("one", frozenset({(3, 0)}), 1.0)
    w.expire(1.0)
    assert sorted(w.take_ready()) == ["one", "two"]
    assert w.park("two more", frozenset({(3, 0), (4, 0)}), 2.0), "room again once released"
    assert not w.park("no reads", frozenset(), 2.0)


def _empty_fetch(b, sid):
    results, frames = b.reads.fetch([[sid, 0, {"low": 0, "offsets": {}}, 1 << 20]])
    assert frames == [] and results[0][0] is None
    return [[sid, 0, {"low": 0, "offsets": {}}, 1 << 20]]


def test_the_broker_releases_a_held_fetch_when_replicated_records_become_durable():
    b = broker(desc(1, R=3), desc(2, R=3), backups=(1, 2))
    fb = FakeBackups()
    assert b.reads.park_fetch("f", _empty_fetch(b, 1), deadline=5.0)
    b.produce("p2", [make(sid=2)], 0.0)
    ack(b, fb, b.sync(0.0))
    assert b.reads.take_ready_fetches(0.0) == [], "records of another stream"
    b.produce("p1", [make(sid=1)], 0.0)
    writes = b.sync(0.0)
    ack(b, fb, writes[:1])
    assert b.reads.take_ready_fetches(0.0) == [], "stored, but on one backup of two: not readable"
    ack(b, fb, writes[1:])
    assert b.reads.take_ready_fetches(0.0) == ["f"]
    results, frames = b.reads.fetch([[1, 0, {"low": 0, "offsets": {}}, 1 << 20]], again=True)
    assert len(frames) == 1 and b.stats()["fetch_requests"] == 1, "read again, counted once"


def test_the_broker_releases_a_held_fetch_of_an_unreplicated_stream_at_the_append():
    b = broker(desc(1, R=1))
    assert b.reads.park_fetch("f", _empty_fetch(b, 1), deadline=5.0)
    b.produce("p", [make()], 0.0)
    assert b.reads.take_ready_fetches(0.0) == ["f"]


def test_the_broker_answers_a_held_fetch_at_its_deadline():
    b = broker(desc(1, R=3), backups=(1, 2))
    b.reads.park_fetch("f", _empty_fetch(b, 1), deadline=5.0)
    assert b.reads.take_ready_fetches(4.9) == []
    assert b.reads.take_ready_fetches(5.0) == ["f"]
    assert b.stats()["fetch_held_expired"] == 1


def _state(max_wait_ms):
    return FetchState({"a": 3}, {("a", 0): FetchCursor(0)}, fetch_max_bytes=1 << 20,
                      request_timeout_s=1.0, idle_wait_s=0.005, max_wait_ms=max_wait_ms)


def test_a_consumer_asks_to_be_held_except_while_a_part_waits_to_learn_latest():
    st = _state(100)
    assert st.wait_ms([("a", 0)]) == 100
    st.to_latest.add(("a", 0))
    assert st.wait_ms([("a", 0)]) == 0, "its answer (the group table) is wanted now"
    assert _state(0).wait_ms([("a", 0)]) == 0


@pytest.mark.parametrize("held", [True, False])
def test_an_empty_held_reply_is_followed_at_once_and_an_unheld_one_after_the_back_off(held):
    st = _state(100)
    st.sent("b1", 7, [("a", 0)], 0.0, wait_ms=100)
    assert st.in_flight["b1"].deadline == pytest.approx(1.1), "not late until its wait is over"
    header = {"id": 7, "ok": True, "results": [[None, 0, []]], **({"held": True} if held else {})}
    assert st.on_reply("b1", header, [], 0.1) == []
    assert st.next_fetch_at.get("b1", 0.0) == (0.0 if held else pytest.approx(0.105))
    assert [broker for broker, _, _ in st.build(0.1, lambda sid, sl: "b1")] == (
        ["b1"] if held else [])
