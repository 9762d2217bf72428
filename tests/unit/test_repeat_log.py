"""kera.daemon.repeat_log.RepeatedWarnings: which repeats of a warning are logged, with the clock
passed in."""

import pytest

from kera.daemon.repeat_log import RepeatedWarnings


def test_repeats_within_the_interval_are_counted_and_reported_by_the_next_line_logged():
    w = RepeatedWarnings(interval_s=60.0)
    assert w.admit("k", 0.0) == 0                 # the first is logged
    assert [w.admit("k", t) for t in (1.0, 30.0, 59.9)] == [None, None, None]
    assert w.admit("k", 60.0) == 3                # an interval on: logged, with the count
    assert w.admit("k", 61.0) is None
    assert w.admit("k", 200.0) == 1


def test_keys_are_limited_independently():
    w = RepeatedWarnings(interval_s=60.0)
    assert w.admit(("claim", "broker", 0, "a"), 0.0) == 0
    assert w.admit(("claim", "broker", 0, "b"), 1.0) == 0     # another address: its own line
    assert w.admit(("claim", "broker", 0, "a"), 2.0) is None


def test_the_table_forgets_its_least_recently_logged_key_beyond_its_bound():
    w = RepeatedWarnings(interval_s=60.0, keys_max=2)
    for i, key in enumerate("abc"):
        assert w.admit(key, float(i)) == 0
    assert len(w._keys) == 2
    assert w.admit("a", 3.0) == 0                 # forgotten: logged again at once
    assert w.admit("c", 4.0) is None              # still remembered


def test_the_note_says_how_many_lines_were_left_out_and_nothing_when_none_were():
    w = RepeatedWarnings(interval_s=60.0)
    assert w.note(0) == ""
    assert "41 more like it in the last 60 s not logged" in w.note(41)


@pytest.mark.parametrize("interval_s, keys_max", [(-1.0, 10), (60.0, 0)])
def test_bad_bounds_are_refused(interval_s, keys_max):
    with pytest.raises(ValueError):
        RepeatedWarnings(interval_s, keys_max)
