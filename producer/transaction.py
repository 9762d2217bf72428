"""The client side of a transactional producer: which call may come next. Sans-IO.

Kafka's TransactionManager in kera's shape (docs/TRANSACTIONS.md, "What a user writes"). The
Producer asks this object before each transactional call, sends the request fields it returns
to the coordinator, and reports the outcome back; nothing here touches a socket, a thread or
a clock.

States (TRANSITIONS, asserted on every move):

    Uninitialized --init--> Ready --begin--> InTransaction --commit--> Committing --> Ready
                                                           --abort---> Aborting  --> Ready
    InTransaction / Committing --a send or the end failed--> Abortable --abort--> Aborting
    any --ProducerFenced--> Fenced (a newer instance holds the id: close this producer)

The first transaction after one the coordinator held waits for that one to complete: its
markers may not be in the brokers yet, and a broker takes a chunk into the transaction it
holds open for the producer, so a chunk of the next transaction sent before the marker would
join the previous one. `begin` then asks `barrier_request` (txn_add_parts with no parts, which
the coordinator answers ConcurrentTransactions until every marker is durable, then opens the
next transaction); Kafka's clients wait the same way at their first AddPartitionsToTxn.

A failed send in a transaction makes it *abortable*: it can never commit, since a record of
it was not stored, so only `abort_transaction()` is accepted (then redo the work). Its
records' chunks carry `chunk_producer_id` (the coordinator's producer id and epoch,
kera.codec.txn.kera_producer_id) and sequences with TXN_SEQUENCE_BIT.
"""

from __future__ import annotations

from kera.codec.txn import kera_producer_id
from kera.net.backoff import Backoff
from kera.errors import (BadRequest, InvalidTransactionTimeout, InvalidTxnState, KeraError,
                         ProducerFenced, TransactionTimedOut)

UNINITIALIZED = "Uninitialized"
READY = "Ready"
IN_TRANSACTION = "InTransaction"
COMMITTING = "Committing"
ABORTING = "Aborting"
ABORTABLE = "Abortable"
FENCED = "Fenced"
TRANSITIONS = {
    UNINITIALIZED: (READY, FENCED),
    READY: (READY, IN_TRANSACTION, FENCED),
    IN_TRANSACTION: (COMMITTING, ABORTING, ABORTABLE, FENCED),
    # A commit whose answer did not come may be called again (the coordinator's end is
    # idempotent), or given up by an abort.
    COMMITTING: (READY, COMMITTING, ABORTING, ABORTABLE, FENCED),
    ABORTING: (READY, ABORTING, ABORTABLE, FENCED),
    # init_transactions is accepted here too: its epoch bump aborts the transaction.
    ABORTABLE: (ABORTING, READY, FENCED),
    FENCED: (),
}
# init_transactions may run here: first, again (a new epoch), to give up an abortable one, or
# inside an abort whose chunks may still land (the bump fences them).
INIT_STATES = (UNINITIALIZED, READY, ABORTABLE, ABORTING)

# The coordinator's bounds (kera.coordinator.transactions, which a client does not import: it
# is the coordinator's whole package), checked here too so a bad value fails at construction;
# a unit test keeps them equal. The default is Kafka's transaction.timeout.ms.
TIMEOUT_MS_MIN = 1_000
TIMEOUT_MS_MAX = 900_000
TIMEOUT_MS_DEFAULT = 60_000
TRANSACTIONAL_ID_CHARS_MAX = 255

# init_transactions and begin's barrier meet ConcurrentTransactions while the id's previous
# transaction is being completed (its markers written: one durable append per streamlet, a few
# milliseconds) or aborted by the fence; retried after a back-off doubling from the first up to
# the cap: soon after the markers are durable, without spinning. The first pause is short
# because every transaction after a commit meets it once: at 20 ms it was 22 of a 26 ms
# transaction's time (bench.txn_rate, one producer).
RETRY_BACKOFF_MS_FIRST = 2
RETRY_BACKOFF_MS_MAX = 500
RETRY_BACKOFF = Backoff(RETRY_BACKOFF_MS_FIRST, RETRY_BACKOFF_MS_MAX)


def retry_backoff_s(attempt: int) -> float:
    """The pause before retry number `attempt` (1, 2, ...) of a retriable coordinator call."""
    return RETRY_BACKOFF.delay_s(attempt)


def check_transactional_id(tid) -> str:
    if not isinstance(tid, str) or not 0 < len(tid) <= TRANSACTIONAL_ID_CHARS_MAX:
        raise BadRequest(f"transactional_id is a string of 1 to {TRANSACTIONAL_ID_CHARS_MAX} "
                         f"characters, not {tid!r:.100}")
    return tid


def check_timeout_ms(timeout_ms) -> int:
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) \
            or not TIMEOUT_MS_MIN <= timeout_ms <= TIMEOUT_MS_MAX:
        raise InvalidTransactionTimeout(f"transaction_timeout_ms={timeout_ms!r}: the cluster "
                                        f"allows {TIMEOUT_MS_MIN} to {TIMEOUT_MS_MAX} ms")
    return timeout_ms


def group_fields(group) -> dict:
    """txn_add_positions' group fields from a group name or a consumer's group metadata
    (kera.consumer.membership.GroupMetadata: with its member id and epoch, so the coordinator
    refuses positions of a member a rebalance fenced, KIP-447)."""
    if isinstance(group, str):
        return {"group": group}
    name = getattr(group, "group", None)
    if not isinstance(name, str):
        raise BadRequest(f"give the group's name or consumer.group_metadata(), not "
                         f"{type(group).__name__}")
    fields = {"group": name}
    if getattr(group, "member_id", ""):
        fields |= {"member_id": group.member_id, "member_epoch": int(group.member_epoch)}
    return fields


class TransactionState:
    """One transactional producer's state, producer id and epoch."""

    def __init__(self, transactional_id: str, timeout_ms: int):
        self.transactional_id = check_transactional_id(transactional_id)
        self.timeout_ms = check_timeout_ms(timeout_ms)
        self.producer_id = -1
        self.epoch = -1
        self.state = UNINITIALIZED
        self.error: KeraError | None = None    # why the transaction is Abortable, or Fenced
        # Whether the coordinator may hold this transaction open: a chunk of it was stored (the
        # broker added its streamlet) or positions were joined. Else commit and abort are local.
        self.opened = False
        # The last transaction reached the coordinator: the next waits for it (module doc).
        self.previous_opened = False

    @property
    def chunk_producer_id(self) -> int:
        """The producer id the chunks of this instance carry."""
        assert self.producer_id >= 0, "init_transactions first"
        return kera_producer_id(self.producer_id, self.epoch)

    def ids(self) -> dict:
        return {"transactional_id": self.transactional_id, "producer_id": self.producer_id,
                "epoch": self.epoch}

    # ------------------------------------------------------------------ init
    def init_request(self) -> dict:
        """txn_init's fields (the current producer id and epoch, if any: the coordinator bumps
        them, or accepts the epoch a timeout fenced)."""
        self._refuse_if_fenced()
        if self.state not in INIT_STATES:
            raise InvalidTxnState(f"init_transactions during a transaction ({self.state}): "
                                  f"commit_transaction() or abort_transaction() first")
        return self.ids() | {"timeout_ms": self.timeout_ms}

    def on_init(self, reply: dict) -> None:
        producer_id, epoch = reply.get("producer_id"), reply.get("epoch")
        if not (isinstance(producer_id, int) and isinstance(epoch, int)
                and producer_id > 0 and 0 <= epoch):
            raise KeraError(f"malformed txn_init reply {reply!r:.200}")
        self.producer_id, self.epoch = producer_id, epoch
        self.error = None
        self.opened = self.previous_opened = False
        self._move(READY)

    # ------------------------------------------------------------------ a transaction
    def begin(self) -> None:
        self._refuse_if_fenced()
        if self.state == UNINITIALIZED:
            raise InvalidTxnState("begin_transaction before init_transactions(): call "
                                  "init_transactions() once, first")
        if self.state != READY:
            raise InvalidTxnState(f"begin_transaction while a transaction is {self.state}: "
                                  f"commit_transaction() or abort_transaction() first")
        self.opened = False
        self._move(IN_TRANSACTION)

    def barrier_request(self) -> dict | None:
        """After begin: txn_add_parts' fields that wait for the previous transaction to
        complete and open this one, or None when there is none to wait for."""
        return self.ids() | {"parts": []} if self.previous_opened else None

    def on_barrier(self) -> None:
        self.previous_opened = False
        self.opened = True

    def check_send(self) -> None:
        """Raise unless records may be sent now."""
        if self.state == IN_TRANSACTION:
            return
        self._refuse_if_fenced()
        if self.state == ABORTABLE:
            raise InvalidTxnState(f"the transaction cannot commit ({self.error}): call "
                                  f"abort_transaction(), then redo its work")
        raise InvalidTxnState(f"send outside a transaction ({self.state}): a producer with a "
                              f"transactional_id sends only between begin_transaction() and "
                              f"commit_transaction()")

    def positions_request(self, positions: list, group) -> dict:
        """txn_add_positions' fields; `positions` in group_commit's wire form."""
        self.check_send()
        return self.ids() | group_fields(group) | {"positions": positions}

    def start_end(self, commit: bool) -> None:
        """Before committing (flush, then txn_end) or aborting."""
        self._refuse_if_fenced()
        if commit and self.state == ABORTABLE:
            raise InvalidTxnState(f"the transaction cannot commit ({self.error}): call "
                                  f"abort_transaction(), then redo its work")
        allowed = (IN_TRANSACTION, COMMITTING) if commit \
            else (IN_TRANSACTION, COMMITTING, ABORTING, ABORTABLE)
        if self.state not in allowed:
            raise InvalidTxnState(f"{'commit' if commit else 'abort'}_transaction without a "
                                  f"transaction ({self.state}): call begin_transaction() first")
        self._move(COMMITTING if commit else ABORTING)

    def end_request(self, commit: bool) -> dict | None:
        """txn_end's fields, or None when the coordinator holds nothing of this transaction."""
        return self.ids() | {"commit": commit} if self.opened else None

    def ended(self) -> None:
        self.previous_opened = self.previous_opened or self.opened
        self.opened = False
        self.error = None
        self._move(READY)

    # ------------------------------------------------------------------ failures
    def fail(self, err: KeraError) -> KeraError:
        """A send or a coordinator call of this transaction failed: fenced for good, or the
        transaction is abortable. Returns `err` for the caller to raise."""
        if isinstance(err, ProducerFenced) and not isinstance(err, TransactionTimedOut):
            self.error = err
            self._move(FENCED)
        elif self.state in (IN_TRANSACTION, COMMITTING, ABORTING, ABORTABLE):
            if self.error is None or self.state != ABORTABLE:
                self.error = err
            self._move(ABORTABLE)
        return err

    def _refuse_if_fenced(self) -> None:
        if self.state == FENCED:
            raise ProducerFenced(f"transactional id {self.transactional_id!r} was taken over by "
                                 f"a newer producer ({self.error}): close this one")

    def _move(self, state: str) -> None:
        assert state in TRANSITIONS[self.state], f"{self.state} -> {state}"
        self.state = state
