"""kera's error codes as Kafka's: one table, used by every Kafka API of the listener.

Kafka clients decide from the code alone whether to retry, refresh metadata or give up, so
each kera error maps to the Kafka code whose client behaviour matches what kera means:
`not_owner` makes the client look the leader up again, `replication_failed` retries a batch
the idempotent producer's sequence keeps from being stored twice, `not_authorized` stops.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from kera.errors import KeraError

BY_KERA_CODE = {
    "bad_request": ErrorCode.invalid_request,
    "corrupt_chunk": ErrorCode.corrupt_message,
    "record_too_large": ErrorCode.message_too_large,
    "unknown_stream": ErrorCode.unknown_topic_or_partition,
    "stream_exists": ErrorCode.topic_already_exists,
    "not_owner": ErrorCode.not_leader_or_follower,
    "sequence_gap": ErrorCode.out_of_order_sequence_number,
    "not_ready": ErrorCode.leader_not_available,
    "throttled": ErrorCode.kafka_storage_error,
    "offset_out_of_range": ErrorCode.offset_out_of_range,
    "position_lost": ErrorCode.offset_out_of_range,
    "timeout": ErrorCode.request_timed_out,
    "replication_failed": ErrorCode.not_enough_replicas_after_append,
    "storage_error": ErrorCode.kafka_storage_error,
    "unreachable": ErrorCode.coordinator_not_available,
    "not_leader": ErrorCode.coordinator_not_available,
    "not_authorized": ErrorCode.topic_authorization_failed,
    "unknown_member": ErrorCode.unknown_member_id,
    "group_not_empty": ErrorCode.non_empty_group,
    "lock_conflict": ErrorCode.invalid_record,
    "keyless_record": ErrorCode.invalid_record,   # Kafka's "compacted topic ... without key"
    # Transactions (docs/TRANSACTIONS.md, Errors). A request from before KIP-588's versions
    # gets INVALID_PRODUCER_EPOCH for producer_fenced: the Kafka API handler picks that.
    "producer_fenced": ErrorCode.producer_fenced,
    "transaction_timed_out": ErrorCode.invalid_producer_epoch,
    "concurrent_transactions": ErrorCode.concurrent_transactions,
    "invalid_txn_state": ErrorCode.invalid_txn_state,
    "invalid_producer_id_mapping": ErrorCode.invalid_producer_id_mapping,
    "invalid_transaction_timeout": ErrorCode.invalid_transaction_timeout,
}


def kafka_code(error: KeraError | str) -> ErrorCode:
    """The Kafka error code for a kera error (or its code); UNKNOWN_SERVER_ERROR otherwise."""
    code = error if isinstance(error, str) else error.code
    return BY_KERA_CODE.get(code, ErrorCode.unknown_server_error)
