"""subscribe() / unsubscribe() of a group member (kera.consumer.membership), sans-IO: what the
next heartbeat asks for, revocation with a commit before the leave, nothing held or asked
while unsubscribed, a rejoin for a new pattern, and confluent-kafka's "^" pattern entries."""

import pytest

from kera.codec.position import Position
from kera.consumer.membership import LEAVE_EPOCH, Membership, subscription
from kera.errors import BadRequest, NotLeader

from tests.unit.test_membership import SESSION_MS, reply


class Parts:
    """A stand-in consumer whose revoked parts have a position each."""

    def __init__(self):
        self.held: set = set()

    def assign(self, parts, positions=None):
        self.held |= set(parts)

    def unassign(self, parts):
        self.held -= set(parts)
        return [Position(s, sl, 0, 5) for s, sl in parts]

    def assignment(self):
        return sorted(self.held)

    def positions(self, parts=None):
        return []


def joined(streams=("a",), pattern=None, parts=(("a", 0), ("a", 1))):
    consumer = Parts()
    m = Membership(consumer, "coord:1", "g", list(streams), 0.0, pattern=pattern,
                   session_timeout_ms=SESSION_MS, auto_commit_interval_ms=None)
    m.next_request(0.0)
    m.on_reply(reply(parts), 0.0)
    assert consumer.held == set(parts)
    return m, consumer


def test_subscribe_sends_the_new_streams_at_once_and_the_revocation_is_committed():
    m, consumer = joined()
    m.subscribe(["b"], None, 0.1)
    _, (op, fields) = m.next_request(0.1)        # not waiting for the heartbeat interval
    assert op == "group_heartbeat" and fields["streams"] == ["b"]
    assert fields["member_id"] == "m1"           # the same member: the group rebalances
    m.on_reply(reply([("b", 0)], epoch=2), 0.2)  # a's parts revoked, b's granted
    assert consumer.held == {("b", 0)}
    _, (op, fields) = m.next_request(0.2)
    assert op == "group_commit" and fields["positions"] == [["a", 0, [[0, 5, None]]],
                                                           ["a", 1, [[0, 5, None]]]]


def test_unsubscribe_commits_leaves_and_then_asks_nothing():
    m, consumer = joined()
    m.unsubscribe(0.1)
    assert consumer.held == set()
    _, (op, fields) = m.next_request(0.1)
    assert op == "group_commit" and len(fields["positions"]) == 2   # before the leave
    m.on_reply(({"ok": True}, []), 0.15)
    _, (op, fields) = m.next_request(0.2)
    assert op == "group_heartbeat" and fields["member_epoch"] == LEAVE_EPOCH
    m.on_reply(({"ok": True}, []), 0.25)
    assert m.member_id == "" and m.next_wake(0.3) is None
    assert all(m.next_request(t) is None for t in (0.3, 5.0, 60.0))
    m.subscribe(["b"], None, 61.0)               # joins afresh
    _, (op, fields) = m.next_request(61.0)
    assert fields["member_id"] == "" and fields["member_epoch"] == 0 and fields["streams"] == ["b"]


def test_a_grant_answered_after_unsubscribe_is_not_taken():
    m, consumer = joined()
    m.next_request(1.0)                          # a heartbeat in flight ...
    m.unsubscribe(1.05)                          # ... when the application unsubscribes
    m.on_reply(reply([("a", 0), ("a", 1)]), 1.1)
    assert consumer.held == set()
    assert m.next_request(1.1)[1][0] == "group_commit"


def test_a_failed_leave_is_retried_then_given_up_to_the_session_timeout():
    m, _ = joined()
    m.unsubscribe(0.1)
    m.next_request(0.1)
    m.on_reply(({"ok": True}, []), 0.1)          # the commit
    m.next_request(0.2)
    m.on_error(NotLeader("moved"), 0.2)
    assert m.next_request(0.25) is None          # backing off
    assert m.next_request(0.5)[1][1]["member_epoch"] == LEAVE_EPOCH
    m.on_error(NotLeader("moved"), 2.9)          # past the session's self-fence margin
    assert m.member_id == "" and m.next_wake(3.0) is None


def test_a_new_pattern_leaves_and_joins_again_with_it():
    m, consumer = joined(streams=[], pattern="a.*")
    m.subscribe(["x"], "b.*", 0.1)
    assert consumer.held == set()
    m.next_request(0.1)                          # the revocation's commit
    m.on_reply(({"ok": True}, []), 0.1)
    assert m.next_request(0.2)[1][1]["member_epoch"] == LEAVE_EPOCH
    m.on_reply(({"ok": True}, []), 0.2)
    _, (op, fields) = m.next_request(0.2)
    assert fields["member_id"] == "" and fields["pattern"] == "b.*" and fields["streams"] == ["x"]


def test_a_member_created_without_a_subscription_waits_for_one():
    m = Membership(Parts(), "coord:1", "g", [], 0.0, session_timeout_ms=SESSION_MS)
    assert m.next_request(0.0) is None and m.next_wake(0.0) is None
    m.subscribe(["a"], None, 1.0)
    assert m.next_request(1.0)[1][1]["streams"] == ["a"]


def test_confluent_kafka_subscriptions():
    assert subscription("a") == (["a"], None)
    assert subscription(["a", "b", "a"]) == (["a", "b"], None)
    assert subscription(["a", "^logs-.*"]) == (["a"], "^logs-.*")
    assert subscription(["^x.*", "^y.*"]) == ([], "(?:^x.*)|(?:^y.*)")
    for bad in ([""], [None], ["^" + "x" * 300]):
        with pytest.raises(BadRequest):
            subscription(bad)
