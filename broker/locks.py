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

from kera.codec.chunk import Chunk, read_condition
from kera.daemon.metrics import Counters
from kera.errors import BadRequest, LockConflict, NotReady, lock_conflict_message

# Locks remembered per streamlet: 16 bytes of ids and numbers plus a dict slot each, a few MiB
# at most; a service with more hot locks than this sees only spurious, retriable conflicts.
LOCK_ENTRIES_MAX = 100_000
# The high-water mark of a writer that has applied nothing.
NO_MARK = -1
# Locks one conditional append may name: a transaction touching more rows than this is better
# split, and it bounds the per-chunk work of the check.
LOCKS_PER_APPEND_MAX = 1024


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


def check_condition(info, streamlet, buf, counters: Counters) -> tuple[int, ...]:
    """A conditional append's locks, once checked against its streamlet's lock table; with
    nothing stored, LockConflict when one was written after the writer's high-water mark,
    NotReady when that write is not durable yet. `info`: the stream's StreamInfo."""
    if info.active_groups != 1:
        raise BadRequest(f"conditional appends need one ordered unit per streamlet: "
                         f"{info.name!r} has {info.active_groups} active groups per "
                         f"streamlet; create the stream with active_groups=1")
    locks, high_water_mark = read_condition(Chunk(buf, check=False))
    if len(locks) > LOCKS_PER_APPEND_MAX:
        raise BadRequest(f"{len(locks)} locks in one conditional append, at most "
                         f"{LOCKS_PER_APPEND_MAX}")
    hit = streamlet.lock_table().conflict(locks, high_water_mark)
    if hit is not None:
        # The table takes a lock at append, before its record is durable; a refusal is
        # final only over a durable record (a paused or failed-over broker's last appends
        # may never be), so until then the writer is told to retry.
        if hit[1] >= streamlet.number_span()[1]:
            counters.add("lock_conflicts_pending")
            raise NotReady(f"lock {hit[0]} was last written by record {hit[1]}, which is "
                           f"not durable yet: retry")
        counters.add("lock_conflicts")
        raise LockConflict(lock_conflict_message(hit[0], hit[1], high_water_mark))
    return locks
