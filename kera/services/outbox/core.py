"""The outbox harvester's decisions, sans-IO: which marked rows to publish now, which to purge
or reset, when to mark more and when to save a checkpoint (kera.services.outbox.harvester is the shell).

`Flight` holds the rows one leadership term has marked. Rows of one key are queued in id order
and at most one of them is in flight (sent, not yet acknowledged): a row is published only once
every earlier row of its key was acknowledged, so per-key order holds whatever the producer's
retries do. At most `in_flight_max` rows are in flight overall and at most `marked_max` are
held (queued or in flight), which bounds the memory and the rows a crash leaves marked.

A row whose record fails is not simply reset: a failure after a timeout does not prove the
record was not stored. Only a record refused for what it is (too large, malformed: `refused`)
is known unpublished; its row is parked (marked with PARKED_LEADER_ID, never marked again until
an operator fixes it and clears the mark) and its key's later rows go on. Any other failure ends
the term, and the next term's takeover looks the row up in the stream (kera.services.outbox.term).

Checkpoints: every `checkpoint_interval_s` the term stops marking until nothing is in flight
or queued, then saves the stream's end positions (the shell does the I/O). Every record this
term published for a row still in the table lies past its latest checkpoint, so a successor
finds them by reading the stream from there (kera.services.outbox.tail).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple

from kera.errors import BadRequest, RecordTooLarge

# The mark of a row refused for what it is (too large, malformed): left for an operator.
PARKED_LEADER_ID = "00000000-0000-0000-0000-000000000000"
# The record header carrying the outbox row id: a successor reads it to tell which marked rows
# were already published.
ROW_ID_HEADER = "kera-outbox-id"


class Row(NamedTuple):
    id: int
    key: str
    value: bytes | None
    headers: tuple = ()   # (str, bytes) pairs, as the service wrote them


def record_headers(row: Row) -> list[tuple[str, bytes]]:
    """The row's headers plus its id, as the published record carries them."""
    return [*row.headers, (ROW_ID_HEADER, str(row.id).encode())]


def row_id_of(headers) -> int | None:
    """The outbox row id a record carries (None: not published by a harvester)."""
    for name, value in headers:
        if name == ROW_ID_HEADER:
            return int(value)
    return None


def refused(err: BaseException) -> bool:
    """Whether `err` proves the record was refused for what it is (so never stored, and
    sending it again cannot succeed): the row is parked rather than retried."""
    return isinstance(err, (RecordTooLarge, BadRequest, TypeError))


def settle_suspects(suspects: set[int], published: set[int]) -> tuple[set[int], set[int]]:
    """A new term's rows marked by earlier terms: (to purge: found in the stream, to reset)."""
    found = suspects & published
    return found, suspects - found


class Flight:
    def __init__(self, in_flight_max: int, marked_max: int, checkpoint_interval_s: float,
                 now: float):
        if not 1 <= in_flight_max <= marked_max:
            raise ValueError(f"need 1 <= in_flight_max ({in_flight_max}) <= marked_max "
                             f"({marked_max})")
        self.in_flight_max, self.marked_max = in_flight_max, marked_max
        self.checkpoint_interval_s = checkpoint_interval_s
        self.next_checkpoint_s = now + checkpoint_interval_s
        self.queues: dict[str, deque[Row]] = {}   # per key, id order, in-flight head excluded
        self.ready: list[tuple[int, str]] = []    # (head id, key) of keys with none in flight
        self.in_flight: dict[int, str] = {}       # row id -> key
        self.busy_keys: set[str] = set()          # keys of the rows in flight
        self.held = 0                             # rows queued or in flight

    # ------------------------------------------------------------------ marking
    def mark_room(self, now: float) -> int:
        """How many rows to mark now: none while a checkpoint waits for the term to drain."""
        if now >= self.next_checkpoint_s:
            return 0
        return self.marked_max - self.held

    def checkpoint_due(self, now: float) -> bool:
        """Whether to save a checkpoint now (the term is drained and one is due)."""
        return now >= self.next_checkpoint_s and self.held == 0

    def checkpoint_saved(self, now: float) -> None:
        self.next_checkpoint_s = now + self.checkpoint_interval_s

    def add(self, rows) -> None:
        """Rows just marked (any order): queued behind their key's earlier rows."""
        for row in sorted(rows):
            queue = self.queues.setdefault(row.key, deque())
            if not queue and row.key not in self.busy_keys:
                heapq.heappush(self.ready, (row.id, row.key))
            queue.append(row)
            self.held += 1

    # ------------------------------------------------------------------ publishing
    def next_sends(self) -> list[Row]:
        """Rows to publish now, oldest first: each its key's head, within in_flight_max."""
        out = []
        while self.ready and len(self.in_flight) < self.in_flight_max:
            _, key = heapq.heappop(self.ready)
            row = self.queues[key].popleft()
            self.in_flight[row.id] = key
            self.busy_keys.add(key)
            out.append(row)
        return out

    def acked(self, row_id: int) -> None:
        """The row's record is stored (or the row parked): its key's next row may go."""
        key = self.in_flight.pop(row_id)
        self.busy_keys.discard(key)
        self.held -= 1
        self._release(key)

    def drop_unsent(self) -> list[int]:
        """Stepping down: forget the queued rows (never sent); their ids, to reset."""
        ids = [row.id for queue in self.queues.values() for row in queue]
        self.queues.clear()
        self.ready.clear()
        self.held -= len(ids)
        return ids

    def _release(self, key: str) -> None:
        queue = self.queues.get(key)
        if queue:
            heapq.heappush(self.ready, (queue[0].id, key))
        elif queue is not None:
            del self.queues[key]

    @property
    def idle(self) -> bool:
        return self.held == 0
