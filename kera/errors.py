"""Every error kera reports, local or remote, with a wire code and whether a retry may help.

Errors are classified once, at the boundary: a daemon turns any KeraError into an error reply
(`code`, `message`, `retriable`) and a client turns that reply back into the same class. A class
carries its behaviour, so callers test attributes or classes, never `.code` strings:
`retriable` (the same request may succeed later) and `refresh_metadata` (the client's view of
where a stream lives may be stale: fetch metadata before retrying).
"""

from __future__ import annotations

import re


class KeraError(Exception):
    code = "internal"
    retriable = False
    refresh_metadata = False

    def __init__(self, message: str = "", *, retriable: bool | None = None):
        super().__init__(message or self.__class__.__doc__ or self.code)
        if retriable is not None:
            self.retriable = retriable

    @property
    def message(self) -> str:
        return str(self)


class BadRequest(KeraError):
    """The request is malformed: a missing or mistyped field, a bad frame count."""
    code = "bad_request"


class CorruptChunk(BadRequest):
    """A chunk failed its checksum or its layout check."""
    code = "corrupt_chunk"


class KeylessRecord(BadRequest):
    """A record without a key was sent to a compacted stream (cleanup policy `compact`), which
    keeps the last record of each key and so cannot hold one without: give every record a key,
    or write to a stream with cleanup policy `delete`."""
    code = "keyless_record"


class RecordTooLarge(KeraError):
    """A record or chunk exceeds the configured limit."""
    code = "record_too_large"


class UnknownStream(KeraError):
    """No stream by that name or id."""
    code = "unknown_stream"
    refresh_metadata = True   # after a delete and re-create, or a move, the id changed


class StreamExists(KeraError):
    """A stream by that name already exists."""
    code = "stream_exists"


class NotOwner(KeraError):
    """This broker does not own that streamlet (any longer); refresh metadata and retry."""
    code = "not_owner"
    retriable = True
    refresh_metadata = True


class SequenceGap(KeraError):
    """A chunk's sequence skips ahead of what the broker holds; resend the missing ones."""
    code = "sequence_gap"
    retriable = True


class NotReady(KeraError):
    """The daemon cannot serve this yet (no backups, stream being created, recovering)."""
    code = "not_ready"
    retriable = True
    refresh_metadata = True   # a stream being created or recovered may move


class Throttled(KeraError):
    """The daemon is out of buffer space; slow down and retry."""
    code = "throttled"
    retriable = True


class OffsetOutOfRange(KeraError):
    """The requested position is no longer (or not yet) available."""
    code = "offset_out_of_range"


class Timeout(KeraError):
    """No answer within the timeout."""
    code = "timeout"
    retriable = True
    refresh_metadata = True   # the daemon may be dead and its streamlets failed over


class ClientClosed(KeraError):
    """The client was closed."""
    code = "closed"


class ReplicationFailed(KeraError):
    """The data could not be stored on enough copies."""
    code = "replication_failed"
    retriable = True


class StorageError(KeraError):
    """A disk operation failed (full disk, I/O error)."""
    code = "storage_error"
    retriable = True


class PeerUnreachable(Timeout):
    """Another daemon cannot be reached: zmq refused its address, or too many connections are
    open. A Timeout that came early: every caller handles it as a peer that does not answer."""
    code = "unreachable"


_BY_CODE = {cls.code: cls for cls in (
    KeraError, BadRequest, CorruptChunk, RecordTooLarge, UnknownStream, StreamExists, NotOwner,
    SequenceGap, NotReady, Throttled, OffsetOutOfRange, Timeout, ClientClosed,
    ReplicationFailed, StorageError, PeerUnreachable, KeylessRecord)}


def from_reply(code: str, message: str, retriable: bool) -> KeraError:
    cls = _BY_CODE.get(code, KeraError)
    err = cls(message, retriable=retriable)
    if cls is KeraError:
        err.code = code
    return err


class IdInUse(KeraError):
    """The daemon id asked for is held by a live process (one that heartbeats with its own
    incarnation token): pick another --id, or stop the other process first."""
    code = "id_in_use"


class WrongCluster(KeraError):
    """The daemon holds data of another cluster than the coordinator's (or the coordinator's
    metadata directory is empty or wrong)."""
    code = "wrong_cluster"


_BY_CODE.update({cls.code: cls for cls in (IdInUse, WrongCluster)})


class PositionLost(KeraError):
    """A position names a history of a streamlet that no longer exists: the streamlet lost its
    data (an R=1 broker restarted without it) and started a new, empty history. Resuming would
    silently skip the records produced since; pick a start again (the consumer's
    `on_lost_position`, the Spark source's `failOnDataLoss`)."""
    code = "position_lost"


_BY_CODE[PositionLost.code] = PositionLost


class UnknownMember(KeraError):
    """The consumer-group member is not (or no longer) in its group: it missed its session
    timeout or left, and its streamlets were given to others. Rejoin (a Consumer does this by
    itself) and resume from the group's committed positions."""
    code = "unknown_member"


class StaleMemberEpoch(KeraError):
    """A consumer-group member acted on an assignment the group has moved past (a commit of a
    streamlet it no longer holds, or from an older member epoch). Heartbeat for the current
    assignment, then commit again; positions of revoked streamlets belong to their new owner."""
    code = "stale_member_epoch"
    retriable = True


class GroupNotEmpty(KeraError):
    """The consumer group still has live members: stop (or close) them first, then delete the
    group or reset its positions."""
    code = "group_not_empty"


class NotAuthorized(KeraError):
    """The caller's principal may not do this: the message names the principal, the operation
    and the resource, and the grant that would allow it (`kera acl add`)."""
    code = "not_authorized"


for _cls in (UnknownMember, StaleMemberEpoch, GroupNotEmpty, NotAuthorized):
    _BY_CODE[_cls.code] = _cls


class SparkSetupError(KeraError):
    """Spark is set up so the kera connector cannot work (e.g. its Python workers cannot
    import kera). Raised on the driver, never sent on the wire."""
    code = "spark_setup"


class Undelivered(Timeout):
    """flush() timed out with records unacknowledged. `streams`, `streamlets` ((stream,
    streamlet) pairs) and `records` say which; every other record sent before the flush was
    stored (its future resolved). Usually a streamlet's broker is down: check `kera stream
    describe`, then flush again (the records are still being retried) or close."""
    code = "undelivered"

    def __init__(self, message: str = "", *, streamlets=(), records: int = 0,
                 retriable: bool | None = None):
        super().__init__(message, retriable=retriable)
        self.streamlets = sorted(streamlets)
        self.streams = sorted({stream for stream, _ in self.streamlets})
        self.records = records


class Fenced(KeraError):
    """This coordinator no longer owns the cluster's metadata: another coordinator took it over
    (its fencing key in etcd moved past the revision this one read), so nothing this one decides
    may be applied. It stops serving; retry against the coordinator that took over."""
    code = "fenced"
    retriable = True
    refresh_metadata = True


_BY_CODE[Fenced.code] = Fenced


class NotLeader(KeraError):
    """This coordinator stands by: another one leads the cluster (it holds the leadership key
    in etcd). Ask the next coordinator of the bootstrap list; clients and daemons do that
    themselves (kera.net.coordinators)."""
    code = "not_leader"
    retriable = True


_BY_CODE[NotLeader.code] = NotLeader


class PublishUncertain(KeraError):
    """An outbox row's record failed without proof that it was not stored (a timeout, or
    retries exhausted while a broker was down). The harvester ends its term instead of
    resetting the row, and the next term looks the row up in the stream before publishing it
    again (kera.services.outbox.harvester). Nothing to do unless it repeats: then check `kera stream describe`."""
    code = "publish_uncertain"
    retriable = True


class LeadershipLost(KeraError):
    """An outbox harvester's leadership lapsed while it was taking over (the lookup in the
    stream outlasted its lease): it settles nothing, and harvests again once re-elected."""
    code = "leadership_lost"
    retriable = True


class TargetFailed(KeraError):
    """A delivery target (kera.services.deliver.deliverer) refused or failed a call: the deliverer retries it with
    backoff from the target's own last-applied positions; fix the target (its log says why)."""
    code = "target_failed"
    retriable = True


class LockConflict(KeraError):
    """A conditional append (kera.services.conditional) was refused, nothing stored: one of its locks
    was written by a record numbered after the writer's high-water mark. Read the stream up to
    `number`, re-execute the transaction against what you read, and append again with the new
    high-water mark."""
    code = "lock_conflict"

    def __init__(self, message: str = "", *, retriable: bool | None = None):
        super().__init__(message, retriable=retriable)
        # The broker's message names them (lock_conflict_message); parsed back so that the
        # wire keeps one error shape, [code, message, retriable].
        found = _LOCK_CONFLICT.search(self.message)
        self.lock: int | None = int(found[1]) if found else None
        self.number: int | None = int(found[2]) if found else None
        self.high_water_mark: int | None = int(found[3]) if found else None


_LOCK_CONFLICT = re.compile(r"lock (\d+) was written at record number (\d+), after the "
                            r"high-water mark (-?\d+)")


def lock_conflict_message(lock: int, number: int, high_water_mark: int) -> str:
    return (f"lock {lock} was written at record number {number}, after the high-water mark "
            f"{high_water_mark}: read up to {number}, re-execute and append again")


_BY_CODE[LockConflict.code] = LockConflict


class DeliveryGap(KeraError):
    """A delivery target's next record is not numbered right after its last applied one: the
    records between were deleted (retention) before it applied them, or the stream's numbering
    restarted. Retrying cannot help, so the target is given up; the message names the numbers.
    To skip them deliberately, set the target's last applied number to the one before the
    record offered."""
    code = "delivery_gap"


# --------------------------------------------------------------------------- transactions
# kera.coordinator.transactions raises them; kera.broker.kafka.errors maps them to Kafka codes.

class ProducerFenced(KeraError):
    """A newer instance of this transactional producer started (init_transactions with the same
    transactional id bumped the epoch): this one may do nothing more. Close it; the newer one
    carries on (what this one left open was aborted). Kafka: PRODUCER_FENCED."""
    code = "producer_fenced"


class TransactionTimedOut(ProducerFenced):
    """The transaction was open longer than its timeout, so the cluster aborted it and bumped
    the producer's epoch. Abort it (abort_transaction succeeds), then init_transactions again
    and redo its work; or raise transaction_timeout_ms. Kafka: INVALID_PRODUCER_EPOCH."""
    code = "transaction_timed_out"


class ConcurrentTransactions(KeraError):
    """The id's previous transaction is still completing (its markers are being written):
    retry shortly. Kafka: CONCURRENT_TRANSACTIONS."""
    code = "concurrent_transactions"
    retriable = True


class InvalidTxnState(KeraError):
    """The op does not fit the transaction's state (commit without a transaction, a commit of
    one being aborted, a chunk for a streamlet not added). Kafka: INVALID_TXN_STATE."""
    code = "invalid_txn_state"


class UnknownTransactionalId(KeraError):
    """No producer holds this transactional id (it expired, or init_transactions was never
    called): call init_transactions. Kafka: INVALID_PRODUCER_ID_MAPPING."""
    code = "invalid_producer_id_mapping"


class InvalidTransactionTimeout(BadRequest):
    """The transaction timeout asked for is outside what the coordinator allows.
    Kafka: INVALID_TRANSACTION_TIMEOUT."""
    code = "invalid_transaction_timeout"


for _cls in (ProducerFenced, TransactionTimedOut, ConcurrentTransactions, InvalidTxnState,
             UnknownTransactionalId, InvalidTransactionTimeout):
    _BY_CODE[_cls.code] = _cls
