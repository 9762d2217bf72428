"""The transactional-outbox harvester: publishes the rows a service writes to a PostgreSQL
outbox table (in the same transaction as its business change) to a kera stream.

    Harvester("host=db dbname=shop", "127.0.0.1:7000", "orders", table="outbox").run()

Any number of harvester processes may run; one leads at a time: the member of the consumer
group `group` that owns streamlet 0 of the one-streamlet control stream `<group>.leader`.
The group's self-fence (kera.consumer.membership) makes a leader that cannot heartbeat step
down before its session could expire and another be elected, and the leader publishes only
while that deadline is ahead (Consumer.group_held_until), so two harvesters never publish at
once. A revoked leader (the group moves leadership when members join) holds back its
acknowledgement until its records in flight have landed (Election._revoked). The leader marks
unmarked rows oldest first, publishes each with the row's key, value and headers, at most one
per key in flight and `in_flight_max` overall, and purges a row once its record is
acknowledged. A failed record ends the term (a timeout does not prove it was not stored):
the next term looks its row up and resets it if it is not in the stream. A record the cluster
refuses for what it is (too large) parks its row for an operator (kera.services.outbox.core).

No row is published twice per row id, even after a leader dies between publishing a row and
purging it. Each record carries its row id in a header (`kera-outbox-id`), and each term saves
a checkpoint, the stream's end positions, before publishing anything and again whenever it has
nothing in flight (every `checkpoint_interval_s`). A new term reads the stream from each
earlier term's checkpoint to its end and purges the rows it finds instead of republishing them.
We chose this over a deterministic producer identity per row (a replay de-duplicated by the
broker) because that would make every row its own producer: one chunk, one request and one
broker duplicate-table entry per row, a flood the broker's producer table bounds by forgetting
(kera.broker.producers), while the header costs a few bytes and the lookup reads only the few
seconds of records since the last checkpoint.

The residual window: a leader frozen whole (a stopped VM, SIGSTOP) while its producer holds
records sends them when it resumes, possibly after its successor has looked; it sends nothing
new (its deadline has passed), so at most `in_flight_max` rows may be published twice. A
network partition from the broker can delay a request already sent in the same way. Closing it
would need the broker to fence a producer identity, which kera does not offer yet.

Order: rows of one key are published in id order (bigserial order). Rows of one key written by
concurrent transactions are ordered by id, which is not always their commit order: write a
key's rows from one transaction at a time when their order matters.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import psycopg

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.services.outbox import defaults
from kera.coordinator.groups import SESSION_TIMEOUT_MS_MAX, SESSION_TIMEOUT_MS_MIN
from kera.errors import BadRequest, KeraError, StreamExists
from kera.services.outbox.db import OutboxTable
from kera.services.outbox.term import REVOKE_WAIT_FRACTION, Term
from kera.producer import Producer

log = logging.getLogger("kera.services.outbox.harvester")

APPLICATION_NAME = "kera-outbox"   # the database sessions' application_name
# After a term ends on an error (database or cluster unreachable), the wait before the next.
TERM_RETRY_BACKOFF_S = 1.0
# Terms in a row that fail before harvesting anything, after which a leader leaves the group:
# the database or the cluster may be out of reach from this harvester only.
TERM_FAILURES_MAX = 3
# ... and how long it stays out: a harvester that cannot harvest, rejoining, may be elected
# again (a join can move the leadership), so it does so seldom.
REJOIN_PAUSE_S = 10.0
# A follower re-checks whether it was elected (or asked to stop) this often.
FOLLOWER_WAIT_S = 0.5
PRODUCER_LINGER_MS = 1             # rows go one per key at a time: do not hold them back


@dataclass
class Settings:
    dsn: str
    bootstrap: str
    stream: str
    table: str = defaults.TABLE
    group: str | None = None
    in_flight_max: int = defaults.IN_FLIGHT_MAX
    marked_max: int = defaults.MARKED_MAX
    poll_interval_ms: int = defaults.POLL_INTERVAL_MS
    session_timeout_ms: int = defaults.SESSION_TIMEOUT_MS
    checkpoint_interval_s: float = defaults.CHECKPOINT_INTERVAL_S
    key_file: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def poll_interval_s(self) -> float:
        return self.poll_interval_ms / 1000

    @property
    def control_stream(self) -> str:
        return f"{self.group}.leader"


class Election:
    """Leadership through a consumer group: owning streamlet 0 of the control stream."""

    def __init__(self, s: Settings):
        self.part = (s.control_stream, 0)
        self.elected = threading.Event()
        # Set while no term runs: a revocation waits for it (bounded) before it is acknowledged.
        self.term_over = threading.Event()
        self.term_over.set()
        self.revoke_wait_s = REVOKE_WAIT_FRACTION * s.session_timeout_ms / 1000
        self.consumer = Consumer(s.bootstrap, s.control_stream, group=s.group, start="latest",
                                 on_assigned=self._assigned, on_revoked=self._revoked,
                                 session_timeout_ms=s.session_timeout_ms,
                                 auto_commit_interval_ms=None, key_file=s.key_file)

    def _assigned(self, parts) -> None:
        if self.part in parts:
            log.info("became leader of the outbox group (%s)", self.part[0])
            self.elected.set()

    def _revoked(self, parts) -> None:
        """Called on the consumer's request thread before the revocation is acknowledged (or
        once self-fenced): the term stops, and its records in flight land, before the group
        can elect another leader."""
        if self.part in parts:
            self.elected.clear()
            log.info("stepping down: leadership revoked or self-fenced")
            if not self.term_over.wait(self.revoke_wait_s):
                log.warning("the term did not end within %.1f s of the revocation",
                            self.revoke_wait_s)

    def held(self) -> bool:
        """Leading, and surely alone: the group cannot have elected another yet."""
        if not self.elected.is_set():
            return False
        until = self.consumer.group_held_until()
        return until is not None and time.monotonic() < until

    def close(self) -> None:
        self.elected.clear()
        self.consumer.close()


def connect(dsn: str) -> psycopg.Connection:
    """An autocommit connection whose every wait is bounded (outbox_defaults)."""
    conn = psycopg.connect(dsn, autocommit=True, application_name=APPLICATION_NAME,
                           connect_timeout=defaults.DB_CONNECT_TIMEOUT_S,
                           tcp_user_timeout=defaults.DB_TCP_USER_TIMEOUT_MS, keepalives=1)
    try:
        conn.execute(f"SET statement_timeout = {int(defaults.DB_STATEMENT_TIMEOUT_MS)}")
    except psycopg.Error:
        conn.close()
        raise
    return conn


class Harvester:
    def __init__(self, dsn: str, bootstrap: str, stream: str, *, table: str = defaults.TABLE,
                 group: str | None = None, **options):
        """`group` defaults to "kera-outbox.<table>"; harvesters of one table share it.
        `options`: the other Settings fields (in_flight_max, marked_max, poll_interval_ms,
        session_timeout_ms, checkpoint_interval_s, key_file)."""
        self.s = Settings(dsn, bootstrap, stream, table, group or f"kera-outbox.{table}",
                          **options)
        if not 1 <= self.s.in_flight_max <= self.s.marked_max:
            raise BadRequest(f"in_flight_max={self.s.in_flight_max} and marked_max="
                             f"{self.s.marked_max}: need 1 <= in_flight_max <= marked_max")
        if not SESSION_TIMEOUT_MS_MIN <= self.s.session_timeout_ms <= SESSION_TIMEOUT_MS_MAX:
            raise BadRequest(f"session_timeout_ms={self.s.session_timeout_ms}: the coordinator "
                             f"takes {SESSION_TIMEOUT_MS_MIN}..{SESSION_TIMEOUT_MS_MAX}")
        self.terms = 0

    def stop(self) -> None:
        """Make run() return (after stepping down, if leading); any thread may call it."""
        self.s.stop.set()

    def run(self) -> None:
        """Take part in the election and harvest while leading, until stop()."""
        self._ensure_control_stream()
        while not self.s.stop.is_set():
            election = Election(self.s)
            try:
                self._lead_while_able(election)
            finally:
                election.close()   # leaves the group: another member is elected at once
            self.s.stop.wait(REJOIN_PAUSE_S)

    def _lead_while_able(self, election: Election) -> None:
        """Harvest whenever elected; return after TERM_FAILURES_MAX terms in a row failed
        before harvesting, so a harvester that can reach the database and the cluster leads
        instead."""
        failures = 0
        while not self.s.stop.is_set() and failures < TERM_FAILURES_MAX:
            if election.elected.wait(FOLLOWER_WAIT_S) and election.held():
                failures = 0 if self._term(election) else failures + 1
        if failures >= TERM_FAILURES_MAX:
            log.warning("%d leader terms failed in a row: leaving the group so that another "
                        "harvester leads; rejoining in %.0f s", failures, REJOIN_PAUSE_S)

    def _term(self, election: Election) -> bool:
        """One leadership term; whether it got as far as harvesting (after an error, the next
        begins after a pause)."""
        self.terms += 1
        election.term_over.clear()
        term = None
        try:
            with connect(self.s.dsn) as conn:
                term = Term(self.s, OutboxTable(conn, self.s.table), self._producer(),
                            str(uuid.uuid4()), election)
                term.run()
        except (psycopg.Error, KeraError) as err:
            election.term_over.set()
            log.warning("leader term ended: %s; starting again in %.0f s", err,
                        TERM_RETRY_BACKOFF_S)
            self.s.stop.wait(TERM_RETRY_BACKOFF_S)
        finally:
            election.term_over.set()
        return term is not None and term.took_over

    def _producer(self) -> Producer:
        return Producer(self.s.bootstrap, linger_ms=PRODUCER_LINGER_MS, key_file=self.s.key_file)

    def _ensure_control_stream(self) -> None:
        with Admin(self.s.bootstrap, key_file=self.s.key_file) as admin:
            try:
                admin.create_stream(self.s.control_stream, streamlets=1)
            except StreamExists:
                pass
