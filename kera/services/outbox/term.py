"""One leadership term of the outbox harvester: take over, then mark / publish / purge until
leadership, the database connection or a record's fate is lost (kera.services.outbox.harvester runs terms;
kera.services.outbox.core decides).

Takeover: save this term's checkpoint (the stream's end: everything it will publish lies past
it), then settle the rows earlier terms left marked. Each may have been published and not
purged; its term's checkpoint says where to start looking, and the record's row-id header
says which row it was: the rows found are purged, the others reset, in one transaction.

A term publishes only while its leadership is surely its own (Leadership.held), checked before
every batch of sends, so a leader that lost touch with the coordinator stops before its
session could have expired and another been elected.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING, Protocol

import psycopg

from kera.errors import KeraError, LeadershipLost, PublishUncertain
from kera.services.outbox.core import Flight, Row, record_headers, refused, settle_suspects
from kera.services.outbox.db import OutboxTable
from kera.services.outbox.tail import end_positions, published_row_ids

if TYPE_CHECKING:
    from kera.services.outbox.harvester import Settings

log = logging.getLogger("kera.services.outbox.harvester")

# The record header naming the term that published it (which harvester, for operators).
LEADER_HEADER = "kera-outbox-leader"
# Stepping down, in fractions of the session timeout: wait this long for the records in flight
# to settle (their rows purged instead of left for the successor to look up), then at most this
# long for the producer to close. A revoked leader holds back its acknowledgement of the
# revocation meanwhile (kera.services.outbox.harvester.Election), within REVOKE_WAIT_FRACTION of the session, so
# the successor is elected only after its records landed.
STEP_DOWN_DRAIN_FRACTION = 0.3
PRODUCER_CLOSE_FRACTION = 0.1
REVOKE_WAIT_FRACTION = 0.5
# How often a leader logs what it published.
REPORT_INTERVAL_S = 10.0


class Leadership(Protocol):
    def held(self) -> bool: ...


class Term:
    def __init__(self, settings: "Settings", table: OutboxTable, producer, leader_id: str,
                 leadership: Leadership):
        self.s, self.table, self.producer = settings, table, producer
        self.leader_id, self.leadership = leader_id, leadership
        # (row id, error or None). Not a SimpleQueue: in CPython 3.11 its get(timeout) blocks
        # for good when a signal handler (SIGTERM's stop) outlasts the timeout, which froze a
        # leader told to stop; queue.Queue's wait recomputes the deadline correctly.
        self.results: queue.Queue = queue.Queue()
        self.flight = Flight(settings.in_flight_max, settings.marked_max,
                             settings.checkpoint_interval_s, time.monotonic())
        self.published = 0
        self.took_over = False   # got as far as harvesting
        self.reported = (time.monotonic(), 0)

    # ------------------------------------------------------------------ takeover
    def take_over(self) -> None:
        self.table.save_checkpoint(self.leader_id, self._end())
        suspects = self.table.suspects(self.leader_id)
        checkpoints = self.table.checkpoints(suspects)
        published: set[int] = set()
        for leader, ids in suspects.items():
            if leader in checkpoints:   # without one, that term never published anything
                published |= published_row_ids(self.s.bootstrap, self.s.stream,
                                                checkpoints[leader], ids, self.s.key_file)
        every = set().union(*suspects.values()) if suspects else set()
        purge, reset = settle_suspects(every, published)
        if not self.leadership.held():   # the lookup took long enough for another to lead
            raise LeadershipLost("leadership lapsed during the takeover; nothing was settled")
        self.table.settle(self.leader_id, sorted(suspects), purge, reset)
        log.info("leader %s: took over; of %d rows left marked by earlier terms, %d were "
                 "published (purged) and %d reset", self.leader_id, len(every), len(purge),
                 len(reset))

    def _end(self):
        return end_positions(self.s.bootstrap, self.s.stream, self.s.key_file)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Take over, then harvest until leadership is lost or `stop` is set; raises on
        database and cluster errors."""
        try:
            self.take_over()
            self.took_over = True
            while self.leadership.held() and not self.s.stop.is_set():
                self._settle(self._drain_results())
                if not self._step():
                    self._settle(self._wait_results(self.s.poll_interval_s))
                self._report()
        finally:
            self._step_down()

    def _step(self) -> bool:
        """Checkpoint, mark and send what is due; whether anything was sent."""
        now = time.monotonic()
        if self.flight.checkpoint_due(now):
            self.table.save_checkpoint(self.leader_id, self._end())
            self.flight.checkpoint_saved(time.monotonic())
        room = self.flight.mark_room(now)
        if room:
            self.flight.add(self.table.mark(self.leader_id, room))
        if not self.leadership.held():   # checked again: marking may have taken a while
            return False
        sends = self.flight.next_sends()
        for row in sends:
            self._send(row)
        return bool(sends)

    def _send(self, row: Row) -> None:
        def done(err, _metadata, row_id=row.id):
            self.results.put((row_id, err))
        headers = [*record_headers(row), (LEADER_HEADER, self.leader_id.encode())]
        try:
            self.producer.send(self.s.stream, row.value, key=row.key.encode(), headers=headers,
                               on_delivery=done)
        except (KeraError, TypeError) as err:   # refused records are parked, others raised
            if not refused(err):
                raise
            done(err, None)

    def _drain_results(self) -> list:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def _wait_results(self, timeout_s: float) -> list:
        try:
            first = self.results.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *self._drain_results()]

    def _settle(self, results: list) -> None:
        """Purge the rows whose records are stored and park the refused ones; a failure that
        leaves a row's fate unknown ends the term (raised after the others are settled)."""
        acked, parked, uncertain = [], [], []
        for row_id, err in results:
            if err is not None and not refused(err):
                uncertain.append((row_id, err))
                continue
            self.flight.acked(row_id)
            (acked if err is None else parked).append(row_id)
            if err is not None:
                log.error("leader %s: row %d refused (%s): parked; fix it and set its leader_id "
                          "to NULL to publish it, or delete it", self.leader_id, row_id, err)
        self.table.purge(acked)
        self.table.park(self.leader_id, parked)
        self.published += len(acked)
        if uncertain:
            row_id, err = uncertain[0]
            raise PublishUncertain(f"row {row_id} (and {len(uncertain) - 1} more) not "
                                   f"acknowledged: {err}; a new term looks them up in the stream")

    def _report(self) -> None:
        at, count = self.reported
        now = time.monotonic()
        if now - at >= REPORT_INTERVAL_S:
            log.info("leader %s: published %d rows in %.0f s (%d in all)", self.leader_id,
                     self.published - count, now - at, self.published)
            self.reported = (now, self.published)

    # ------------------------------------------------------------------ stepping down
    def _step_down(self) -> None:
        """Reset the rows never sent, settle what is in flight for a moment, then close the
        producer; rows still marked are left to the next term's takeover."""
        session_s = self.s.session_timeout_ms / 1000
        deadline = time.monotonic() + STEP_DOWN_DRAIN_FRACTION * session_s
        try:
            self.table.reset(self.leader_id, self.flight.drop_unsent())
            while self.flight.in_flight and time.monotonic() < deadline:
                self._settle(self._wait_results(deadline - time.monotonic()))
        except (psycopg.Error, KeraError) as err:   # the next term's takeover settles them
            log.warning("leader %s: while stepping down: %s", self.leader_id, err)
        finally:
            try:
                self.producer.close(PRODUCER_CLOSE_FRACTION * session_s)
            except KeraError as err:
                log.warning("leader %s: %s (left for the next leader to look up)",
                            self.leader_id, err)
        log.info("leader %s: stepped down (published %d rows; %d left marked)", self.leader_id,
                 self.published, self.flight.held)
