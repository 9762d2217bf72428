"""The consumer's group membership task (kera.consumer.membership), sans-IO: it lets go of its
streamlets before its session can have ended at the coordinator, whatever the network does."""

import pytest

from kera.consumer.membership import (COMMIT_RETRY_FRACTION, RETRY_BACKOFF_S,
                                      SELF_FENCE_FRACTION, Membership)
from kera.consumer.tasks import TaskRunner
from kera.errors import NotLeader, StaleMemberEpoch, Timeout
from kera.codec.position import Position

SESSION_MS = 3000


class Parts:
    """A stand-in consumer: just the assignment (the Assignable interface)."""

    def __init__(self):
        self.held: set = set()

    def assign(self, parts, positions=None):
        self.held |= set(parts)

    def unassign(self, parts):
        self.held -= set(parts)
        return []

    def assignment(self):
        return sorted(self.held)

    def positions(self, parts=None):
        return []


def reply(parts, member="m1", epoch=1, interval_ms=1000):
    return ({"ok": True, "member_id": member, "member_epoch": epoch,
             "assignment": [list(p) for p in parts], "heartbeat_interval_ms": interval_ms}, [])


def joined(now=0.0):
    consumer = Parts()
    m = Membership(consumer, "coord:1", "g", ["s"], now, session_timeout_ms=SESSION_MS,
                   auto_commit_interval_ms=None)
    assert m.next_request(now)[1][0] == "group_heartbeat"
    m.on_reply(reply([("s", 0), ("s", 1)]), now)
    assert consumer.held == {("s", 0), ("s", 1)}
    return m, consumer


def test_a_member_whose_heartbeats_go_unanswered_drops_its_parts_in_time():
    m, consumer = joined()
    span = SELF_FENCE_FRACTION * SESSION_MS / 1000
    t = 1.0
    while t < span:                      # every heartbeat lost: timeouts only
        req = m.next_request(t)
        if req is not None:
            m.on_error(Timeout("lost"), t)
        assert consumer.held, f"dropped too early at {t}"
        t += 0.1
    m.next_request(span + 0.01)
    assert consumer.held == set() and m.member_id == ""       # fenced, rejoining
    assert span < SESSION_MS / 1000      # before the coordinator can expire it


def test_a_heartbeat_stuck_in_flight_does_not_delay_the_fence():
    m, consumer = joined()
    runner = TaskRunner(request_timeout_s=60.0)   # far longer than the session
    runner.add(m)
    [(task, address, op, fields)] = runner.requests(1.0)
    runner.sent(task, address, 7, 1.0)
    runner.requests(SELF_FENCE_FRACTION * SESSION_MS / 1000 + 0.01)
    assert consumer.held == set()


def test_a_reply_that_comes_after_the_fence_is_not_acted_on():
    m, consumer = joined()
    m.next_request(1.0)                  # heartbeat sent at 1.0
    late = 1.0 + SELF_FENCE_FRACTION * SESSION_MS / 1000 + 0.5
    m.check(late)
    assert consumer.held == set()
    m.on_reply(reply([("s", 0), ("s", 1)]), late)
    assert consumer.held == set()


def test_answered_heartbeats_keep_the_parts():
    m, consumer = joined()
    for t in range(1, 20):
        req = m.next_request(float(t))
        if req is not None:
            m.on_reply(reply([("s", 0), ("s", 1)]), t + 0.05)
    assert consumer.held == {("s", 0), ("s", 1)}


def test_the_runner_does_not_wake_for_a_task_whose_request_is_in_flight():
    m, _consumer = joined()
    runner = TaskRunner(request_timeout_s=5.0)
    runner.add(m)
    [(task, address, _op, _fields)] = runner.requests(1.0)
    runner.sent(task, address, 7, 1.0)
    # The beat is due (1.0) but in flight: the next wake is the fence or the timeout, not now.
    assert runner.next_wake(1.0) == min(1.0 + 5.0, m.check_wake(1.0))
    assert runner.next_wake(1.0) > 1.0


def test_held_until_is_the_self_fence_deadline_of_the_last_answered_heartbeat():
    m, _ = joined(now=0.0)
    span = SELF_FENCE_FRACTION * SESSION_MS / 1000
    assert m.held_until() == span                  # the join heartbeat was sent at 0
    m.next_request(1.0)                            # the next heartbeat, sent at 1.0 ...
    m.on_reply(reply([("s", 0), ("s", 1)]), 1.2)   # ... and answered
    assert m.held_until() == 1.0 + span            # counted from its sending, not its answer
    m.next_request(1.0 + span)                     # nothing answered since: fenced
    assert m.held_until() is None


AT = [Position("s", 0, 0, 5)]


def test_a_commit_failed_by_a_leader_change_is_retried_before_any_heartbeat():
    m, _consumer = joined()
    future = m.commit(AT)
    assert m.next_request(1.0)[1][0] == "group_commit"
    m.on_error(NotLeader("standing by"), 1.0)
    assert not future.done()
    assert m.next_request(1.0 + RETRY_BACKOFF_S / 2) is None      # backing off; no heartbeat
    assert m.next_wake(1.0) == pytest.approx(1.0 + RETRY_BACKOFF_S)
    retried = m.next_request(1.0 + RETRY_BACKOFF_S)
    assert retried[1][0] == "group_commit" and retried[1][1]["positions"] == [["s", 0, [[0, 5, None]]]]
    m.on_reply(({"ok": True}, []), 1.3)
    assert future.done() and future.exception() is None
    assert m.next_request(2.0)[1][0] == "group_heartbeat"


def test_commit_retries_end_within_their_share_of_the_session():
    m, _consumer = joined()
    future = m.commit(AT)
    t, tries = 1.0, 0
    while not future.done():
        req = m.next_request(t)
        if req is not None and req[1][0] == "group_commit":
            tries += 1
            m.on_error(Timeout("coordinator down"), t)
        t += RETRY_BACKOFF_S / 4
    assert isinstance(future.exception(), Timeout) and tries > 1
    assert t - 1.0 <= COMMIT_RETRY_FRACTION * SESSION_MS / 1000 + RETRY_BACKOFF_S
    assert t - 1.0 < SELF_FENCE_FRACTION * SESSION_MS / 1000   # heartbeats get their turn


def test_a_commit_refused_for_a_stale_epoch_fails_at_once():
    m, _consumer = joined()
    future = m.commit(AT)
    m.next_request(1.0)
    m.on_error(StaleMemberEpoch("moved on"), 1.0)
    assert isinstance(future.exception(), StaleMemberEpoch)


def test_a_group_refused_by_acl_is_reported_once_and_not_retried():
    from kera.errors import NotAuthorized
    failures = []
    m = Membership(Parts(), "coord:1", "g", ["s"], 0.0, session_timeout_ms=SESSION_MS,
                   auto_commit_interval_ms=None, on_fatal=failures.append)
    assert m.next_request(0.0) is not None
    m.on_error(NotAuthorized("principal 'client:c' may not read group 'g'"), 0.0)
    assert len(failures) == 1 and isinstance(failures[0], NotAuthorized)
    assert m.joined.exception() is failures[0]
    assert m.next_request(100.0) is None and m.next_wake(100.0) is None


def test_a_timeout_is_still_retried():
    failures = []
    m = Membership(Parts(), "coord:1", "g", ["s"], 0.0, session_timeout_ms=SESSION_MS,
                   auto_commit_interval_ms=None, on_fatal=failures.append)
    m.next_request(0.0)
    m.on_error(Timeout("lost"), 0.0)
    assert not failures and m.next_request(RETRY_BACKOFF_S + 0.01) is not None
