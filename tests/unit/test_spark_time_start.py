"""The Spark source's start by time: options startingTimestamp / startingOffsetsByTimestamp
checked while parsing (milliseconds, like Kafka's), laid over startingOffsets per streamlet, and
a broker's time cursor turned into the source's offset JSON exactly."""

import pytest

from kera.spark import offsets as ko
from kera.spark.options import Options

MS = 1_800_000_000_000


def parse(**kw):
    return Options.parse({"bootstrap": "h:1", "stream": "a,b", **kw})


def test_starting_timestamp_is_milliseconds_and_checked():
    assert parse(startingTimestamp=str(MS)).starting_timestamp_us == MS * 1000
    for wrong in (str(MS // 1000), str(MS * 1000), "soon", "-5"):
        with pytest.raises(ValueError, match="startingTimestamp"):
            parse(startingTimestamp=wrong)


def test_starting_offsets_by_timestamp_json_per_stream_and_streamlet():
    opts = parse(startingOffsetsByTimestamp=f'{{"a": {{"0": {MS}, "2": {MS + 1}}}}}')
    assert opts.starting_by_timestamp == {"a": {0: MS * 1000, 2: (MS + 1) * 1000}}
    for bad in ("[1]", '{"a": 5}', f'{{"a": {{"x": {MS}}}}}', '{"a": {"0": 12}}', "{"):
        with pytest.raises(ValueError, match="startingOffsetsByTimestamp"):
            parse(startingOffsetsByTimestamp=bad)
    with pytest.raises(ValueError, match="not both"):
        parse(startingTimestamp=str(MS), startingOffsetsByTimestamp=f'{{"a": {{"0": {MS}}}}}')


def test_times_are_laid_over_starting_offsets_per_streamlet():
    source = pytest.importorskip("kera.spark.source")
    opts = parse(startingOffsets="latest", startingOffsetsByTimestamp=f'{{"a": {{"1": {MS}}}}}')
    boundary = source.starting_boundary(opts, ("a", "b"), ko.EARLIEST)
    assert ko.spec_of(boundary["a"], 1) == ko.AtTime(MS * 1000)
    assert ko.spec_of(boundary["a"], 0) == ko.LATEST and ko.spec_of(boundary["b"], 1) == ko.LATEST
    every = source.starting_boundary(parse(startingTimestamp=str(MS)), ("a", "b"), ko.LATEST)
    assert {ko.spec_of(every[s], sl) for s in "ab" for sl in range(3)} == {ko.AtTime(MS * 1000)}
    with pytest.raises(ValueError, match=r"names streams \['c'\]"):
        source.starting_boundary(parse(startingOffsetsByTimestamp=f'{{"c": {{"0": {MS}}}}}'),
                                 ("a", "b"), ko.EARLIEST)


def test_broker_time_cursor_as_a_source_cursor():
    # Groups below low finished; listed groups at their offsets; unlisted ones >= low at 0.
    c = ko.cursor_from_time(2, {4: 7}, epoch=3)
    assert [c.position(g) for g in range(7)] == [None, None, 0, 0, 7, 0, 0]
    assert c.epoch == 3
    assert ko.Cursor.from_json(c.to_json()) == c
    assert ko.cursor_from_time(5, {}, None) == ko.Cursor(5, {}, None)
