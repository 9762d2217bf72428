"""A transactional producer's client side, without sockets: the state machine of
kera.producer.transaction (which call may come next, and what a failure makes of the
transaction) and the Pipeline's transactional lanes (TXN_SEQUENCE_BIT, no identity change on a
gap, what an abort drops and keeps)."""

import pytest

from kera.codec import chunk
from kera.codec.txn import TXN_SEQUENCE_BIT, kera_producer_id
from kera.consumer.membership import GroupMetadata
from kera.errors import (BadRequest, InvalidTransactionTimeout, InvalidTxnState, KeraError,
                         ProducerFenced, StaleMemberEpoch, TransactionTimedOut)
from kera.producer import transaction as txns
from kera.producer.pipeline import FRONT_GAP_ATTEMPTS_MAX, Pipeline
from kera.producer.transaction import TransactionState

PID, EPOCH = 77, 3
SID = 5
GAP = ["sequence_gap", "gap", True]


def ready(pid=PID, epoch=EPOCH) -> TransactionState:
    t = TransactionState("billing-3", 60_000)
    t.on_init({"producer_id": pid, "epoch": epoch})
    return t


def in_transaction() -> TransactionState:
    t = ready()
    t.begin()
    return t


# ---------------------------------------------------------------------- the state machine
def test_init_asks_for_the_id_as_a_new_instance_then_for_a_bump_of_its_own_epoch():
    t = TransactionState("billing-3", 60_000)
    assert t.init_request() == {"transactional_id": "billing-3", "producer_id": -1,
                                "epoch": -1, "timeout_ms": 60_000}
    t.on_init({"producer_id": PID, "epoch": EPOCH})
    assert t.state == txns.READY
    assert t.chunk_producer_id == kera_producer_id(PID, EPOCH) == (PID << 8) | EPOCH
    assert t.init_request()["producer_id"] == PID and t.init_request()["epoch"] == EPOCH


def test_kafkas_state_errors_are_clear_invalid_txn_state_errors():
    t = TransactionState("billing-3", 60_000)
    with pytest.raises(InvalidTxnState, match="init_transactions"):
        t.begin()
    t.on_init({"producer_id": PID, "epoch": EPOCH})
    with pytest.raises(InvalidTxnState, match="begin_transaction"):
        t.check_send()                                   # send outside a transaction
    with pytest.raises(InvalidTxnState, match="begin_transaction"):
        t.start_end(commit=True)                         # commit without begin
    with pytest.raises(InvalidTxnState, match="begin_transaction"):
        t.start_end(commit=False)
    t.begin()
    with pytest.raises(InvalidTxnState, match="commit_transaction.*abort_transaction"):
        t.begin()                                        # begin twice
    with pytest.raises(InvalidTxnState, match="during a transaction"):
        t.init_request()
    t.check_send()


def test_a_transaction_that_sent_nothing_ends_without_asking_the_coordinator():
    t = in_transaction()
    t.start_end(commit=True)
    assert t.end_request(True) is None
    t.ended()
    t.begin()
    t.opened = True                                      # a chunk of it was stored
    t.start_end(commit=True)
    assert t.end_request(True) == {"transactional_id": "billing-3", "producer_id": PID,
                                   "epoch": EPOCH, "commit": True}
    t.ended()
    assert t.state == txns.READY and not t.opened


def test_a_transaction_after_one_the_coordinator_held_first_waits_for_it():
    t = in_transaction()
    assert t.barrier_request() is None                   # nothing before it
    t.opened = True
    t.start_end(commit=True)
    t.ended()
    t.begin()
    assert t.barrier_request() == {"transactional_id": "billing-3", "producer_id": PID,
                                   "epoch": EPOCH, "parts": []}
    t.fail(KeraError("coordinator unreachable"))         # the wait failed: abort, and the
    t.start_end(commit=False)                            # next begin waits again
    assert t.end_request(False) is None
    t.ended()
    t.begin()
    assert t.barrier_request() is not None
    t.on_barrier()
    assert t.opened and t.barrier_request() is None
    t.start_end(commit=True)
    t.ended()
    t.on_init({"producer_id": PID, "epoch": EPOCH + 1})  # a new epoch waited in txn_init
    t.begin()
    assert t.barrier_request() is None


def test_a_failed_send_makes_the_transaction_abortable_only():
    t = in_transaction()
    t.fail(KeraError("record_too_large"))
    assert t.state == txns.ABORTABLE
    with pytest.raises(InvalidTxnState, match="abort_transaction"):
        t.check_send()
    with pytest.raises(InvalidTxnState, match="cannot commit.*record_too_large"):
        t.start_end(commit=True)
    t.start_end(commit=False)
    t.ended()
    t.begin()                                            # the next transaction is clean
    t.check_send()


def test_a_timed_out_transaction_is_abortable_and_a_fenced_producer_is_done():
    t = in_transaction()
    t.fail(TransactionTimedOut("open too long"))
    assert t.state == txns.ABORTABLE and isinstance(t.error, TransactionTimedOut)
    t.init_request()                                     # init again (KIP-588) is allowed
    t = in_transaction()
    t.fail(ProducerFenced("a newer instance"))
    assert t.state == txns.FENCED
    for call in (t.begin, t.check_send, t.init_request, lambda: t.start_end(False)):
        with pytest.raises(ProducerFenced, match="close this one"):
            call()


def test_a_commit_whose_answer_did_not_come_may_be_called_again_or_aborted():
    t = in_transaction()
    t.start_end(commit=True)
    t.start_end(commit=True)                             # retried after a Timeout
    t.start_end(commit=False)
    assert t.state == txns.ABORTING


def test_positions_carry_the_group_and_its_member_when_the_consumer_has_one():
    t = in_transaction()
    wire = [["orders", 0, [[2, 17, None]]]]
    assert t.positions_request(wire, "billing") == {
        "transactional_id": "billing-3", "producer_id": PID, "epoch": EPOCH,
        "group": "billing", "positions": wire}
    fields = t.positions_request(wire, GroupMetadata("billing", "m-1", 4))
    assert (fields["member_id"], fields["member_epoch"]) == ("m-1", 4)
    assert "member_id" not in t.positions_request(wire, GroupMetadata("billing", "", 0))
    with pytest.raises(BadRequest, match="group_metadata"):
        t.positions_request(wire, 42)
    t.fail(StaleMemberEpoch("rebalanced"))               # a fenced member's positions
    assert t.state == txns.ABORTABLE


def test_ids_and_timeouts_are_checked_before_anything_is_asked():
    with pytest.raises(BadRequest, match="transactional_id"):
        TransactionState("", 60_000)
    with pytest.raises(BadRequest, match="transactional_id"):
        TransactionState("x" * 256, 60_000)
    with pytest.raises(InvalidTransactionTimeout, match="1000 to 900000"):
        TransactionState("a", 999)
    with pytest.raises(InvalidTransactionTimeout):
        TransactionState("a", 900_001)


def test_the_clients_bounds_are_the_coordinators():
    from kera.coordinator import transactions as coordinator
    assert (txns.TIMEOUT_MS_MIN, txns.TIMEOUT_MS_MAX, txns.TIMEOUT_MS_DEFAULT,
            txns.TRANSACTIONAL_ID_CHARS_MAX) == (
        coordinator.TIMEOUT_MS_MIN, coordinator.TIMEOUT_MS_MAX, coordinator.TIMEOUT_MS_DEFAULT,
        coordinator.TRANSACTIONAL_ID_CHARS_MAX)


def test_retry_backoff_doubles_to_its_cap():
    pauses = [txns.retry_backoff_s(n) for n in range(1, 40)]
    assert pauses[0] == txns.RETRY_BACKOFF_MS_FIRST / 1000
    assert pauses[1] == 2 * pauses[0] and pauses == sorted(pauses)
    assert max(pauses) == txns.RETRY_BACKOFF_MS_MAX / 1000


# ---------------------------------------------------------------------- transactional lanes
def pipeline(retries=20):
    return Pipeline(request_size_bytes=1, in_flight_per_broker=1, retries_max=retries,
                    request_timeout_s=1.0, sequence_bit=TXN_SEQUENCE_BIT)


def add(pipe, n, pid=None):
    lane = pipe.own_lane("s", SID, 0, pid or kera_producer_id(PID, EPOCH), 1)
    out = []
    for _ in range(n):
        data = chunk.encode(lane.producer_id, lane.wire_sequence, SID, 0, [b"x"] * 10)
        out.append(pipe.add(lane, data, lane.next_sequence, 10))
    return lane, out


def send(pipe, now, req_id):
    (o,) = pipe.build(now, lambda sid, sl: "b1")
    pipe.sent(o, req_id, now)
    return o


def acked(o):
    return {"id": o.req_id, "ok": True, "results": [[0, 0, 0]] * len(o.chunks)}


def test_transactional_chunks_carry_the_sequence_bit_and_the_epochs_producer_id():
    pipe = pipeline()
    lane, chunks = add(pipe, 2)
    headers = [chunk.verify(c.data) for c in chunks]
    assert [(h.producer_id, h.sequence) for h in headers] == [
        ((PID << 8) | EPOCH, TXN_SEQUENCE_BIT | 0), ((PID << 8) | EPOCH, TXN_SEQUENCE_BIT | 1)]
    assert [c.sequence for c in chunks] == [0, 1]        # the pipeline counts plain sequences


def test_an_unhealable_gap_keeps_the_identity_and_makes_the_transaction_abortable():
    pipe = pipeline()
    lane, (c0, c1, c2) = add(pipe, 3)
    pipe.on_reply("b1", acked(send(pipe, 0.0, 1)), 0.0)
    now = 0.0
    for attempt in range(FRONT_GAP_ATTEMPTS_MAX):   # the broker lost this producer's state
        now += 10
        o = send(pipe, now, 10 + attempt)
        pipe.on_reply("b1", {"id": o.req_id, "ok": True, "results": [GAP]}, now)
    assert lane.producer_id == kera_producer_id(PID, EPOCH)   # not re-identified
    assert pipe.txn_error is not None and "abort" in pipe.txn_error.message
    assert pipe.txn_new_epoch                            # the abort must bump the epoch
    assert [f.records for f in pipe.take_failures()] == [10, 10]   # chunk 1 and the one after
    assert not lane.chunks and pipe.build(now + 10, lambda sid, sl: "b1") == []


def test_an_unanswered_request_means_the_abort_must_take_a_new_epoch():
    pipe = pipeline()
    add(pipe, 1)
    o = send(pipe, 0.0, 1)
    assert not pipe.txn_new_epoch
    pipe.expire(5.0)                                     # no reply: the chunk may still land
    assert pipe.txn_new_epoch and o.chunks[0].state == 0


def test_an_abort_drops_unsent_chunks_and_continues_after_the_last_stored_one():
    pipe = pipeline()
    lane, chunks = add(pipe, 3)
    pipe.on_reply("b1", acked(send(pipe, 0.0, 1)), 0.0)          # chunk 0 stored
    assert pipe.txn_acked == 1
    o = send(pipe, 0.1, 2)                                        # chunk 1 in flight
    pipe.halted = True
    assert pipe.build(0.2, lambda sid, sl: "b1") == []            # nothing more goes out
    pipe.drop_unsent(KeraError("aborted"))                        # chunk 2
    assert [c.sequence for c in lane.chunks] == [1] and pipe.chunks_in_flight() == 1
    pipe.on_request_failed(o, KeraError("refused", retriable=False), 0.3)   # answered
    pipe.drop_unsent(KeraError("aborted"))
    assert pipe.chunks_in_flight() == 0 and not lane.chunks
    pipe.end_transaction()
    assert lane.next_sequence == 1 and pipe.txn_error is None and pipe.txn_acked == 0
    assert not pipe.take_failures()                  # an abort's drops are not failures


def test_a_new_epoch_restarts_every_lane_at_sequence_zero_under_its_producer_id():
    pipe = pipeline()
    lane, _ = add(pipe, 1)
    pipe.on_reply("b1", acked(send(pipe, 0.0, 1)), 0.0)
    pipe.txn_new_epoch = True
    pipe.new_identity(kera_producer_id(PID, EPOCH + 1))
    assert (lane.producer_id, lane.next_sequence) == ((PID << 8) | (EPOCH + 1), 0)
    assert not pipe.txn_new_epoch
    _, (c,) = add(pipe, 1)
    h = chunk.verify(c.data)
    assert (h.producer_id, h.sequence) == ((PID << 8) | (EPOCH + 1), TXN_SEQUENCE_BIT)


def test_a_plain_producers_lanes_carry_no_sequence_bit():
    pipe = Pipeline(request_size_bytes=1, in_flight_per_broker=1, retries_max=1,
                    request_timeout_s=1.0)
    lane, (c,) = add(pipe, 1, pid=1234)
    assert chunk.verify(c.data).sequence == 0 and lane.sequence_bit == 0


# ---------------------------------------------------------------------- Kafka properties
def test_kafkas_transaction_properties_map_to_keras_arguments():
    from kera.client.kafka_config import (CONSUMER_PROPERTIES, PRODUCER_PROPERTIES,
                                          kera_arguments)
    from kera.consumer.consumer import Consumer
    from kera.producer.producer import Producer
    produced = kera_arguments({"bootstrap.servers": "h:1", "transactional.id": "billing-3",
                               "transaction.timeout.ms": "5000"},
                              PRODUCER_PROPERTIES, Producer.__init__, {})
    assert (produced["transactional_id"], produced["transaction_timeout_ms"]) == ("billing-3", 5000)
    consumed = kera_arguments({"bootstrap.servers": "h:1", "isolation.level": "read_uncommitted"},
                              CONSUMER_PROPERTIES, Consumer.__init__, {})
    assert consumed["isolation_level"] == "read_uncommitted"
    with pytest.raises(BadRequest, match="read_committed or read_uncommitted"):
        kera_arguments({"bootstrap.servers": "h:1", "isolation.level": "snapshot"},
                       CONSUMER_PROPERTIES, Consumer.__init__, {})
