"""The Spark source's start and end by time: options startingTimestamp /
startingOffsetsByTimestamp and endingTimestamp / endingOffsetsByTimestamp checked while parsing
(milliseconds, like Kafka's), laid over startingOffsets / endingOffsets per streamlet, and a
broker's time cursor turned into the source's offset JSON exactly."""

import pytest

from kera.spark import offsets as ko
from kera.spark.options import Options

MS = 1_800_000_000_000


def parse(**kw):
    return Options.parse({"bootstrap": "h:1", "stream": "a,b", **kw})


@pytest.mark.parametrize("which", ["starting", "ending"])
def test_a_timestamp_option_is_milliseconds_and_checked(which):
    assert getattr(parse(**{f"{which}Timestamp": str(MS)}), f"{which}_timestamp_us") == MS * 1000
    for wrong in (str(MS // 1000), str(MS * 1000), "soon", "-5"):
        with pytest.raises(ValueError, match=f"{which}Timestamp"):
            parse(**{f"{which}Timestamp": wrong})


@pytest.mark.parametrize("which", ["starting", "ending"])
def test_offsets_by_timestamp_json_per_stream_and_streamlet(which):
    name = f"{which}OffsetsByTimestamp"
    opts = parse(**{name: f'{{"a": {{"0": {MS}, "2": {MS + 1}}}}}'})
    assert getattr(opts, f"{which}_by_timestamp") == {"a": {0: MS * 1000, 2: (MS + 1) * 1000}}
    for bad in ("[1]", '{"a": 5}', f'{{"a": {{"x": {MS}}}}}', '{"a": {"0": 12}}', "{"):
        with pytest.raises(ValueError, match=name):
            parse(**{name: bad})
    with pytest.raises(ValueError, match="not both"):
        parse(**{f"{which}Timestamp": str(MS), name: f'{{"a": {{"0": {MS}}}}}'})


def test_ending_times_are_laid_over_ending_offsets():
    source = pytest.importorskip("kera.spark.source")
    boundary = source.ending_boundary(parse(endingOffsetsByTimestamp=f'{{"b": {{"0": {MS}}}}}'),
                                      ("a", "b"))
    assert ko.spec_of(boundary["b"], 0) == ko.AtTime(MS * 1000)
    assert ko.spec_of(boundary["b"], 1) == ko.LATEST and ko.spec_of(boundary["a"], 0) == ko.LATEST
    every = source.ending_boundary(parse(endingTimestamp=str(MS)), ("a",))
    assert ko.spec_of(every["a"], 3) == ko.AtTime(MS * 1000)
    with pytest.raises(ValueError, match=r"endingOffsetsByTimestamp' names streams \['c'\]"):
        source.ending_boundary(parse(endingOffsetsByTimestamp=f'{{"c": {{"0": {MS}}}}}'), ("a",))


def test_a_cursor_from_time_caps_a_batch_before_the_time():
    # Group 0 finished before T (below low): read whole; group 1 reaches T at offset 4; group 2
    # starts at or after T: nothing of it.
    infos = [ko.GroupInfo(0, 0, 0, 10, True), ko.GroupInfo(1, 0, 0, 9, True),
             ko.GroupInfo(2, 0, 0, 6, False)]
    cap = ko.cursor_from_time(1, {1: 4}, None)
    end = ko.advance(ko.earliest(infos), infos, cap=cap)
    assert [end.position(g) for g in range(3)] == [10, 4, 0]


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
