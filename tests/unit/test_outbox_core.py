"""The outbox harvester's sans-IO core: per-key order, in-flight bounds, reset, checkpoints."""

import pytest

from kera.errors import BadRequest, KeraError, NotOwner, RecordTooLarge, Timeout

from kera.services.outbox.core import (ROW_ID_HEADER, Flight, Row, record_headers, refused, row_id_of,
                              settle_suspects)


def rows(*pairs):
    return [Row(i, key, b"v%d" % i) for i, key in pairs]


def flight(in_flight_max=10, marked_max=100, checkpoint_interval_s=60.0):
    return Flight(in_flight_max, marked_max, checkpoint_interval_s, now=0.0)


def test_one_row_in_flight_per_key_in_id_order():
    f = flight()
    f.add(rows((3, "a"), (1, "a"), (2, "b"), (4, "b")))
    assert [r.id for r in f.next_sends()] == [1, 2]   # heads of a and b only
    assert f.next_sends() == []
    f.acked(2)
    assert [r.id for r in f.next_sends()] == [4]
    f.acked(1)
    assert [r.id for r in f.next_sends()] == [3]


def test_rows_marked_later_queue_behind_the_key_in_flight():
    f = flight()
    f.add(rows((1, "a")))
    assert [r.id for r in f.next_sends()] == [1]
    f.add(rows((5, "a")))
    assert f.next_sends() == []
    f.acked(1)
    assert [r.id for r in f.next_sends()] == [5]


def test_in_flight_bounded_overall():
    f = flight(in_flight_max=2)
    f.add(rows((1, "a"), (2, "b"), (3, "c")))
    assert [r.id for r in f.next_sends()] == [1, 2]
    f.acked(1)
    assert [r.id for r in f.next_sends()] == [3]


def test_only_refusals_of_the_record_itself_are_known_unpublished():
    assert refused(RecordTooLarge("too big")) and refused(BadRequest("bad"))
    assert not refused(Timeout("no answer")) and not refused(NotOwner("moved"))
    assert not refused(KeraError("retries exhausted"))


def test_stepping_down_drops_the_unsent_rows_and_keeps_those_in_flight():
    f = flight()
    f.add(rows((1, "a"), (2, "a"), (3, "b"), (4, "c")))
    f.next_sends()                                 # 1, 3 and 4 in flight
    assert f.drop_unsent() == [2]
    assert f.held == 3 and f.next_sends() == []
    f.acked(1)
    assert f.next_sends() == []                    # row 2 is gone
    f.acked(3), f.acked(4)
    assert f.idle


def test_mark_room_bounded_by_rows_held():
    f = flight(in_flight_max=2, marked_max=5)
    assert f.mark_room(1.0) == 5
    f.add(rows((1, "a"), (2, "a"), (3, "b")))
    f.next_sends()
    assert f.mark_room(1.0) == 2
    f.acked(1)
    assert f.mark_room(1.0) == 3


def test_checkpoint_stops_marking_until_drained():
    f = flight(checkpoint_interval_s=5.0)
    f.add(rows((1, "a")))
    f.next_sends()
    assert f.mark_room(5.0) == 0 and not f.checkpoint_due(5.0)
    f.acked(1)
    assert f.checkpoint_due(5.0)
    f.checkpoint_saved(5.0)
    assert not f.checkpoint_due(6.0) and f.mark_room(6.0) == 100


def test_record_headers_carry_the_row_id():
    row = Row(42, "k", b"v", (("trace", b"x"),))
    headers = record_headers(row)
    assert headers == [("trace", b"x"), (ROW_ID_HEADER, b"42")]
    assert row_id_of(headers) == 42
    assert row_id_of([("trace", b"x")]) is None


def test_settle_suspects_purges_published_and_resets_the_rest():
    assert settle_suspects({1, 2, 3}, {2, 3, 9}) == ({2, 3}, {1})


def test_bounds_checked():
    with pytest.raises(ValueError):
        Flight(0, 10, 1.0, now=0.0)
    with pytest.raises(ValueError):
        Flight(11, 10, 1.0, now=0.0)


# A leader told to stop by SIGTERM waits on its results queue in the main thread, where the
# handler runs. The handler here outlasts the wait's timeout, which once froze that wait for good.
RESULTS_WAIT_UNDER_SIGNAL = """
import signal, time
from kera.services.outbox.harvester import Settings
from kera.services.outbox.term import Term
term = Term(Settings("dsn", "bootstrap", "stream"), None, None, "leader", None)
signal.signal(signal.SIGALRM, lambda *_: time.sleep(0.1))
signal.setitimer(signal.ITIMER_REAL, 0.005)
started = time.monotonic()
assert term._wait_results(0.02) == []
print(round(time.monotonic() - started, 2))
"""
RESULTS_WAIT_LIMIT_S = 20.0   # the wait takes ~0.1 s; a frozen one never returns


def test_the_results_wait_returns_after_a_signal_handler_outlasts_it():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", RESULTS_WAIT_UNDER_SIGNAL], capture_output=True,
                          text=True, timeout=RESULTS_WAIT_LIMIT_S)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < RESULTS_WAIT_LIMIT_S / 2
