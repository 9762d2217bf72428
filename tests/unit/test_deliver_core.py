"""kera.deliver_core: where a target resumes, what it is sent, and how failures back off."""

import pytest

from kera.deliver_core import (BACKOFF_CAP_MS, BACKOFF_FIRST_MS, TargetCursor, check_orderable,
                               idempotency_key, resume_positions)
from kera.errors import BadRequest
from kera.position import Position, Record


def rec(sl, group, offset, stream="s"):
    return Record(None, b"v", 0, stream, sl, group, offset)


def test_resume_reads_what_follows_each_applied_record_of_the_stream():
    applied = {("s", 1): Position("s", 1, 2, 9), ("s", 0): Position("s", 0, 0, 4),
               ("other", 0): Position("other", 0, 5, 5)}
    assert resume_positions(applied, "s") == [Position("s", 0, 0, 5), Position("s", 1, 2, 10)]
    assert resume_positions({}, "s") == []


def test_fresh_drops_records_the_target_already_applied_per_streamlet():
    cursor = TargetCursor("t")
    cursor.resumed({("s", 0): Position("s", 0, 1, 3)})
    records = [rec(0, 0, 7), rec(0, 1, 3), rec(0, 1, 4), rec(0, 2, 0), rec(1, 0, 0)]
    assert cursor.fresh(records) == [rec(0, 1, 4), rec(0, 2, 0), rec(1, 0, 0)]


def test_acknowledged_advances_to_the_last_record_per_streamlet_and_resets_failures():
    cursor = TargetCursor("t")
    cursor.failed(now_s=0.0)
    cursor.acknowledged([rec(0, 0, 0), rec(1, 0, 0), rec(0, 0, 1)])
    assert cursor.applied == {("s", 0): Position("s", 0, 0, 1), ("s", 1): Position("s", 1, 0, 0)}
    assert cursor.failures == 0 and cursor.applied_total == 3
    assert cursor.fresh([rec(0, 0, 1), rec(0, 0, 2)]) == [rec(0, 0, 2)]


def test_failures_back_off_doubling_to_a_cap_and_stop_at_the_limit():
    cursor = TargetCursor("t", retries_max=12)
    delays = []
    for _ in range(12):
        assert cursor.failed(now_s=100.0)
        delays.append(round((cursor.retry_at_s - 100.0) * 1000))
    assert delays[:3] == [BACKOFF_FIRST_MS, 2 * BACKOFF_FIRST_MS, 4 * BACKOFF_FIRST_MS]
    assert max(delays) == BACKOFF_CAP_MS and delays == sorted(delays)
    assert not cursor.failed(now_s=100.0)   # the 13th: given up


def test_streams_with_parallel_groups_are_refused_until_dense_numbers_exist():
    check_orderable("s", 1)
    with pytest.raises(BadRequest, match="active_groups=1"):
        check_orderable("s", 2)


def test_idempotency_key_names_first_and_last_positions():
    assert idempotency_key([rec(0, 1, 2), rec(0, 1, 9)]) == "s/0/1/2-s/0/1/9"
