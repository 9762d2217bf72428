"""InitProducerId: an id and epoch for a Kafka idempotent producer.

Ids are random in [1, 2**PRODUCER_ID_BITS), as kera's own producers' are (kera.producer): no
coordinator round trip; two of a million producers share an id with a chance of about
2**39 / 2**55, one in 65,000. A producer that asks again with its id and
epoch (KIP-360, after an unknown-producer error) keeps its id with the next epoch.
Transactional ids are refused: kera's Kafka listener does not run transactions yet.
"""

from __future__ import annotations

import secrets

from kio.schema.errors import ErrorCode

from kera.broker.kafka.context import Call, Context

# A Kafka producer id, shifted left by kera.broker.kafka.produce.EPOCH_BITS, must fit a kera
# u64 producer id (and stay a positive i64 for the client).
PRODUCER_ID_BITS = 55
EPOCH_MAX = 32767


def new_producer_id() -> int:
    return 1 + secrets.randbelow((1 << PRODUCER_ID_BITS) - 1)


def handle_init_producer_id(ctx: Context, call: Call) -> None:
    body = call.body
    if body.transactional_id is not None:
        call.answer({"error_code": ErrorCode.transactional_id_authorization_failed,
                     "producer_id": -1, "producer_epoch": -1})
        return
    pid, epoch = getattr(body, "producer_id", -1), getattr(body, "producer_epoch", -1)
    if 0 < pid < (1 << PRODUCER_ID_BITS) and 0 <= epoch < EPOCH_MAX:
        call.answer({"producer_id": pid, "producer_epoch": epoch + 1})
        return
    call.answer({"producer_id": new_producer_id(), "producer_epoch": 0})
