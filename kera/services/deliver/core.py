"""What a deliverer sends to one target next, and what the target's acknowledgement means.

Sans-IO: no threads, sockets or clocks (the shell, kera.services.deliver.deliverer, passes `now_s`). One
`TargetCursor` per target holds that target's applied positions: the target's own
`last_applied()` at start and after every failure (its source of truth), advanced by each
successful `apply`.

The ordering index is the record number (kera.broker.streamlet): dense per streamlet when the
stream has one active group per streamlet (Q=1, the default), which is what LogPlayer's entry
index is. A target's `last_applied` is, per (stream, streamlet), an `Applied`: the number of
the last record it applied and/or its position (group, offset). kera's own targets store both.
- Resuming: from the position when the target has one (exact), else from the number + 1
  (`Consumer.seek_to_number`), so a target that keeps only an index, as LogPlayer's do, works.
- Checking: a record newer than the last applied must be numbered exactly one more. Anything
  else is a `DeliveryGap` (records deleted by retention before the target got them, or
  numbering that restarted): the target is given up with that message, never fed past a hole.
  Except numbers the broker steps over (`_skipped`): transaction markers, aborted
  transactions' records (docs/TRANSACTIONS.md) and compacted-away records. The broker skips
  whole chunks, so those holes lie inside the applied record's group or at the start of the
  next one; retention deletes whole groups, so its holes span at least a group. A hole of a
  target known by its number only (no position) cannot be told apart: it stays a gap.
- Streams with Q>1 are refused (`check_orderable`): their streamlets hold Q sequences in
  parallel, and one last-applied record does not say what of the others was applied.
Targets written before numbers may return plain Positions: they resume and deduplicate by
position, without the check.
"""

from __future__ import annotations

from typing import NamedTuple

from kera.errors import BadRequest, DeliveryGap
from kera.codec.position import Position, Record
from kera.net.backoff import Backoff

# Backoff after a failed target call: doubling from the first delay up to the cap, reset by a
# success. The cap keeps a recovered target from waiting long; the limit bounds how long a
# deliverer keeps retrying a broken target (about 3 min with these) before giving it up.
BACKOFF_FIRST_MS = 100
BACKOFF_CAP_MS = 5_000
BACKOFF = Backoff(BACKOFF_FIRST_MS, BACKOFF_CAP_MS)
RETRIES_MAX = 40
# Records per apply() at most: bounds a target transaction's size and what a failure redoes.
BATCH_RECORDS_MAX = 1_000
# How often each target's progress is logged (applied N, caught up / lagging by M).
PROGRESS_INTERVAL_S = 10.0


class Applied(NamedTuple):
    """The last record a target applied in one streamlet: its position, its number, or both
    (None: unknown)."""
    stream: str
    streamlet: int
    group: int | None
    offset: int | None
    number: int | None = None

    @property
    def position(self) -> tuple[int, int] | None:
        return None if self.group is None else (self.group, self.offset)


def applied_of(record: Record) -> Applied:
    """What applying `record` makes the last applied of its streamlet."""
    return Applied(record.stream, record.streamlet, record.group, record.offset, record.number)


def as_applied(value) -> Applied:
    """A target's last-applied entry as an Applied: Positions (targets written before record
    numbers) keep their group and offset; an entry with neither a position nor a number is
    refused."""
    if isinstance(value, Position):
        return Applied(value.stream, value.streamlet, value.group, value.offset)
    applied = Applied(*value)
    if applied.group is None and applied.number is None:
        raise BadRequest(f"a target's last applied {value!r} has neither a position nor a "
                         f"record number")
    if (applied.group is None) != (applied.offset is None):
        raise BadRequest(f"a target's last applied {value!r} has a group without an offset "
                         f"(or the other way round)")
    return applied


def check_orderable(stream: str, active_groups: int) -> None:
    """Refuse a stream whose streamlets are not one ordered sequence (see the module doc)."""
    if active_groups != 1:
        raise BadRequest(f"stream '{stream}' has {active_groups} active groups per streamlet: "
                         f"kera deliver needs 1 (record numbers are one dense sequence per "
                         f"streamlet only then); create the stream with active_groups=1")


def resume_positions(applied: dict, stream: str) -> list[Position]:
    """Consumer start positions reading exactly what follows each applied record of `stream`
    that has a position (streamlets without one start at their earliest record, or at a
    number: resume_numbers)."""
    return [Position(stream, sl, a.group, a.offset + 1)
            for (st, sl), a in sorted(applied.items()) if st == stream and a.group is not None]


def resume_numbers(applied: dict, stream: str) -> dict[int, int]:
    """{streamlet: record number to read from} for the applied entries of `stream` known by
    their number only."""
    return {sl: a.number + 1 for (st, sl), a in sorted(applied.items())
            if st == stream and a.group is None}


def _newer(record: Record, done: Applied) -> bool:
    if done.group is not None:
        return (record.group, record.offset) > done.position
    return record.number is None or record.number > done.number


def _skipped(record: Record, done: Applied) -> bool:
    """Whether numbers between `done` and `record` may be ones the broker steps over (see the
    module doc): a forward jump within the applied record's group or into the next group."""
    return (done.group is not None and record.number > done.number
            and done.group <= record.group <= done.group + 1)


def _check_next(record: Record, done: Applied | None, target: str) -> None:
    if done is None or done.number is None or record.number is None:
        return
    if record.number != done.number + 1 and not _skipped(record, done):
        raise DeliveryGap(
            f"target {target}: after record number {done.number} of {record.stream}/"
            f"{record.streamlet} it was offered number {record.number} (group {record.group} "
            f"offset {record.offset}): "
            + (f"numbers {done.number + 1}..{record.number - 1} were deleted (retention?) "
               f"before it applied them" if record.number > done.number else
               "the stream's numbering went backwards")
            + f"; to skip on deliberately, set its last applied number to {record.number - 1}")


class TargetCursor:
    """One target's applied positions and retry state."""

    def __init__(self, name: str, retries_max: int = RETRIES_MAX):
        self.name = name
        self.retries_max = retries_max
        self.applied: dict[tuple[str, int], Applied] = {}
        self.failures = 0          # consecutive failed attempts
        self.retry_at_s = 0.0      # when the next attempt may start
        self.applied_total = 0     # records applied since this deliverer started

    def resumed(self, last_applied: dict) -> None:
        """The target said what it has applied: that is where delivery continues."""
        self.applied = {part: as_applied(a) for part, a in last_applied.items()}

    def fresh(self, records: list[Record]) -> list[Record]:
        """`records` minus any the target already applied (a reader restarted from an older
        position must never make a target apply a record twice); raises DeliveryGap when a
        new record is not numbered right after the one before it."""
        out = []
        last = dict(self.applied)
        for record in records:
            part = (record.stream, record.streamlet)
            done = last.get(part)
            if done is None or _newer(record, done):
                _check_next(record, done, self.name)
                out.append(record)
                last[part] = applied_of(record)
        return out

    def acknowledged(self, records: list[Record]) -> None:
        """The target applied `records` (and stored their last positions) atomically."""
        for record in records:
            self.applied[(record.stream, record.streamlet)] = applied_of(record)
        self.applied_total += len(records)
        self.failures = 0

    def failed(self, now_s: float) -> bool:
        """Count a failed attempt and schedule the next; False: the retry limit is reached
        and the target is to be given up."""
        self.failures += 1
        self.retry_at_s = now_s + BACKOFF.delay_s(self.failures)
        return self.failures <= self.retries_max


def idempotency_key(records: list[Record]) -> str:
    """Names a batch by its first and last positions: a receiver seeing the same key again
    knows it is a retry of a batch it may already have applied."""
    first, last = records[0], records[-1]
    return (f"{first.stream}/{first.streamlet}/{first.group}/{first.offset}-"
            f"{last.stream}/{last.streamlet}/{last.group}/{last.offset}")
