"""The lock table of conditional appends (Waltz's optimistic locking), one per streamlet. Sans-IO.

A conditional append names lock ids and the writer's high-water mark (the highest record number
it has applied). It is refused when any of its locks was last written by a record numbered
after that mark; otherwise it is appended and its locks now point at its last record's number.

The table is bounded: past LOCK_ENTRIES_MAX locks the least recently written ones are forgotten
and `floor` rises to the highest number forgotten. A lock not in the table is taken as written
at `floor`, so forgetting can only refuse more (a writer then reads on and retries), never
accept an append that conflicts. A broker that reloads a streamlet from its own disk, without
reading every chunk, starts the table with `floor` at the slot's last number for the same
reason; one that rebuilds it from replicas replays the conditional chunks in order.
"""

from __future__ import annotations

# Locks remembered per streamlet: 16 bytes of ids and numbers plus a dict slot each, a few MiB
# at most; a service with more hot locks than this sees only spurious, retriable conflicts.
LOCK_ENTRIES_MAX = 100_000
# The high-water mark of a writer that has applied nothing.
NO_MARK = -1


class LockTable:
    __slots__ = ("entries", "floor")

    def __init__(self, floor: int = NO_MARK):
        self.entries: dict[int, int] = {}   # lock id -> number of the last record that wrote it
        self.floor = floor

    def conflict(self, locks, high_water_mark: int) -> tuple[int, int] | None:
        """(lock, number) of the first lock written after `high_water_mark`, or None."""
        entries, floor = self.entries, self.floor
        for lock in locks:
            number = entries.get(lock, floor)
            if number > high_water_mark:
                return lock, number
        return None

    def record(self, locks, number: int) -> None:
        """`locks` were written by the record numbered `number` (numbers only grow)."""
        entries = self.entries
        for lock in locks:
            prev = entries.pop(lock, None)   # re-inserted last: the dict's order is recency
            # A rebuild may replay a later group's chunks before an earlier one's.
            entries[lock] = number if prev is None or prev < number else prev
        while len(entries) > LOCK_ENTRIES_MAX:
            oldest = next(iter(entries))
            self.floor = max(self.floor, entries.pop(oldest))

    def __len__(self) -> int:
        return len(self.entries)
