"""kera local's supervisor (kera.cli.supervisor): restarts after a doubling back-off, starts
over after a healthy run, gives up on a daemon that keeps failing or refuses its flags."""

from kera.cli.supervisor import (QUICK_RESTARTS_MAX, RESTART_BACKOFF_MAX_S,
                                 RESTART_BACKOFF_MIN_S, STABLE_RUN_S, USAGE_EXIT_CODE, Supervisor)


def crash_and_restart(s: Supervisor, now: float) -> float:
    """Crash 'broker-0' at `now`; returns when its restart fell due (and restarts it then)."""
    s.exited("broker-0", -9, now)
    assert s.waiting("broker-0") and s.due(now) == []
    t = now
    while not s.due(t):
        t += 0.25
    s.started("broker-0", t)
    return t - now


def test_back_off_doubles_on_quick_failures_up_to_its_max():
    s = Supervisor()
    s.started("broker-0", 0.0)
    waits, now = [], 0.0
    for _ in range(6):
        wait = crash_and_restart(s, now)
        waits.append(wait)
        now += wait + 1.0
    assert waits[0] == RESTART_BACKOFF_MIN_S
    assert waits == [min(RESTART_BACKOFF_MIN_S * 2 ** i, RESTART_BACKOFF_MAX_S) for i in range(6)]


def test_a_healthy_run_starts_the_back_off_over():
    s = Supervisor()
    s.started("broker-0", 0.0)
    crash_and_restart(s, 1.0)
    crash_and_restart(s, 5.0)
    assert crash_and_restart(s, 5.0 + STABLE_RUN_S + 10) == RESTART_BACKOFF_MIN_S


def test_a_daemon_that_keeps_failing_is_given_up():
    s = Supervisor()
    s.started("broker-0", 0.0)
    now = 0.0
    for _ in range(QUICK_RESTARTS_MAX):
        now += crash_and_restart(s, now) + 0.5
    assert "failed" in s.exited("broker-0", 1, now)
    assert s.due(now + 10 * RESTART_BACKOFF_MAX_S) == []


def test_a_daemon_refusing_its_command_line_is_not_restarted():
    s = Supervisor()
    s.started("backup-0", 0.0)
    assert "command line" in s.exited("backup-0", USAGE_EXIT_CODE, 3.0)
    assert s.due(1000.0) == []
