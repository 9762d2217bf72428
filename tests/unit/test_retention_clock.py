"""Retention under wall-clock steps, sans-IO with injected clocks: within a process ages follow
the monotonic clock, so a step of the wall clock (either way) deletes nothing; after a restart
one pass deletes at most GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX groups by age."""

from kera.broker.retention import (CLOCK_STEP_THRESHOLD_MS, GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX,
                                   RetentionClock)

from tests.unit.test_retention_core import MIN, acknowledge_floors, broker, desc
from tests.unit.test_tier import make

DAY = 24 * 60 * MIN
WALL0 = 1_700_000_000_000      # a wall clock reading (ms since the epoch)


def fill_at(b, n, wall_ms, mono_ms, start=0):
    """n chunks of ~1 KiB stamped at the given clocks: a 4 KiB group closes every 4 chunks."""
    b.set_wall_clock(wall_ms, mono_ms)
    for seq in range(start, start + n):
        b.produce(seq, [make(seq, n=4, size=200)], 0.0)


def groups_left(b) -> int:
    return len(b.streams[1].streamlets[0].groups)


def test_the_clock_follows_the_monotonic_clock_through_steps():
    c = RetentionClock()
    assert c.update(WALL0, 0) == WALL0
    small = CLOCK_STEP_THRESHOLD_MS // 2                  # a slew: ignored
    assert c.update(WALL0 + 1000 + small, 1000) == WALL0 + 1000
    assert c.steps == 0
    assert c.update(WALL0 + DAY, 2000) == WALL0 + 2000   # a step: detected, not followed
    assert c.steps == 1
    assert c.update(WALL0 + DAY + 1000, 3000) == WALL0 + 3000
    assert c.steps == 1                                  # the same step is logged once


def test_a_forward_wall_clock_step_deletes_nothing():
    b = broker(desc(retention_ms=60 * MIN))
    fill_at(b, 4 * 40, WALL0, 0)                          # 40 groups, written "now"
    b.enforce_retention(WALL0, 0)                         # first pass: nothing is old
    assert groups_left(b) == 40 and not b.retention.clock.suspect
    # The wall clock steps a day ahead while the monotonic clock moved one second.
    assert b.enforce_retention(WALL0 + DAY, 1000) == 0
    assert b.retention.clock.steps == 1
    assert groups_left(b) == 40
    # An hour later by the monotonic clock the groups are old: they go (the last once the
    # coordinator holds the numbering floor it leaves).
    assert b.enforce_retention(WALL0 + DAY + 61 * MIN, 61 * MIN) == 39
    acknowledge_floors(b)
    assert b.enforce_retention(WALL0 + DAY + 61 * MIN, 61 * MIN) == 1


def test_after_a_restart_a_pass_deletes_at_most_the_bound():
    b = broker(desc(retention_ms=60 * MIN))
    fill_at(b, 4 * 40, WALL0, 0)
    b.retention.clock = RetentionClock()                  # what a restart starts with
    deleted = b.enforce_retention(WALL0 + DAY, 0)         # the wall clock a day later
    assert deleted <= GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX
    assert groups_left(b) >= 40 - GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX
    assert b.stats()["retention_passes_bounded"] == 1
    # Each later pass deletes at most the bound too, while more are due.
    assert b.enforce_retention(WALL0 + DAY + 500, 500) <= GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX


def test_without_a_step_nothing_young_is_deleted_and_old_groups_go():
    b = broker(desc(retention_ms=60 * MIN))
    fill_at(b, 4 * 10, WALL0, 0)
    b.enforce_retention(WALL0, 0)
    assert b.enforce_retention(WALL0 + 30 * MIN, 30 * MIN) == 0
    # An hour later by both clocks: every group expired, deleted in one pass (the open one
    # closed by age), the last once the coordinator holds the numbering floor it leaves.
    assert b.enforce_retention(WALL0 + 61 * MIN, 61 * MIN) == 9
    acknowledge_floors(b)
    assert b.enforce_retention(WALL0 + 61 * MIN, 61 * MIN) == 1
    assert b.retention.clock.steps == 0


def test_a_backward_step_keeps_data_longer_never_shorter():
    b = broker(desc(retention_ms=60 * MIN))
    fill_at(b, 4 * 10, WALL0, 0)
    b.enforce_retention(WALL0, 0)
    assert b.enforce_retention(WALL0 - DAY, 1000) == 0    # stamps are now "in the future"
    assert groups_left(b) == 10
