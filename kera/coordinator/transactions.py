"""Transactions (KIP-98's coordinator in kera's shape): transactional ids, epochs, two-phase
commit. Sans-IO.

A transactional producer names itself by a *transactional id*; `init` gives it a producer id
and an *epoch*, and a later `init` of the same id bumps the epoch, which *fences* the older
instance: every op it sends after that is refused (ProducerFenced), and a transaction it left
open is aborted. A transaction begins with the first `add_partitions` (or `add_positions`)
after the id's last one completed; its parts are (stream, streamlet) pairs, Kafka's partitions.

Ending is two-phase. `end(commit)` moves Ongoing to PrepareCommit (the *decision*: once the
coordinator has persisted it, the transaction commits whatever dies), applies the positions
sent to the transaction (returned for the caller to hand to the group stores in the same
persisted change), and lists one *marker* per part. The shell sends each marker to the
streamlet's broker, which appends a control chunk and answers once it is durable;
`marker_written` records that, and when every part's marker is written the transaction is
CompleteCommit and the id may begin its next one. Aborts go the same way through PrepareAbort.
Unacknowledged markers are sent again (`markers_due`), also by a coordinator that took over:
which parts are written is persisted, which were sent is not.

`expire(now)` aborts transactions open longer than their timeout (bumping the epoch, so the
stuck producer is fenced, as Kafka does) and forgets ids idle for ID_EXPIRY_S. Brokers ask
`verify` before taking a producer's first transactional chunk for a streamlet (KIP-890's
verification: no chunk lands in a transaction that is not open, so none hangs), and `resolve`
what to do with a transaction they hold open (after a rebuild, or one older than the longest
timeout). Timestamps are this coordinator's monotonic clock and are not persisted: a loaded
transaction's timeout counts from the load (docs/TRANSACTIONS.md).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kera.errors import (BadRequest, ConcurrentTransactions, InvalidTransactionTimeout,
                         InvalidTxnState, ProducerFenced, TransactionTimedOut,
                         UnknownTransactionalId)

# --------------------------------------------------------------------------- states
EMPTY = "Empty"
ONGOING = "Ongoing"
PREPARE_COMMIT = "PrepareCommit"
PREPARE_ABORT = "PrepareAbort"
COMPLETE_COMMIT = "CompleteCommit"
COMPLETE_ABORT = "CompleteAbort"
DEAD = "Dead"      # forgotten (expired); never persisted, named for describe and tests
# The transitions, as data (h11's _state.py): anything else is a bug, asserted in _move.
TRANSITIONS = {
    EMPTY: (EMPTY, ONGOING, DEAD),
    ONGOING: (ONGOING, PREPARE_COMMIT, PREPARE_ABORT),
    PREPARE_COMMIT: (COMPLETE_COMMIT,),
    PREPARE_ABORT: (COMPLETE_ABORT,),
    COMPLETE_COMMIT: (EMPTY, ONGOING, DEAD),
    COMPLETE_ABORT: (EMPTY, ONGOING, DEAD),
    DEAD: (),
}
PREPARED = (PREPARE_COMMIT, PREPARE_ABORT)
OPEN = (ONGOING, *PREPARED)                       # its parts count in parts_held
IDLE = (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT)   # a next transaction may begin
STATES = tuple(TRANSITIONS)

# --------------------------------------------------------------------------- bounds
# Transactional ids kept at once. Each costs ~0.3 KB persisted plus its parts and positions;
# 10,000 ids are ~3 MB of coordinator state, far inside kera.coordinator.store's 256 MiB, and
# far above what the deployments kera targets run (one id per task of an exactly-once job).
TRANSACTIONAL_IDS_MAX = 10_000
TRANSACTIONAL_ID_CHARS_MAX = 255     # as a group id (Kafka bounds neither; ours are persisted)
# Parts one transaction may touch: a read-process-write task writes a few streams; the bound
# caps the markers one `end` orders (each is a broker request and a control chunk).
PARTS_PER_TRANSACTION_MAX = 10_000
# Parts of all open transactions together: ~60 bytes each persisted, so ~60 MB at worst.
# Without it TRANSACTIONAL_IDS_MAX * PARTS_PER_TRANSACTION_MAX would allow 10^8.
PARTS_ALL_TRANSACTIONS_MAX = 1_000_000
# Groups whose positions one transaction carries (a job consumes as one group, rarely more),
# and positions in all (one per part read).
GROUPS_PER_TRANSACTION_MAX = 16
POSITIONS_PER_TRANSACTION_MAX = 65_536
GROUP_CHARS_MAX = 255                 # Kafka's group.id bound, as kera.coordinator.groups
# Transaction timeouts a producer may ask for. The floor leaves a transaction time for a few
# produce round trips and a broker failover's not_ready (~1 s); the ceiling is Kafka's
# transaction.max.timeout.ms default, 15 min: how long a stuck producer may hold every
# read_committed reader of its streamlets back. The default is Kafka's transaction.timeout.ms.
TIMEOUT_MS_MIN = 1_000
TIMEOUT_MS_MAX = 900_000
TIMEOUT_MS_DEFAULT = 60_000
# An id without a transaction for this long is forgotten (Kafka's transactional.id.expiration.ms
# default, 7 days): ids are chosen by applications, and a retired job's id must not stay forever.
ID_EXPIRY_S = 7 * 24 * 3600.0
# Producer ids are issued below 2**PRODUCER_ID_BITS: a Kafka producer id shifted left by the
# Kafka listener's EPOCH_BITS (kera.broker.kafka.produce) must fit a kera u64 producer id and
# stay a positive i64 (kera.broker.kafka.producer_ids.PRODUCER_ID_BITS, the same 55).
PRODUCER_ID_BITS = 55
PRODUCER_ID_MAX = (1 << PRODUCER_ID_BITS) - 1
# A producer id's epochs: the Kafka listener keeps 8 bits of the epoch in the kera producer
# id (EPOCH_BITS), so epoch 256 would meet epoch 0's duplicate-detection entries. An id whose
# epoch would reach EPOCH_MAX at `init` gets a new producer id at epoch 0 instead (Kafka does the
# same at 32767); an open transaction's epoch thus stays below EPOCH_MAX, leaving room for the
# bump a fence or a timeout makes.
EPOCH_MAX = 255
# Transactions numbered per producer id: the marker's control record carries the number in
# its i32 coordinator_epoch field (docs/TRANSACTIONS.md) so a broker can tell a stale marker;
# an id that used them all gets a new producer id.
TXN_NUMBER_MAX = 2**31 - 1
# A marker not acknowledged within this is sent again: a broker answers once the control chunk
# is durable (one replication round trip, milliseconds); a second also rides out a failover's
# not_ready without flooding the new owner.
MARKER_RETRY_S = 1.0
# Markers `markers_due` hands out in one call: bounds one loop turn's sends (the rest follow).
MARKERS_PER_TURN_MAX = 10_000

Part = tuple[str, int]


# --------------------------------------------------------------------------- errors
# The classes live in kera.errors (they cross the wire); ERRORS names them for this module's users.
ERRORS = (ProducerFenced, TransactionTimedOut, ConcurrentTransactions, InvalidTxnState,
          UnknownTransactionalId, InvalidTransactionTimeout)


# --------------------------------------------------------------------------- data
class Marker(NamedTuple):
    """An order to a streamlet's broker: close `producer_id`'s transaction number `txn` there,
    committed or aborted, with a control chunk at `epoch` (which fences older epochs)."""
    transactional_id: str
    producer_id: int
    epoch: int
    txn: int
    commit: bool
    stream: str
    streamlet: int

    @property
    def part(self) -> Part:
        return self.stream, self.streamlet

    def to_wire(self) -> list:
        return list(self)


class Resolution(NamedTuple):
    decision: str     # "open", "commit" or "abort"
    txn: int          # the transaction's number; -1: none of the coordinator's (abort it)


class EndResult(NamedTuple):
    markers: list[Marker]                     # to write (none: already complete)
    positions: dict[str, dict[Part, Any]]     # group -> positions to apply now (commits only)


@dataclass
class Txn:
    id: str
    producer_id: int
    epoch: int
    timeout_ms: int
    state: str = EMPTY
    number: int = 0                 # transactions begun under this producer id
    parts: set = field(default_factory=set)
    written: set = field(default_factory=set)     # parts whose marker is durable
    positions: dict = field(default_factory=dict)  # group -> {part: position}
    timed_out_epoch: int = -1       # the epoch a timeout fenced (TransactionTimedOut, KIP-588)
    # The epoch is a fence's bump, issued to no producer: every op is refused until an init.
    fenced: bool = False
    started_s: float = 0.0
    updated_s: float = 0.0
    sent_s: dict = field(default_factory=dict)    # part -> when its marker was last sent

    @property
    def committing(self) -> bool:
        return self.state in (PREPARE_COMMIT, COMPLETE_COMMIT)

    def markers(self) -> list[Marker]:
        return [Marker(self.id, self.producer_id, self.epoch, self.number, self.committing, s, sl)
                for s, sl in sorted(self.parts - self.written)]


def _random_producer_id() -> int:
    return 1 + secrets.randbelow(PRODUCER_ID_MAX)


# --------------------------------------------------------------------------- the machine
class Transactions:
    """Every transactional id of the cluster. `id_source()` issues producer ids (random by
    default; tests inject a counter)."""

    def __init__(self, id_source=None):
        self.txns: dict[str, Txn] = {}
        self.by_producer: dict[int, str] = {}   # producer id -> transactional id
        self.parts_held = 0                     # sum of len(t.parts): PARTS_ALL_TRANSACTIONS_MAX
        # Ids in a Prepare state: `markers_due` runs every loop turn and looks at these only.
        self.prepared: set[str] = set()
        self._id_source = id_source or _random_producer_id
        self.dirty = False                      # persisted state changed since take_dirty()

    # ------------------------------------------------------------------ producers
    def init(self, tid: str, timeout_ms: int, now: float, producer_id: int = -1,
             epoch: int = -1) -> tuple[int, int]:
        """(producer id, epoch) for a producer starting under `tid`. `producer_id`/`epoch`:
        the ones it had (KIP-360/588), -1 for a new instance. An open transaction is aborted
        first: ConcurrentTransactions until its markers are written, then init again."""
        _check_id(tid)
        _check_timeout(timeout_ms)
        t = self.txns.get(tid)
        if t is None:
            return self._create(tid, timeout_ms, now)
        if producer_id >= 0 and (producer_id, epoch) != (t.producer_id, t.epoch) \
                and (producer_id, epoch) != (t.producer_id, t.timed_out_epoch):
            raise ProducerFenced(f"transactional id {tid!r} is held by producer {t.producer_id} "
                                 f"epoch {t.epoch}, not {producer_id} epoch {epoch}")
        if t.state in PREPARED:
            raise ConcurrentTransactions(f"transactional id {tid!r}: the previous transaction "
                                         f"is still being {_verb(t)}: retry")
        if t.state == ONGOING:
            self._abort(t, now, fence=True)
            if t.state in PREPARED:     # markers to write first (none: aborted already)
                raise ConcurrentTransactions(f"transactional id {tid!r} had transaction "
                                             f"{t.number} open: it is being aborted; retry")
        t.timeout_ms = timeout_ms
        self._bump(t, now)
        return t.producer_id, t.epoch

    def _create(self, tid: str, timeout_ms: int, now: float) -> tuple[int, int]:
        if len(self.txns) >= TRANSACTIONAL_IDS_MAX:
            raise BadRequest(f"{TRANSACTIONAL_IDS_MAX} transactional ids are in use, the most "
                             f"the coordinator keeps: reuse ids (ids idle {ID_EXPIRY_S / 86400:g} "
                             f"days are forgotten)")
        t = self.txns[tid] = Txn(tid, self._issue(), 0, timeout_ms, started_s=now, updated_s=now)
        self.by_producer[t.producer_id] = tid
        self.dirty = True
        return t.producer_id, t.epoch

    def _issue(self) -> int:
        """A producer id no transactional id holds (a collision is one in 2**55 per pair)."""
        while True:
            pid = self._id_source()
            assert 0 < pid <= PRODUCER_ID_MAX, pid
            if pid not in self.by_producer:
                return pid

    def _bump(self, t: Txn, now: float) -> None:
        """The next epoch of an idle id (a new producer id when epochs or numbers ran out)."""
        if t.epoch + 1 >= EPOCH_MAX or t.number >= TXN_NUMBER_MAX:
            del self.by_producer[t.producer_id]
            t.producer_id, t.epoch, t.number = self._issue(), 0, 0
            self.by_producer[t.producer_id] = t.id
        else:
            t.epoch += 1
        t.timed_out_epoch, t.fenced = -1, False
        self._move(t, EMPTY, now)

    # ------------------------------------------------------------------ a transaction's content
    def add_partitions(self, tid: str, producer_id: int, epoch: int, parts, now: float) -> int:
        """Add `parts` to the open transaction (beginning one if the id is idle); its number."""
        t = self._owned(tid, producer_id, epoch)
        new = set(map(_part, parts))
        self._check_begin(t)     # every check before any change: a refusal changes nothing
        current = t.parts if t.state == ONGOING else set()
        added = new - current
        if len(current) + len(added) > PARTS_PER_TRANSACTION_MAX:
            raise BadRequest(f"a transaction touches at most {PARTS_PER_TRANSACTION_MAX} "
                             f"streamlets; {tid!r} has {len(current)} and adds {len(added)}")
        if self.parts_held + len(added) > PARTS_ALL_TRANSACTIONS_MAX:
            raise BadRequest(f"open transactions hold {self.parts_held} streamlets, the most "
                             f"is {PARTS_ALL_TRANSACTIONS_MAX}: commit or abort some first")
        self._begin(t, now)
        if added:
            t.parts |= added
            self.parts_held += len(added)
            self.dirty = True
        t.updated_s = now
        return t.number

    def add_positions(self, tid: str, producer_id: int, epoch: int, group: str, positions: dict,
                      now: float) -> int:
        """Join `positions` ({part: position}) of consumer group `group` to the transaction:
        applied to the group when it commits, dropped when it aborts. Empty `positions` only
        names the group (Kafka's AddOffsetsToTxn). A part's later position replaces its earlier."""
        t = self._owned(tid, producer_id, epoch)
        if not isinstance(group, str) or not 0 < len(group) <= GROUP_CHARS_MAX:
            raise BadRequest(f"a group name is a string of 1 to {GROUP_CHARS_MAX} characters, "
                             f"not {group!r:.100}")
        checked = {_part(p): pos for p, pos in positions.items()}
        self._check_begin(t)
        current = t.positions if t.state == ONGOING else {}
        table = current.get(group)
        if table is None and len(current) >= GROUPS_PER_TRANSACTION_MAX:
            raise BadRequest(f"a transaction carries positions of at most "
                             f"{GROUPS_PER_TRANSACTION_MAX} groups")
        held = sum(map(len, current.values())) - len((table or {}).keys() & checked.keys())
        if held + len(checked) > POSITIONS_PER_TRANSACTION_MAX:
            raise BadRequest(f"a transaction carries at most {POSITIONS_PER_TRANSACTION_MAX} "
                             f"positions")
        self._begin(t, now)
        t.positions.setdefault(group, {}).update(checked)
        t.updated_s = now
        self.dirty = True
        return t.number

    def _check_begin(self, t: Txn) -> None:
        """Refuse when no transaction is open and none may begin now."""
        if t.state in PREPARED:
            raise ConcurrentTransactions(f"transactional id {t.id!r}: transaction {t.number} "
                                         f"is still being {_verb(t)}: retry")
        if t.state != ONGOING and t.number >= TXN_NUMBER_MAX:
            raise ProducerFenced(f"transactional id {t.id!r} used every transaction number of "
                                 f"producer {t.producer_id}: call init_transactions again")

    def _begin(self, t: Txn, now: float) -> None:
        """Open a transaction on an idle id (no-op when one is open)."""
        self._check_begin(t)
        if t.state == ONGOING:
            return
        assert t.state in IDLE, t.state
        t.parts, t.written, t.positions, t.sent_s = set(), set(), {}, {}
        t.number += 1
        t.started_s = now
        self._move(t, ONGOING, now)

    # ------------------------------------------------------------------ ending
    def end(self, tid: str, producer_id: int, epoch: int, commit: bool, now: float) -> EndResult:
        """Commit or abort the open transaction: the decision, the markers it orders, and (for
        a commit) the positions to apply. A retry of the same decision answers again."""
        t = self.txns.get(tid)
        if t is not None and not commit and _is_timed_out(t, producer_id, epoch):
            return EndResult([], {})          # already aborted by its timeout: done
        t = self._owned(tid, producer_id, epoch)
        wanted = PREPARE_COMMIT if commit else PREPARE_ABORT
        if t.state == ONGOING:
            # Decided: the positions go to their groups now (in the change that persists the
            # decision) or nowhere.
            positions, t.positions = (t.positions if commit else {}), {}
            if commit:
                self._move(t, PREPARE_COMMIT, now)
            else:
                self._abort(t, now, fence=False)
            self._complete_if_written(t, now)
            return EndResult(t.markers(), positions)
        if t.state in (wanted, _completed(wanted)):
            return EndResult(t.markers(), {})   # a retry: positions were applied the first time
        raise InvalidTxnState(f"cannot {'commit' if commit else 'abort'} under transactional id "
                              f"{tid!r}: its transaction is {t.state}")

    def _abort(self, t: Txn, now: float, fence: bool) -> None:
        """Ongoing -> PrepareAbort; `fence`: bump the epoch too, so the markers (and the
        coordinator) refuse the producer that left it open."""
        if fence:
            # Ongoing only at an issued epoch, and _bump issues them below EPOCH_MAX.
            assert not t.fenced and t.epoch + 1 <= EPOCH_MAX, (t.id, t.epoch)
            t.epoch += 1
            t.fenced = True
        t.positions = {}
        self._move(t, PREPARE_ABORT, now)
        self._complete_if_written(t, now)

    def marker_written(self, marker: Marker, now: float) -> bool:
        """A broker holds `marker` durably. True when that completed its transaction; an
        acknowledgement of another transaction (late, duplicated) changes nothing."""
        t = self.txns.get(marker.transactional_id)
        if (t is None or t.state not in PREPARED or t.producer_id != marker.producer_id
                or t.number != marker.txn or marker.part not in t.parts
                or marker.commit != t.committing):
            return False
        if marker.part not in t.written:
            t.written.add(marker.part)
            self.dirty = True
        t.sent_s.pop(marker.part, None)
        return self._complete_if_written(t, now)

    def _complete_if_written(self, t: Txn, now: float) -> bool:
        if t.state not in PREPARED or t.written < t.parts:
            return False
        self._move(t, _completed(t.state), now)
        return True

    def markers_due(self, now: float) -> list[Marker]:
        """Markers to send now: never sent by this coordinator, or unanswered MARKER_RETRY_S.
        Call only once the state that ordered them is persisted."""
        out: list[Marker] = []
        for tid in sorted(self.prepared):
            t = self.txns[tid]
            for m in t.markers():
                if now - t.sent_s.get(m.part, float("-inf")) >= MARKER_RETRY_S:
                    t.sent_s[m.part] = now
                    out.append(m)
                    if len(out) >= MARKERS_PER_TURN_MAX:
                        return out
        return out

    # ------------------------------------------------------------------ time
    def expire(self, now: float) -> list[Marker]:
        """Abort transactions open past their timeout (fencing their producer) and forget ids
        idle ID_EXPIRY_S. Returns the abort markers now ordered."""
        out: list[Marker] = []
        for t in list(self.txns.values()):
            if t.state == ONGOING and now - t.started_s > t.timeout_ms / 1000:
                fenced = t.epoch
                self._abort(t, now, fence=True)
                t.timed_out_epoch = fenced
                out += t.markers()
            elif t.state in IDLE and now - t.updated_s > ID_EXPIRY_S:
                self._forget(t, now)
        return out

    def _forget(self, t: Txn, now: float) -> None:
        self._move(t, DEAD, now)
        del self.txns[t.id]
        del self.by_producer[t.producer_id]

    def forget_stream(self, stream: str, now: float) -> None:
        """A deleted stream's streamlets leave every transaction: their markers can never be
        written (and are not needed: the data went with the stream)."""
        for t in self.txns.values():
            gone = {p for p in t.parts if p[0] == stream}
            if gone:
                self._move(t, t.state, now)   # a move to itself: marks the change
                t.parts -= gone
                t.written -= gone
                if t.state in OPEN:
                    self.parts_held -= len(gone)
                self._complete_if_written(t, now)
            for table in t.positions.values():
                for p in [p for p in table if p[0] == stream]:
                    del table[p]
                    self.dirty = True

    # ------------------------------------------------------------------ brokers' questions
    def verify(self, producer_id: int, epoch: int, part, now: float, add: bool = False) -> int:
        """Before a broker takes `producer_id`'s first transactional chunk for `part`: the
        number of the open transaction holding `part` (`add`: adding it, for kera's own
        producers, which skip add_partitions). Refused otherwise, so nothing hangs."""
        tid = self.by_producer.get(producer_id)
        if tid is None:
            raise InvalidTxnState(f"producer {producer_id} holds no transactional id: its "
                                  f"transactional chunks are refused")
        if add:
            return self.add_partitions(tid, producer_id, epoch, [part], now)
        t = self._owned(tid, producer_id, epoch)
        if t.state != ONGOING or _part(part) not in t.parts:
            raise InvalidTxnState(f"producer {producer_id} has no open transaction holding "
                                  f"{_part(part)} (add the partition before producing to it)")
        return t.number

    def resolve(self, producer_id: int, epoch: int, part) -> Resolution:
        """What a broker does with a transaction of `producer_id` at `epoch` it holds open on
        `part` (after a rebuild, or open longer than the longest timeout): "open" (it is; wait),
        "commit" or "abort" (that marker is due), with the transaction's number, or -1 for a
        transaction the coordinator does not hold open there: one that never committed (a
        committed one's marker was durable there before its commit completed), to abort."""
        tid = self.by_producer.get(producer_id)
        t = self.txns.get(tid) if tid is not None else None
        part = _part(part)
        if (t is None or t.state not in OPEN or part not in t.parts or part in t.written
                or epoch > t.epoch):
            return Resolution("abort", -1)
        if t.state == ONGOING and epoch == t.epoch:
            return Resolution("open", t.number)
        if t.state == PREPARE_COMMIT and epoch == t.epoch:
            return Resolution("commit", t.number)
        if t.state == PREPARE_ABORT:
            return Resolution("abort", t.number)
        return Resolution("abort", -1)     # an older epoch's: its own abort was written

    # ------------------------------------------------------------------ checks and moves
    def _owned(self, tid: str, producer_id: int, epoch: int) -> Txn:
        """The id's transaction, if (producer_id, epoch) is its current producer."""
        t = self.txns.get(tid)
        if t is None:
            raise UnknownTransactionalId(f"no producer holds transactional id {tid!r:.300}: "
                                         f"call init_transactions first")
        if _is_timed_out(t, producer_id, epoch):
            raise TransactionTimedOut(f"transaction {t.number} of {tid!r} was open more than "
                                      f"{t.timeout_ms} ms and was aborted: abort, init again")
        if (producer_id, epoch) != (t.producer_id, t.epoch) or t.fenced:
            raise ProducerFenced(f"transactional id {tid!r} is held by producer "
                                 f"{t.producer_id} epoch {t.epoch}; producer {producer_id} "
                                 f"epoch {epoch} was fenced by a newer instance")
        return t

    def _move(self, t: Txn, state: str, now: float) -> None:
        """The one place a state changes: checked against TRANSITIONS, `parts_held` kept."""
        assert state == t.state or state in TRANSITIONS[t.state], f"{t.id}: {t.state} -> {state}"
        self.parts_held += len(t.parts) * ((state in OPEN) - (t.state in OPEN))
        assert self.parts_held >= 0, self.parts_held
        t.state = state
        t.updated_s = now
        self.dirty = True
        if state in PREPARED:
            self.prepared.add(t.id)
        else:
            self.prepared.discard(t.id)

    # ------------------------------------------------------------------ views
    def describe(self, tid: str) -> dict:
        t = self.txns.get(tid)
        if t is None:
            raise UnknownTransactionalId(f"no transactional id {tid!r:.300}")
        return {"transactional_id": t.id, "producer_id": t.producer_id, "epoch": t.epoch,
                "state": t.state, "timeout_ms": t.timeout_ms, "txn": t.number,
                "parts": [list(p) for p in sorted(t.parts)],
                "pending_markers": [list(p) for p in sorted(t.parts - t.written)]
                if t.state in PREPARED else [],
                "groups": sorted(t.positions)}

    def summaries(self) -> list[dict]:
        return [{"transactional_id": t.id, "producer_id": t.producer_id, "state": t.state}
                for _, t in sorted(self.txns.items())]

    def take_dirty(self) -> bool:
        dirty, self.dirty = self.dirty, False
        return dirty

    # ------------------------------------------------------------------ persistence
    def to_state(self) -> list[dict]:
        """JSON-ready, one dict per id (keyed by "id": a keyed section of the store)."""
        return [_txn_state(t) for _, t in sorted(self.txns.items())]

    def load(self, state: list[dict], now: float) -> None:
        """Ids as `to_state` wrote them, loaded at `now` (a restart or a takeover): an open
        transaction's timeout counts from now; a prepared one's markers are all due."""
        for entry in state:
            try:
                t = _txn_from_state(entry, now)
            except (BadRequest, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"a transaction in the metadata is malformed ({exc}): "
                                 f"{entry!r:.300}") from None
            if t.id in self.txns or t.producer_id in self.by_producer:
                raise ValueError(f"transactional id {t.id!r} or producer {t.producer_id} twice")
            self.txns[t.id] = t
            self.by_producer[t.producer_id] = t.id
            if t.state in OPEN:
                self.parts_held += len(t.parts)
            if t.state in PREPARED:
                self.prepared.add(t.id)


def _txn_state(t: Txn) -> dict:
    return {"id": t.id, "producer_id": t.producer_id, "epoch": t.epoch, "state": t.state,
            "timeout_ms": t.timeout_ms, "txn": t.number, "timed_out_epoch": t.timed_out_epoch,
            "fenced": t.fenced,
            "parts": [list(p) for p in sorted(t.parts)],
            "written": [list(p) for p in sorted(t.written)],
            "positions": [[g, [[s, sl, pos] for (s, sl), pos in sorted(table.items())]]
                          for g, table in sorted(t.positions.items())]}


def _txn_from_state(e: dict, now: float) -> Txn:
    state = e["state"]
    if state not in STATES or state == DEAD:
        raise ValueError(f"transaction state {state!r} is not one of {STATES[:-1]}")
    t = Txn(str(e["id"]), int(e["producer_id"]), int(e["epoch"]), int(e["timeout_ms"]),
            state=state, number=int(e["txn"]), timed_out_epoch=int(e["timed_out_epoch"]),
            fenced=bool(e["fenced"]),
            parts={_part(p) for p in e["parts"]}, written={_part(p) for p in e["written"]},
            positions={str(g): {_part(pos[:2]): pos[2] for pos in table}
                       for g, table in e["positions"]},
            started_s=now, updated_s=now)
    if not (0 < t.producer_id <= PRODUCER_ID_MAX and 0 <= t.epoch <= EPOCH_MAX
            and t.written <= t.parts):
        raise ValueError(f"transactional id {t.id!r}: inconsistent state {e!r:.300}")
    return t


# --------------------------------------------------------------------------- helpers
def _check_id(tid) -> None:
    if not isinstance(tid, str) or not 0 < len(tid) <= TRANSACTIONAL_ID_CHARS_MAX:
        raise BadRequest(f"a transactional id is a string of 1 to {TRANSACTIONAL_ID_CHARS_MAX} "
                         f"characters, not {tid!r:.100}")


def _check_timeout(timeout_ms) -> None:
    if type(timeout_ms) is not int or not TIMEOUT_MS_MIN <= timeout_ms <= TIMEOUT_MS_MAX:
        raise InvalidTransactionTimeout(f"transaction timeout {timeout_ms!r:.30} ms is outside "
                                        f"[{TIMEOUT_MS_MIN}, {TIMEOUT_MS_MAX}]")


def _is_timed_out(t: Txn, producer_id: int, epoch: int) -> bool:
    return t.timed_out_epoch >= 0 and (producer_id, epoch) == (t.producer_id, t.timed_out_epoch)


def _completed(prepared: str) -> str:
    return COMPLETE_COMMIT if prepared == PREPARE_COMMIT else COMPLETE_ABORT


def _verb(t: Txn) -> str:
    return "committed" if t.committing else "aborted"


def _part(value) -> Part:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str)
            and 0 < len(value[0]) <= TRANSACTIONAL_ID_CHARS_MAX
            and type(value[1]) is int and 0 <= value[1] < 2**31):
        raise BadRequest(f"a part is [stream, streamlet], not {value!r:.100}")
    return value[0], value[1]


# --------------------------------------------------------------------------- the coordinator's ops
def ops(txns: Transactions, apply_positions=None, check_positions=None) -> dict:
    """Request handlers of the transaction ops, for Coordinator.handle: (Fields, now) -> reply.
    `check_positions(f, group, {part: position})` is every check of the group's store, run
    when positions join (their shape; the member id and epoch in `f`, KIP-447), raising a
    KeraError; `apply_positions(group, {part: position})` writes them into the store in the
    handler of the commit decision, so they persist with it. It must not refuse: the decision
    is taken by then, and positions it dropped would be lost."""
    apply_positions = apply_positions or (lambda group, positions: None)
    check_positions = check_positions or (lambda f, group, positions: None)

    def owner(f) -> tuple:
        return (f.str("transactional_id", hi=TRANSACTIONAL_ID_CHARS_MAX),
                f.int("producer_id", hi=PRODUCER_ID_MAX), f.int("epoch", hi=EPOCH_MAX))

    def init(f, now):
        pid, epoch = txns.init(f.str("transactional_id", hi=TRANSACTIONAL_ID_CHARS_MAX),
                               f.int("timeout_ms", TIMEOUT_MS_DEFAULT, hi=2**31), now,
                               f.int("producer_id", -1, lo=-1, hi=PRODUCER_ID_MAX),
                               f.int("epoch", -1, lo=-1, hi=EPOCH_MAX))
        return {"producer_id": pid, "epoch": epoch}

    def add_parts(f, now):
        parts = f.list("parts", max_len=PARTS_PER_TRANSACTION_MAX)
        return {"txn": txns.add_partitions(*owner(f), parts, now)}

    def add_positions(f, now):
        group = f.str("group", hi=GROUP_CHARS_MAX)
        positions = _positions(f.list("positions", [], max_len=POSITIONS_PER_TRANSACTION_MAX))
        check_positions(f, group, positions)
        return {"txn": txns.add_positions(*owner(f), group, positions, now)}

    def end(f, now):
        result = txns.end(*owner(f), f.bool("commit"), now)
        for group, positions in result.positions.items():
            apply_positions(group, positions)
        return {"markers": len(result.markers)}

    def verify(f, now):
        part = f.list("part", max_len=2)
        return {"txn": txns.verify(f.int("producer_id", hi=PRODUCER_ID_MAX),
                                   f.int("epoch", hi=EPOCH_MAX), part, now,
                                   f.bool("add", False))}

    def resolve(f, now):
        found = txns.resolve(f.int("producer_id", hi=PRODUCER_ID_MAX),
                             f.int("epoch", hi=EPOCH_MAX), f.list("part", max_len=2))
        return {"decision": found.decision, "txn": found.txn}

    return {"txn_init": init, "txn_add_parts": add_parts, "txn_add_positions": add_positions,
            "txn_end": end, "txn_verify": verify, "txn_resolve": resolve,
            "txn_describe": lambda f, now: txns.describe(
                f.str("transactional_id", hi=TRANSACTIONAL_ID_CHARS_MAX)),
            "txn_list": lambda f, now: {"transactions": txns.summaries()}}


def _positions(entries: list) -> dict[Part, Any]:
    out = {}
    for e in entries:
        if not (isinstance(e, list) and len(e) == 3):
            raise BadRequest(f"a transaction's position is [stream, streamlet, position], "
                             f"not {e!r:.100}")
        out[_part(e[:2])] = e[2]
    return out
