"""A streaming query's offsets as a consumer group's committed positions (kera.spark.progress)."""

from types import SimpleNamespace

from kera.spark import offsets as ko
from kera.spark.offsets import Cursor, GroupInfo
from kera.spark.progress import wire_positions


def test_streamlets_become_parts_and_groups_are_asked_only_when_needed():
    asked = []

    def snapshot(stream):
        asked.append(stream)
        return SimpleNamespace(id=4), {0: [GroupInfo(0, 0, 0, 80, False),
                                           GroupInfo(1, 1, 0, 64, True)]}

    offsets = {"plain": ko.StreamOffset(3, {0: Cursor(1, {0: 10}), 1: Cursor()}),
               "gappy": ko.StreamOffset(4, {0: Cursor(2, {0: 30})})}
    assert wire_positions(offsets, snapshot) == [
        ["gappy", 0, [[0, 30, None], [1, 64, None]]],   # group 1 finished: at its end
        ["plain", 0, [[0, 10, None]]], ["plain", 1, [[0, 0, None]]]]
    assert asked == ["gappy"]


def test_cursors_of_a_recreated_stream_are_not_committed():
    def snapshot(stream):
        return SimpleNamespace(id=9), {0: []}
    offsets = {"s": ko.StreamOffset(4, {0: Cursor(2, {0: 30})})}
    assert wire_positions(offsets, snapshot) == []
