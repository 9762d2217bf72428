"""InitProducerId: an id and epoch for a Kafka idempotent or transactional producer.

An idempotent producer's id is random in [1, 2**PRODUCER_ID_BITS), as kera's own producers'
are (kera.producer): no coordinator round trip; two of a million producers share an id with a
chance of about 2**39 / 2**55, one in 65,000. A producer that asks again with its id and
epoch (KIP-360, after an unknown-producer error) keeps its id with the next epoch.

A transactional producer (a `transactional.id`) gets its id and epoch from kera's coordinator
(`txn_init`, kera.coordinator.transactions): a new instance bumps the epoch, fencing the old
one and aborting what it left open (CONCURRENT_TRANSACTIONS until that abort is written: the
client retries). v3+ send the id and epoch they had (KIP-360/588), which the coordinator
checks. Epochs stay below 256 (the coordinator issues a new producer id before that), so the
kera producer id (kera.codec.txn.kera_producer_id) keeps the whole epoch.
"""

from __future__ import annotations

import secrets

from kera.broker.kafka.context import Call, Context
from kera.broker.kafka.transactions import txn_code

# A Kafka producer id, shifted left by kera.codec.txn.EPOCH_BITS, must fit a kera u64 producer
# id (and stay a positive i64 for the client).
PRODUCER_ID_BITS = 55
EPOCH_MAX = 32767


def new_producer_id() -> int:
    return 1 + secrets.randbelow((1 << PRODUCER_ID_BITS) - 1)


def handle_init_producer_id(ctx: Context, call: Call) -> None:
    body = call.body
    pid, epoch = getattr(body, "producer_id", -1), getattr(body, "producer_epoch", -1)
    if body.transactional_id is not None:
        _init_transactional(ctx, call, pid, epoch)
        return
    if 0 < pid < (1 << PRODUCER_ID_BITS) and 0 <= epoch < EPOCH_MAX:
        call.answer({"producer_id": pid, "producer_epoch": epoch + 1})
        return
    call.answer({"producer_id": new_producer_id(), "producer_epoch": 0})


def _init_transactional(ctx: Context, call: Call, pid: int, epoch: int) -> None:
    body = call.body
    fields = {"transactional_id": body.transactional_id,
              "timeout_ms": int(body.transaction_timeout.total_seconds() * 1000)}
    if pid >= 0 and epoch >= 0:
        fields.update(producer_id=pid, epoch=epoch)

    def done(header, error) -> None:
        if error is not None:
            call.answer({"error_code": txn_code(error, call.req.api_key, call.version),
                         "producer_id": -1, "producer_epoch": -1})
            return
        call.answer({"producer_id": header["producer_id"], "producer_epoch": header["epoch"]})

    ctx.catalog.calls.call("txn_init", fields, done)
