"""Where a reader is: exact and resumable."""

from __future__ import annotations

from typing import NamedTuple


class Position(NamedTuple):
    """The next record to read in one group: resuming here yields no gap and no duplicate.

    A consumer's positions for a streamlet list every group from the lowest unfinished one up:
    groups below the lowest listed are finished, groups above the highest listed start at 0.
    """

    stream: str
    streamlet: int
    group: int
    offset: int
    # The streamlet history the position points into (issued by the coordinator, see
    # kera.broker.history_epoch); None: unknown (saved by older code, or before any data was
    # read), then the broker does not check it.
    epoch: int | None = None


class Record(NamedTuple):
    key: bytes | None
    value: bytes | None  # None: a tombstone (distinct from b"")
    timestamp: int  # microseconds since the epoch
    stream: str
    streamlet: int
    group: int
    offset: int
    headers: tuple = ()  # (str key, bytes value) pairs, in the order sent
    # Dense and gap-free within the record's slot of its streamlet (with one active group per
    # streamlet, the default: within the streamlet), assigned at append and kept across
    # failover (kera.broker.streamlet). None for data written before record numbers.
    number: int | None = None

    @property
    def timestamp_ms(self) -> int:
        """The timestamp in milliseconds (Kafka's unit)."""
        return self.timestamp // 1000
