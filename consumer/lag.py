"""Watermarks and lag in records, from a broker's group table (`offsets`). Sans-IO.

A streamlet's records are counted over its retained groups: a group holds records 0 ..
durable_end - 1 (the broker's `start` is 0), and groups below the first retained one were
deleted by retention, their record count unknown to the broker. So the watermarks of a streamlet
are (0, durable records retained), and the lag of a reader is, group by group, the durable
records past its position: exact whatever groups retention deleted. Its lag in bytes is the
broker's count (`offsets` with the reader's cursor as `at`): the durable chunks past it.
"""

from __future__ import annotations

from typing import NamedTuple

from kera.consumer.cursor import GroupInfo


class Lag(NamedTuple):
    """How far a reader is behind the durable head of a streamlet."""
    records: int
    bytes: int | None   # durable chunk bytes past it (None: a broker too old to say)


def watermarks(groups: list[GroupInfo]) -> tuple[int, int]:
    """(low, high): records readable now are numbered low .. high - 1 over the retained groups."""
    return 0, sum(gi.durable_end - gi.start for gi in groups)


def lag_records(groups: list[GroupInfo], low: int, offsets: dict[int, int]) -> int:
    """Durable records past a position (`low`: every group below it consumed; `offsets`: the
    next offset of each group from `low` up, 0 if missing)."""
    behind = 0
    for gi in groups:
        if gi.group < low:
            continue
        behind += max(0, gi.durable_end - max(gi.start, offsets.get(gi.group, 0)))
    return behind
