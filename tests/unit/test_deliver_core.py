"""kera.services.deliver.core: where a target resumes, what it is sent, and how failures back off."""

import pytest

from kera.services.deliver.core import (BACKOFF_CAP_MS, BACKOFF_FIRST_MS, Applied, TargetCursor,
                               as_applied, check_orderable, idempotency_key, resume_numbers,
                               resume_positions)
from kera.errors import BadRequest, DeliveryGap
from kera.codec.position import Position, Record


def rec(sl, group, offset, stream="s", number=None):
    return Record(None, b"v", 0, stream, sl, group, offset, number=number)


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
    assert cursor.applied == {("s", 0): Applied("s", 0, 0, 1), ("s", 1): Applied("s", 1, 0, 0)}
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


def numbered(sl, n, per_group=10):
    """The record numbered n of streamlet sl, in groups of `per_group` records."""
    return rec(sl, n // per_group, n % per_group, number=n)


def test_records_numbered_right_after_the_last_applied_are_fresh_across_groups():
    cursor = TargetCursor("t")
    cursor.resumed({("s", 0): Applied("s", 0, 0, 8, 8)})
    batch = [numbered(0, n) for n in range(5, 14)]
    assert cursor.fresh(batch) == batch[4:]        # 9, then 10.. in the next group
    cursor.acknowledged(batch[4:])
    assert cursor.applied[("s", 0)] == Applied("s", 0, 1, 3, 13)


def test_a_hole_in_the_numbers_is_a_delivery_gap_naming_them():
    cursor = TargetCursor("t")
    cursor.resumed({("s", 0): Applied("s", 0, 0, 8, 8)})
    # Retention deletes whole groups: its holes span at least one (here group 1).
    with pytest.raises(DeliveryGap, match=r"numbers 9..24 were deleted.*number to 24"):
        cursor.fresh([numbered(0, 25)])
    with pytest.raises(DeliveryGap, match="went backwards"):   # newer position, lower number
        cursor.fresh([rec(0, 5, 0, number=3)])
    with pytest.raises(DeliveryGap):                           # a hole inside one batch
        cursor.fresh([numbered(0, 9), numbered(0, 21)])
    assert cursor.fresh([numbered(1, 40)]) == [numbered(1, 40)]   # nothing applied there yet


def test_numbers_the_broker_steps_over_are_not_a_gap():
    """Transaction markers and aborted transactions' chunks take record numbers the broker
    never serves (docs/TRANSACTIONS.md): holes inside the applied record's group, or at the
    end of it, that only the broker's skipping can leave."""
    cursor = TargetCursor("t")
    cursor.resumed({("s", 0): Applied("s", 0, 0, 3, 3)})
    marker_skipped = rec(0, 0, 5, number=5)                 # number 4 was a marker
    assert cursor.fresh([marker_skipped]) == [marker_skipped]
    cursor.acknowledged([marker_skipped])
    aborted_then_next_group = [rec(0, 0, 9, number=9), rec(0, 1, 0, number=11)]
    assert cursor.fresh(aborted_then_next_group) == aborted_then_next_group
    number_only = TargetCursor("t")                          # no position: cannot tell
    number_only.resumed({("s", 0): Applied("s", 0, None, None, 3)})
    with pytest.raises(DeliveryGap):
        number_only.fresh([marker_skipped])


def test_a_target_keeping_only_the_number_resumes_and_deduplicates_by_it():
    cursor = TargetCursor("t")
    cursor.resumed({("s", 0): Applied("s", 0, None, None, 41), ("s", 1): Applied("s", 1, 2, 3)})
    assert resume_numbers(cursor.applied, "s") == {0: 42}
    assert resume_positions(cursor.applied, "s") == [Position("s", 1, 2, 4)]
    assert cursor.fresh([numbered(0, 40), numbered(0, 41), numbered(0, 42)]) == [numbered(0, 42)]


def test_last_applied_entries_are_checked_and_plain_positions_still_work():
    assert as_applied(Position("s", 0, 3, 4, 99)) == Applied("s", 0, 3, 4, None)   # 99: epoch
    with pytest.raises(BadRequest, match="neither a position nor a record number"):
        as_applied(Applied("s", 0, None, None, None))
    with pytest.raises(BadRequest, match="group without an offset"):
        as_applied(Applied("s", 0, 3, None, 7))
    cursor = TargetCursor("t")
    cursor.resumed({("s", 0): Position("s", 0, 1, 3)})
    assert cursor.fresh([rec(0, 1, 3), rec(0, 1, 4)]) == [rec(0, 1, 4)]   # no numbers: no check


def test_streams_with_parallel_groups_are_refused():
    check_orderable("s", 1)
    with pytest.raises(BadRequest, match="active_groups=1"):
        check_orderable("s", 2)


def test_idempotency_key_names_first_and_last_positions():
    assert idempotency_key([rec(0, 1, 2), rec(0, 1, 9)]) == "s/0/1/2-s/0/1/9"


def test_the_http_last_applied_round_trips_and_takes_a_number_alone():
    from kera.services.deliver.http import applied_from_json, applied_to_json
    applied = {("s", 0): Applied("s", 0, 2, 5, 77), ("s", 1): Applied("s", 1, None, None, 9)}
    assert applied_from_json(applied_to_json(applied)) == applied
    assert applied_from_json(b'{"applied": [{"stream": "s", "streamlet": 3, "number": 4}]}') == \
        {("s", 3): Applied("s", 3, None, None, 4)}
    with pytest.raises(BadRequest, match="neither a position nor a record number"):
        applied_from_json(b'{"applied": [{"stream": "s", "streamlet": 3}]}')
    with pytest.raises(BadRequest, match="receiver's last applied is not"):
        applied_from_json(b'{"done": []}')
