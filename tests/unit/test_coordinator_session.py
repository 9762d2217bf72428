"""The coordinator session brokers and backups share (kera.daemon.coordinator_session), sans-IO: what
is due when, the timeouts, and what each answer means."""

import pytest

from kera import config
from kera.daemon.coordinator_session import (HEARTBEAT_MS_MAX, HEARTBEAT_MS_MIN, CoordinatorSession,
                                      Verdict)
from kera.errors import (BadRequest, Fenced, IdInUse, NotAuthorized, NotLeader, NotReady,
                         StorageError, Timeout, WrongCluster)
from kera.daemon.identity import Identity


def session(kind: str = "backup", daemon_id=None) -> CoordinatorSession:
    return CoordinatorSession(kind, "h:1", "n", Identity(), daemon_id)


def registered(s: CoordinatorSession, daemon_id: int = 4, interval_ms: int = 100,
               token: str = "t1") -> CoordinatorSession:
    assert s.due() == "register" and s.begin("register")
    assert s.answered("register", None, s.identity.token) is Verdict.OK
    s.identity.registered(daemon_id, token, "c" * 32)
    s.registered_as(daemon_id, interval_ms)
    return s


def test_registers_until_answered_then_heartbeats():
    s = session(daemon_id=3)
    assert s.due() == "register"
    fields = s.register_fields()
    assert fields["kind"] == "backup" and fields["address"] == "h:1" and fields["daemon_id"] == 3
    assert s.begin("register") and s.due() is None, "one register in flight at a time"
    assert s.answered("register", Timeout("lost"), None) is Verdict.UNREACHABLE
    assert s.due() == "register", "a register nobody answered is sent again"
    registered(s, daemon_id=3)
    assert s.due() == "heartbeat"
    assert s.heartbeat_fields() == {"kind": "backup", "daemon_id": 3, "token": "t1"}


def test_one_request_per_op_in_flight():
    s = registered(session())
    assert s.begin("heartbeat") and not s.begin("heartbeat") and s.due() is None
    assert s.begin("cluster"), "another op is not held back"
    s.answered("heartbeat", None, "t1")
    assert s.due() == "heartbeat" and s.heartbeats == 1


def test_two_lost_heartbeats_do_not_outlast_the_dead_window():
    interval = config.HEARTBEAT_INTERVAL_S
    s = registered(session(), interval_ms=round(interval * 1000))
    # Each lost heartbeat is given up after its timeout; the next goes at the following tick.
    sent_at = 0.0
    for _ in range(2):
        assert s.due() == "heartbeat" and s.begin("heartbeat")
        assert s.answered("heartbeat", Timeout("lost"), "t1") is Verdict.UNREACHABLE
        sent_at += s.timeout_s("heartbeat") + interval
    assert s.due() == "heartbeat"
    assert sent_at + interval < config.HEARTBEAT_MISSED_MAX * interval
    assert s.timeout_s("heartbeat") <= 3 * interval <= s.timeout_s("register")


def test_the_heartbeat_interval_and_timeout_follow_the_coordinator():
    s = session()
    assert registered(s, interval_ms=50).heartbeat_interval_s == 0.05
    assert abs(s.timeout_s("heartbeat") - 0.15) < 1e-9
    assert s.registered_as(4, 100) and not s.registered_as(4, 100), "changed, then the same"


@pytest.mark.parametrize("interval_ms", [HEARTBEAT_MS_MIN - 1, HEARTBEAT_MS_MAX + 1, None])
def test_an_interval_out_of_bounds_keeps_the_daemons_own(interval_ms):
    s = session()
    assert not s.registered_as(4, interval_ms)
    assert s.heartbeat_interval_s == config.HEARTBEAT_INTERVAL_S and s.registered


@pytest.mark.parametrize("error", [Timeout("x"), NotLeader("x"), Fenced("x")])
def test_no_answer_or_a_standby_is_unreachable(error):
    s = registered(session())
    s.begin("heartbeat")
    assert s.answered("heartbeat", error, "t1") is Verdict.UNREACHABLE
    assert s.registered and s.due() == "heartbeat"


@pytest.mark.parametrize("error", [IdInUse("x"), WrongCluster("x"), NotAuthorized("x")])
def test_a_refused_identity_is_fatal_and_nothing_more_is_sent(error):
    s = registered(session())
    s.begin("heartbeat")
    assert s.answered("heartbeat", error, "t1") is Verdict.FATAL
    assert s.fatal and s.due() is None and not s.begin("cluster")


def test_a_forgotten_daemon_registers_again_under_its_id():
    s = registered(session(), daemon_id=9)
    s.begin("heartbeat")
    assert s.answered("heartbeat", NotReady("unknown backup id 9"), "t1") is Verdict.REGISTER
    assert s.due() == "register" and s.register_fields()["daemon_id"] == 9


def test_a_refusal_of_the_previous_incarnations_token_is_stale():
    s = registered(session(), token="old")
    s.begin("heartbeat")
    s.identity.registered(4, "new", "c" * 32)   # registered again meanwhile
    assert s.answered("heartbeat", IdInUse("x"), "old") is Verdict.STALE
    assert not s.fatal and s.registered


@pytest.mark.parametrize("op,error", [("heartbeat", BadRequest("version never issued")),
                                      ("heartbeat", StorageError("x")),
                                      ("register", NotReady("x"))])
def test_other_errors_are_for_the_daemon(op, error):
    s = registered(session())
    s.begin(op)
    assert s.answered(op, error, "t1") is Verdict.REFUSED
    assert s.registered
