"""What a deliverer sends to one target next, and what the target's acknowledgement means.

Sans-IO: no threads, sockets or clocks (the shell, kera.deliver, passes `now_s`). One
`TargetCursor` per target holds that target's applied positions: the target's own
`last_applied()` at start and after every failure (its source of truth), advanced by each
successful `apply`.

The ordering index. kera positions are exact per streamlet, so until dense record numbers exist
(issue 16, item 1) a target's `last_applied` is, per (stream, streamlet), the Position of the
last record it applied (group, offset). That is a total order of a streamlet only when it has
one active group (Q=1, the default): with Q>1, groups fill in parallel and "the last record"
does not say which records of the other open groups were applied, so the deliverer refuses
such streams (`check_orderable`). A dense number would replace the Position in `last_applied`
and in `resume_positions` without changing the Target interface's shape.
"""

from __future__ import annotations

from kera.errors import BadRequest
from kera.position import Position, Record

# Backoff after a failed target call: doubling from the first delay up to the cap, reset by a
# success. The cap keeps a recovered target from waiting long; the limit bounds how long a
# deliverer keeps retrying a broken target (about 3 min with these) before giving it up.
BACKOFF_FIRST_MS = 100
BACKOFF_CAP_MS = 5_000
RETRIES_MAX = 40
# Records per apply() at most: bounds a target transaction's size and what a failure redoes.
BATCH_RECORDS_MAX = 1_000
# How often each target's progress is logged (applied N, caught up / lagging by M).
PROGRESS_INTERVAL_S = 10.0


def record_position(record: Record) -> Position:
    """The position of `record` itself (not of the record after it)."""
    return Position(record.stream, record.streamlet, record.group, record.offset)


def check_orderable(stream: str, active_groups: int) -> None:
    """Refuse a stream whose streamlets are not one ordered sequence (see the module doc)."""
    if active_groups != 1:
        raise BadRequest(f"stream '{stream}' has {active_groups} active groups per streamlet: "
                         f"kera deliver needs 1 (one ordered sequence per streamlet) until dense "
                         f"record numbers exist; create the stream with active_groups=1")


def resume_positions(applied: dict, stream: str) -> list[Position]:
    """Consumer start positions reading exactly what follows each applied record of `stream`
    (streamlets without one start at their earliest record)."""
    return [Position(stream, sl, pos.group, pos.offset + 1)
            for (st, sl), pos in sorted(applied.items()) if st == stream]


def _key(pos) -> tuple[int, int]:
    return (pos.group, pos.offset)


class TargetCursor:
    """One target's applied positions and retry state."""

    def __init__(self, name: str, retries_max: int = RETRIES_MAX):
        self.name = name
        self.retries_max = retries_max
        self.applied: dict[tuple[str, int], Position] = {}
        self.failures = 0          # consecutive failed attempts
        self.retry_at_s = 0.0      # when the next attempt may start
        self.applied_total = 0     # records applied since this deliverer started

    def resumed(self, last_applied: dict) -> None:
        """The target said what it has applied: that is where delivery continues."""
        self.applied = {part: Position(*pos) for part, pos in last_applied.items()}

    def fresh(self, records: list[Record]) -> list[Record]:
        """`records` minus any the target already applied (a reader restarted from an older
        position must never make a target apply a record twice)."""
        out = []
        for record in records:
            done = self.applied.get((record.stream, record.streamlet))
            if done is None or _key(record) > _key(done):
                out.append(record)
        return out

    def acknowledged(self, records: list[Record]) -> None:
        """The target applied `records` (and stored their last positions) atomically."""
        for record in records:
            self.applied[(record.stream, record.streamlet)] = record_position(record)
        self.applied_total += len(records)
        self.failures = 0

    def failed(self, now_s: float) -> bool:
        """Count a failed attempt and schedule the next; False: the retry limit is reached
        and the target is to be given up."""
        self.failures += 1
        delay_ms = min(BACKOFF_CAP_MS, BACKOFF_FIRST_MS * 2 ** min(self.failures - 1, 16))
        self.retry_at_s = now_s + delay_ms / 1000
        return self.failures <= self.retries_max


def idempotency_key(records: list[Record]) -> str:
    """Names a batch by its first and last positions: a receiver seeing the same key again
    knows it is a retry of a batch it may already have applied."""
    first, last = records[0], records[-1]
    return (f"{first.stream}/{first.streamlet}/{first.group}/{first.offset}-"
            f"{last.stream}/{last.streamlet}/{last.group}/{last.offset}")
