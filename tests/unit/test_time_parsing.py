"""Times at the edges of seeking by time: the CLI's ms-or-ISO-8601 times, the
`offsets_for_time` request and reply schemas, and the consumer's argument checks (refused before
any network call)."""

import pytest

from kera.codec import schema
from kera.consumer.consumer import _time_targets
from kera.errors import BadRequest
from kera.codec.timestamps import parse_time_ms

MS = 1_800_000_000_000   # 2027-01-15T08:00:00Z


def test_cli_times_are_ms_or_iso_8601_with_utc_by_default():
    assert parse_time_ms(str(MS)) == MS
    assert parse_time_ms("2027-01-15T08:00:00Z") == MS
    assert parse_time_ms("2027-01-15T08:00:00") == MS
    assert parse_time_ms("2027-01-15T09:00:00.250+01:00") == MS + 250
    with pytest.raises(BadRequest, match="ISO 8601"):
        parse_time_ms("yesterday")
    with pytest.raises(BadRequest, match="milliseconds"):
        parse_time_ms(str(MS // 1000))                 # seconds
    with pytest.raises(BadRequest, match="milliseconds"):
        parse_time_ms("1970-01-02T00:00:00Z")


def test_offsets_for_time_request_schema():
    q = schema.offsets_for_time({"sid": 3, "sl": 1, "timestamp_us": MS * 1000})
    assert (q.sid, q.sl, q.target) == (3, 1, MS * 1000)
    for bad in ({"sid": 3, "sl": 1}, {"sid": 3, "sl": 1, "timestamp_us": -1},
                {"sid": 3, "sl": 1, "timestamp_us": "now"}, {"sid": 3, "sl": 1, "timestamp_us": 2**63}):
        with pytest.raises(BadRequest, match="timestamp_us"):
            schema.offsets_for_time(bad)


def test_offsets_for_time_reply_schema():
    c = schema.time_cursor({"low": 2, "offsets": {2: 5, 3: 1}, "first_group": 1, "epoch": None})
    assert (c.low, c.offsets, c.first_group, c.epoch) == (2, {2: 5, 3: 1}, 1, None)
    for bad in ({"low": 2, "offsets": {"x": 1}, "first_group": 0},
                {"low": 2, "offsets": {2: -1}, "first_group": 0},
                {"low": 2, "offsets": {g: 1 for g in range(schema.TIME_CURSOR_GROUPS_MAX + 1)},
                 "first_group": 0},
                {"offsets": {}, "first_group": 0}):
        with pytest.raises(BadRequest):
            schema.time_cursor(bad)


def test_consumer_time_targets_are_stream_streamlet_pairs():
    assert _time_targets({("a", 0): MS, ("b", 3): MS + 1}) == {("a", 0): MS, ("b", 3): MS + 1}
    for bad in ([("a", 0)], {"a": MS}, {("a", -1): MS}, {(0, "a"): MS}):
        with pytest.raises(BadRequest, match="offsets_for_times"):
            _time_targets(bad)


def test_offsets_for_number_request_schema():
    q = schema.offsets_for_number({"sid": 3, "sl": 1, "number": 42})
    assert (q.sid, q.sl, q.target) == (3, 1, 42)
    for bad in ({"sid": 3, "sl": 1}, {"sid": 3, "sl": 1, "number": -1},
                {"sid": 3, "sl": 1, "number": "7"}, {"sid": 3, "sl": 1, "number": 2**64 - 1}):
        with pytest.raises(BadRequest, match="number"):
            schema.offsets_for_number(bad)


def test_a_millisecond_timestamp_given_as_microseconds_is_refused_not_stored_as_1970():
    import time as _time

    from kera.codec.timestamps import check_us
    now_ms = int(_time.time() * 1000)
    with pytest.raises(BadRequest, match="looks like milliseconds"):
        check_us(now_ms)
    with pytest.raises(BadRequest, match="timestamp_ms="):
        check_us(now_ms * 1000 + 5, now_ms)   # a batch whose lowest value is in ms
    check_us(now_ms * 1000)     # microseconds now
    check_us(123)               # small values: a test's or a simulation's clock, kept as given


def test_a_batch_of_millisecond_timestamps_becomes_microseconds():
    from kera.codec.timestamps import TIMESTAMP_MS_MIN, ms_column_to_us
    got = ms_column_to_us([TIMESTAMP_MS_MIN, TIMESTAMP_MS_MIN + 7])
    assert got.tolist() == [TIMESTAMP_MS_MIN * 1000, (TIMESTAMP_MS_MIN + 7) * 1000]
    with pytest.raises(BadRequest, match="timestamp_ms="):
        ms_column_to_us([TIMESTAMP_MS_MIN, 5])
