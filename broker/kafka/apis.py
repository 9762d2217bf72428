"""The Kafka APIs the listener answers: their advertised versions and their handlers.

Versions are those of a Kafka 3.x release (so clients that infer the broker's version from
ApiVersions turn nothing off) within what kio decodes; Produce is advertised from v0 as
Kafka 4 does, because librdkafka turns compression off against a broker whose Produce starts
later, while versions below 3 (the old message formats) are refused by closing the
connection, as Kafka 4 does. An API not listed here is not advertised and its requests close
the connection, as Kafka does for an API it does not know.
"""

from __future__ import annotations

from typing import Callable

from kio.schema.errors import ErrorCode

from kera.broker.kafka import (fetch, groups, metadata, offsets, produce, producer_ids, records,
                               topics, transactions)
from kera.broker.kafka import sasl
from kera.broker.kafka.context import Call, Context

API_VERSIONS = 18
# api key -> (advertised min, advertised max, lowest decoded, handler)
APIS: dict[int, tuple[int, int, int, Callable[[Context, Call], None]]] = {
    0: (0, 9, 3, produce.handle_produce),
    1: (4, 12, 4, fetch.handle_fetch),
    2: (1, 7, 1, offsets.handle_list_offsets),
    3: (0, 12, 0, metadata.handle_metadata),
    8: (2, 8, 2, groups.handle_offset_commit),
    9: (1, 8, 1, groups.handle_offset_fetch),
    10: (0, 4, 0, groups.handle_find_coordinator),
    11: (0, 7, 0, groups.handle_join_group),
    12: (0, 4, 0, groups.handle_heartbeat),
    13: (0, 4, 0, groups.handle_leave_group),
    14: (0, 5, 0, groups.handle_sync_group),
    15: (0, 5, 0, groups.handle_describe_groups),
    16: (0, 4, 0, groups.handle_list_groups),
    17: (1, 1, 1, sasl.handle_sasl_handshake),   # v0 (unframed SASL tokens) is pre-Kafka 1.0
    19: (2, 7, 2, topics.handle_create_topics),
    20: (1, 6, 1, topics.handle_delete_topics),
    21: (0, 2, 0, records.handle_delete_records),
    22: (0, 4, 0, producer_ids.handle_init_producer_id),
    # Transactions: "transaction version 1" (no transaction.version feature is advertised, so
    # clients never use KIP-890's v4+ forms), KIP-447's TxnOffsetCommit v3.
    24: (0, 3, 0, transactions.handle_add_partitions),
    25: (0, 3, 0, transactions.handle_add_offsets),
    26: (0, 3, 0, transactions.handle_end_txn),
    28: (0, 3, 0, transactions.handle_txn_offset_commit),
    32: (1, 4, 1, topics.handle_describe_configs),
    36: (0, 2, 0, sasl.handle_sasl_authenticate),
    37: (0, 3, 0, topics.handle_create_partitions),
    42: (0, 2, 0, groups.handle_delete_groups),
    47: (0, 0, 0, groups.handle_offset_delete),
    60: (0, 1, 0, metadata.handle_describe_cluster),
    65: (0, 0, 0, transactions.handle_describe_transactions),
    66: (0, 1, 0, transactions.handle_list_transactions),
}
API_VERSIONS_RANGE = (0, 3)


def supported(key: int, version: int) -> bool:
    """Whether a request of (key, version) is decoded and answered."""
    if key == API_VERSIONS:
        return API_VERSIONS_RANGE[0] <= version <= API_VERSIONS_RANGE[1]
    entry = APIS.get(key)
    return entry is not None and entry[2] <= version <= entry[1]


def advertised() -> list[dict]:
    rows = [{"api_key": API_VERSIONS, "min_version": API_VERSIONS_RANGE[0],
             "max_version": API_VERSIONS_RANGE[1]}]
    rows += [{"api_key": k, "min_version": lo, "max_version": hi}
             for k, (lo, hi, _decoded, _fn) in sorted(APIS.items())]
    return rows


def api_versions(error: ErrorCode = ErrorCode.none) -> dict:
    return {"error_code": error, "api_keys": advertised(), "throttle_time": 0}


def dispatch(ctx: Context, call: Call) -> None:
    if call.req.api_key == API_VERSIONS:
        call.answer(api_versions())
        return
    APIS[call.req.api_key][3](ctx, call)
