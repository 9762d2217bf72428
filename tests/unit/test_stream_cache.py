"""The clients' sans-IO stream cache (kera.client.stream_cache) and coordinator list
(kera.net.coordinators): throttled, de-duplicated refreshes; replies applied; a standby's
not_leader or a timeout moves on to the next coordinator."""

from __future__ import annotations

import pytest

from kera.net.coordinators import CoordinatorList
from kera.errors import BadRequest, NotLeader, NotReady, Timeout, UnknownStream
from kera.client.stream_cache import StreamCache

TIMEOUT_S = 1.0
INTERVAL_S = 0.05


def descriptor(name="s", sid=7, owner=0, version=1):
    return {"name": name, "id": sid, "streamlets": 2, "placement": [owner, owner],
            "brokers": {str(owner): f"10.0.0.{owner + 1}:9000"}, "version": version}


def ok(req_id, **desc):
    return {"id": req_id, "ok": True, "stream": descriptor(**desc)}


def error(req_id, code, retriable):
    return {"id": req_id, "ok": False, "code": code, "message": code, "retriable": retriable}


def cache(bootstrap="a:1,b:2,c:3"):
    return StreamCache(CoordinatorList(bootstrap), TIMEOUT_S, INTERVAL_S)


def test_a_wanted_stream_is_asked_once_and_its_reply_applied():
    c = cache()
    c.want("s", 0.0)
    c.want("s", 0.0)
    reqs = c.requests(0.0)
    assert [(r.name, r.address, r.fields) for r in reqs] == [("s", "a:1", {"name": "s"})]
    c.sent(reqs[0], 11, 0.0)
    c.want("s", 0.01)
    assert c.requests(0.01) == [], "one request in flight per name"
    name, info = c.on_reply(ok(11), 0.02)
    assert name == "s" and info.id == 7 and c.address_of(7, 1) == "10.0.0.1:9000"
    assert c.on_reply(ok(11), 0.03) is None, "a reply is applied once"


def test_refreshes_are_throttled_not_dropped():
    c = cache()
    c.store(c.on_describe("s", ok(1), 1.0), 1.0)
    c.want("s", 1.01)
    assert c.requests(1.01) == [] and c.next_wake(1.01) == pytest.approx(1.0 + INTERVAL_S)
    assert [r.name for r in c.requests(1.0 + INTERVAL_S)] == ["s"]


def test_unknown_stream_forgets_it_and_a_garbled_reply_is_refused():
    c = cache()
    c.on_describe("s", ok(1), 0.0)
    with pytest.raises(UnknownStream):
        c.on_describe("s", error(2, "unknown_stream", False), 0.0)
    assert c.get("s") is None and c.address_of(7, 0) is None
    with pytest.raises(BadRequest):
        c.on_describe("t", ok(3), 0.0)   # described another stream


def test_not_leader_moves_on_and_asks_again():
    c = cache()
    c.want("s", 0.0)
    req = c.requests(0.0)[0]
    c.sent(req, 5, 0.0)
    name, err = c.on_reply(error(5, "not_leader", True), 0.01)
    assert isinstance(err, NotLeader) and c.coordinators.current == "b:2"
    assert [r.address for r in c.requests(0.01 + INTERVAL_S)] == ["b:2"]


def test_a_timed_out_request_is_asked_again_of_the_next_coordinator():
    c = cache()
    c.want("s", 0.0)
    c.sent(c.requests(0.0)[0], 5, 0.0)
    assert c.next_wake(0.5) == TIMEOUT_S
    again = c.requests(TIMEOUT_S)
    assert [(r.name, r.address) for r in again] == [("s", "b:2")]
    assert c.on_reply(ok(5), TIMEOUT_S + 0.1) is None, "the late reply is not ours any more"


def test_a_retriable_error_other_than_leadership_keeps_the_coordinator():
    c = cache()
    c.want("s", 0.0)
    c.sent(c.requests(0.0)[0], 5, 0.0)
    _, err = c.on_reply(error(5, "not_ready", True), 0.01)
    assert isinstance(err, NotReady) and c.coordinators.current == "a:1"


def test_coordinator_list_parses_and_rotates():
    lst = CoordinatorList("a:1, b:2")
    assert lst.addresses == ["a:1", "b:2"]
    assert lst.failed("a:1", Timeout("x")) and lst.current == "b:2"
    assert lst.failed("a:1", NotLeader("x")) and lst.current == "b:2", "a stale failure moves nothing"
    assert not lst.failed("b:2", BadRequest("x")) and lst.current == "b:2"
    with pytest.raises(BadRequest, match="host:port"):
        CoordinatorList("a:1,nope")


def test_every_known_stream_is_asked_again_once_its_descriptor_is_older_than_the_max_age():
    c = StreamCache(CoordinatorList("a:1"), TIMEOUT_S, INTERVAL_S, max_age_s=10.0)
    assert c.next_wake(0.0) is None                      # nothing known: nothing to do
    c.on_describe("s", ok(1), 0.0)
    c.on_describe("t", ok(2, name="t", sid=8), 4.0)
    assert c.next_wake(5.0) == pytest.approx(10.0)
    assert c.requests(9.9) == []
    reqs = c.requests(10.0)
    assert [r.name for r in reqs] == ["s"]               # only the one that aged
    c.sent(reqs[0], 3, 10.0)
    assert c.next_wake(10.0) == pytest.approx(min(10.0 + TIMEOUT_S, 14.0))
    c.on_reply(ok(3), 10.1)
    assert [r.name for r in c.requests(14.0)] == ["t"]
    assert c.next_wake(14.0) == pytest.approx(20.1)     # s, refreshed at 10.1, is next
    with pytest.raises(ValueError):
        StreamCache(CoordinatorList("a:1"), TIMEOUT_S, max_age_s=0)


def test_a_descriptor_is_due_exactly_when_the_next_wake_says_whatever_the_rounding():
    # 0.311667333986474 + 30 - 30 != 0.311667333986474 in floating point: a due check made
    # as `fetched <= now - max_age` left the name not due at its own wake time, forever.
    fetched = 0.311667333986474
    c = StreamCache(CoordinatorList("a:1"), TIMEOUT_S, INTERVAL_S, max_age_s=30.0)
    c.on_describe("s", ok(1), fetched)
    wake = c.next_wake(fetched)
    assert [r.name for r in c.requests(wake)] == ["s"]
    assert c.next_wake(wake) > wake
