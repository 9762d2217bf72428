"""The transaction coordinator's state machine (kera.coordinator.transactions): fencing, the
two-phase commit and its markers, positions joining, timeouts, failover through to_state/load,
bounds and bad input."""

import itertools
import json
import random

import pytest

from kera.codec.wire import Fields
from kera.coordinator import transactions as tx
from kera.coordinator.transactions import (
    COMPLETE_ABORT, COMPLETE_COMMIT, EMPTY, ONGOING, PREPARE_ABORT, PREPARE_COMMIT,
    ConcurrentTransactions, InvalidTransactionTimeout, InvalidTxnState, Marker, ProducerFenced,
    TransactionTimedOut, Transactions, UnknownTransactionalId)
from kera.errors import BadRequest, KeraError

T = 1_000          # a timeout (ms) for the tests: the floor
PARTS = [("out", 0), ("out", 1), ("side", 0)]


def make() -> Transactions:
    ids = itertools.count(100)
    return Transactions(id_source=lambda: next(ids))


def started(txns=None, tid="job-1", now=0.0, parts=PARTS):
    """A Transactions with `tid` initialised and a transaction open on `parts`."""
    txns = txns or make()
    pid, epoch = txns.init(tid, T, now)
    txns.add_partitions(tid, pid, epoch, parts, now)
    return txns, pid, epoch


def write_all(txns, markers, now=0.0):
    return [txns.marker_written(m, now) for m in markers]


def roundtrip(txns: Transactions, now: float = 0.0, ids=None) -> Transactions:
    """What a coordinator taking over loads: the state through JSON."""
    fresh = Transactions(id_source=ids or (lambda: 999))
    fresh.load(json.loads(json.dumps(txns.to_state())), now)
    return fresh


def open_parts(txns: Transactions) -> int:
    return sum(len(t.parts) for t in txns.txns.values() if t.state in tx.OPEN)


# ---------------------------------------------------------------------- init and fencing
def test_init_gives_a_producer_id_and_a_new_instance_bumps_the_epoch():
    txns = make()
    assert txns.init("job-1", T, 0.0) == (100, 0)
    assert txns.init("job-1", T, 1.0) == (100, 1)
    assert txns.init("job-2", T, 1.0) == (101, 0)
    assert txns.describe("job-1")["state"] == EMPTY


def test_an_older_epoch_is_fenced_on_every_op():
    txns = make()
    pid, old = txns.init("job-1", T, 0.0)
    _, new = txns.init("job-1", T, 0.0)
    with pytest.raises(ProducerFenced):
        txns.add_partitions("job-1", pid, old, PARTS, 0.0)
    with pytest.raises(ProducerFenced):
        txns.add_positions("job-1", pid, old, "g", {("in", 0): [[0, 5, 1]]}, 0.0)
    with pytest.raises(ProducerFenced):
        txns.end("job-1", pid, old, True, 0.0)
    with pytest.raises(ProducerFenced):
        txns.verify(pid, old, ("out", 0), 0.0)
    assert txns.add_partitions("job-1", pid, new, PARTS, 0.0) == 1


def test_a_new_instance_aborts_what_the_old_one_left_open():
    txns, pid, epoch = started()
    txns.add_positions("job-1", pid, epoch, "g", {("in", 0): [[0, 9, 1]]}, 0.0)
    with pytest.raises(ConcurrentTransactions):
        txns.init("job-1", T, 1.0)            # the abort's markers are being written
    t = txns.txns["job-1"]
    assert t.state == PREPARE_ABORT and t.epoch == epoch + 1
    markers = txns.markers_due(1.0)
    assert {m.part for m in markers} == set(PARTS)
    assert all(not m.commit and m.epoch == epoch + 1 and m.txn == 1 for m in markers)
    with pytest.raises(ConcurrentTransactions):
        txns.init("job-1", T, 1.0)            # still being aborted: retry
    assert write_all(txns, markers, 2.0) == [False, False, True]
    assert txns.txns["job-1"].state == COMPLETE_ABORT
    assert txns.init("job-1", T, 2.0) == (pid, epoch + 2)
    for e in (epoch, epoch + 1):              # neither the zombie nor the fence's epoch
        with pytest.raises(ProducerFenced):
            txns.add_partitions("job-1", pid, e, PARTS, 2.0)
    assert txns.txns["job-1"].positions == {}  # the aborted positions never applied


def test_a_new_instance_over_an_open_transaction_without_parts_starts_at_once():
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    txns.add_positions("job-1", pid, epoch, "g", {}, 0.0)   # open, nothing to mark
    assert txns.init("job-1", T, 1.0) == (pid, epoch + 2)


def test_init_while_a_commit_is_being_written_is_retried():
    txns, pid, epoch = started()
    markers = txns.end("job-1", pid, epoch, True, 0.0).markers
    with pytest.raises(ConcurrentTransactions) as err:
        txns.init("job-1", T, 0.0)
    assert err.value.retriable
    write_all(txns, markers)
    assert txns.txns["job-1"].state == COMPLETE_COMMIT
    assert txns.init("job-1", T, 0.0) == (pid, epoch + 1)


def test_init_with_its_own_producer_id_keeps_it_and_a_stranger_is_fenced():
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    assert txns.init("job-1", T, 0.0, producer_id=pid, epoch=epoch) == (pid, epoch + 1)
    with pytest.raises(ProducerFenced):
        txns.init("job-1", T, 0.0, producer_id=pid, epoch=epoch)    # an epoch gone by
    with pytest.raises(ProducerFenced):
        txns.init("job-1", T, 0.0, producer_id=pid + 7, epoch=epoch + 1)


def test_epochs_running_out_give_a_new_producer_id():
    txns = make()
    pid, _ = txns.init("job-1", T, 0.0)
    for _ in range(tx.EPOCH_MAX - 1):
        txns.init("job-1", T, 0.0)
    assert txns.txns["job-1"].epoch == tx.EPOCH_MAX - 1
    new_pid, epoch = txns.init("job-1", T, 0.0)
    assert (new_pid, epoch) == (101, 0) and txns.by_producer == {101: "job-1"}
    with pytest.raises(InvalidTxnState):
        txns.verify(pid, tx.EPOCH_MAX - 1, ("out", 0), 0.0)


def test_an_open_transaction_always_has_room_for_its_fence():
    txns = make()
    for _ in range(tx.EPOCH_MAX + 5):
        pid, epoch = txns.init("job-1", T, 0.0)
        assert epoch < tx.EPOCH_MAX
    txns.add_partitions("job-1", pid, epoch, PARTS[:1], 0.0)
    assert txns.expire(10.0)[0].epoch == epoch + 1 <= tx.EPOCH_MAX


def test_transaction_numbers_running_out_need_a_new_init(monkeypatch):
    monkeypatch.setattr(tx, "TXN_NUMBER_MAX", 2)
    txns, pid, epoch = started(parts=[])
    txns.end("job-1", pid, epoch, True, 0.0)
    txns.add_partitions("job-1", pid, epoch, [], 0.0)
    txns.end("job-1", pid, epoch, False, 0.0)
    with pytest.raises(ProducerFenced):
        txns.add_partitions("job-1", pid, epoch, [], 0.0)
    assert txns.init("job-1", T, 0.0) == (101, 0)


# ---------------------------------------------------------------------- the two phases
def test_commit_orders_a_marker_per_part_and_completes_when_all_are_written():
    txns, pid, epoch = started()
    result = txns.end("job-1", pid, epoch, True, 1.0)
    assert result.markers == [Marker("job-1", pid, epoch, 1, True, s, sl)
                              for s, sl in sorted(PARTS)]
    assert txns.txns["job-1"].state == PREPARE_COMMIT
    with pytest.raises(ConcurrentTransactions):
        txns.add_partitions("job-1", pid, epoch, PARTS, 1.0)    # the next waits for this one
    assert write_all(txns, result.markers[:2], 2.0) == [False, False]
    assert txns.describe("job-1")["pending_markers"] == [["side", 0]]
    assert txns.marker_written(result.markers[2], 2.0) is True
    assert txns.txns["job-1"].state == COMPLETE_COMMIT
    assert txns.add_partitions("job-1", pid, epoch, PARTS[:1], 3.0) == 2
    assert txns.txns["job-1"].parts == {PARTS[0]} and txns.txns["job-1"].state == ONGOING


def test_abort_orders_abort_markers_at_the_same_epoch():
    txns, pid, epoch = started()
    markers = txns.end("job-1", pid, epoch, False, 0.0).markers
    assert len(markers) == 3 and all(not m.commit and m.epoch == epoch for m in markers)
    write_all(txns, markers)
    assert txns.txns["job-1"].state == COMPLETE_ABORT


def test_a_retried_end_answers_again_and_a_contrary_one_is_refused():
    txns, pid, epoch = started()
    txns.add_positions("job-1", pid, epoch, "g", {("in", 0): [[0, 3, 1]]}, 0.0)
    first = txns.end("job-1", pid, epoch, True, 0.0)
    assert first.positions == {"g": {("in", 0): [[0, 3, 1]]}}
    again = txns.end("job-1", pid, epoch, True, 0.0)
    assert again.markers == first.markers and again.positions == {}   # applied once only
    with pytest.raises(InvalidTxnState):
        txns.end("job-1", pid, epoch, False, 0.0)
    write_all(txns, first.markers)
    assert txns.end("job-1", pid, epoch, True, 0.0) == ([], {})


def test_ending_without_a_transaction_is_refused():
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    for commit in (True, False):
        with pytest.raises(InvalidTxnState):
            txns.end("job-1", pid, epoch, commit, 0.0)


def test_a_transaction_without_parts_completes_at_its_decision():
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    txns.add_positions("job-1", pid, epoch, "g", {("in", 1): [[0, 7, 1]]}, 0.0)
    result = txns.end("job-1", pid, epoch, True, 0.0)
    assert result.markers == [] and result.positions == {"g": {("in", 1): [[0, 7, 1]]}}
    assert txns.txns["job-1"].state == COMPLETE_COMMIT


def test_stale_or_foreign_acknowledgements_change_nothing():
    txns, pid, epoch = started()
    m = txns.end("job-1", pid, epoch, True, 0.0).markers[0]
    txns.take_dirty()
    for bad in (m._replace(txn=2), m._replace(commit=False), m._replace(producer_id=pid + 1),
                m._replace(transactional_id="nobody"), m._replace(stream="elsewhere")):
        assert txns.marker_written(bad, 0.0) is False
    assert txns.txns["job-1"].written == set() and not txns.take_dirty()
    assert txns.marker_written(m, 0.0) is False and txns.marker_written(m, 0.0) is False
    assert txns.txns["job-1"].written == {m.part}


def test_markers_are_sent_again_until_acknowledged(monkeypatch):
    txns, pid, epoch = started()
    markers = txns.end("job-1", pid, epoch, True, 0.0).markers
    assert txns.markers_due(0.0) == markers
    assert txns.markers_due(0.5) == []
    txns.marker_written(markers[0], 0.6)
    assert txns.markers_due(0.0 + tx.MARKER_RETRY_S) == markers[1:]
    monkeypatch.setattr(tx, "MARKERS_PER_TURN_MAX", 1)
    assert len(txns.markers_due(5.0)) == 1 and len(txns.markers_due(5.0)) == 1
    assert txns.markers_due(5.0) == []


def test_changes_mark_the_state_dirty_and_questions_do_not():
    txns, pid, epoch = started()
    assert txns.take_dirty() and not txns.take_dirty()
    txns.describe("job-1"), txns.summaries(), txns.resolve(pid, epoch, ("out", 0))
    txns.verify(pid, epoch, ("out", 0), 0.0)
    txns.add_partitions("job-1", pid, epoch, PARTS[:1], 0.0)     # nothing new
    assert not txns.take_dirty()
    markers = txns.end("job-1", pid, epoch, True, 0.0).markers
    assert txns.take_dirty()
    assert txns.markers_due(0.0) and not txns.take_dirty()      # sends are not persisted
    txns.marker_written(markers[0], 0.0)
    assert txns.take_dirty()
    assert json.loads(json.dumps(markers[0].to_wire())) == list(markers[0])


# ---------------------------------------------------------------------- positions
def test_positions_join_the_transaction_and_apply_only_at_commit():
    txns, pid, epoch = started()
    txns.add_positions("job-1", pid, epoch, "g", {("in", 0): [[0, 5, 1]]}, 0.0)
    txns.add_positions("job-1", pid, epoch, "g", {("in", 0): [[0, 8, 1]], ("in", 1): [[2, 1, 1]]},
                       0.0)
    txns.add_positions("job-1", pid, epoch, "h", {}, 0.0)    # AddOffsetsToTxn: the group only
    result = txns.end("job-1", pid, epoch, True, 0.0)
    assert result.positions == {"g": {("in", 0): [[0, 8, 1]], ("in", 1): [[2, 1, 1]]}, "h": {}}


def test_positions_begin_a_transaction_and_the_next_one_starts_clean():
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    assert txns.add_positions("job-1", pid, epoch, "g", {("in", 0): [[0, 1, 1]]}, 0.0) == 1
    assert txns.txns["job-1"].state == ONGOING
    txns.end("job-1", pid, epoch, False, 0.0)
    txns.add_partitions("job-1", pid, epoch, PARTS[:1], 0.0)
    assert txns.end("job-1", pid, epoch, True, 0.0).positions == {}


# ---------------------------------------------------------------------- time
def test_a_transaction_open_past_its_timeout_is_aborted_and_its_producer_fenced():
    txns, pid, epoch = started()
    assert txns.expire(T / 1000) == []                  # exactly the timeout: not past it
    markers = txns.expire(T / 1000 + 0.01)
    assert {m.part for m in markers} == set(PARTS)
    assert all(not m.commit and m.epoch == epoch + 1 for m in markers)
    with pytest.raises(TransactionTimedOut):
        txns.add_partitions("job-1", pid, epoch, PARTS, 2.0)
    with pytest.raises(TransactionTimedOut):
        txns.end("job-1", pid, epoch, True, 2.0)
    assert txns.end("job-1", pid, epoch, False, 2.0) == ([], {})   # abort: already done
    with pytest.raises(ConcurrentTransactions):
        txns.init("job-1", T, 2.0, producer_id=pid, epoch=epoch)
    write_all(txns, markers, 2.0)
    assert txns.init("job-1", T, 2.0, producer_id=pid, epoch=epoch) == (pid, epoch + 2)
    with pytest.raises(ProducerFenced) as err:
        txns.add_partitions("job-1", pid, epoch, PARTS, 2.0)
    assert type(err.value) is ProducerFenced            # the bump ended the timed-out grace


def test_a_timed_out_transaction_without_parts_aborts_at_once():
    txns, pid, epoch = started(parts=[])
    assert txns.expire(5.0) == [] and txns.txns["job-1"].state == COMPLETE_ABORT


def test_a_prepared_transaction_does_not_time_out():
    txns, pid, epoch = started()
    txns.end("job-1", pid, epoch, True, 0.0)
    assert txns.expire(1000.0) == [] and txns.txns["job-1"].state == PREPARE_COMMIT


def test_idle_ids_are_forgotten_and_open_ones_kept():
    txns = make()
    txns.init("idle", T, 0.0)
    started(txns, "busy", now=0.0)
    txns.expire(tx.ID_EXPIRY_S + 1)
    assert "idle" not in txns.txns and list(txns.by_producer.values()) == ["busy"]
    with pytest.raises(UnknownTransactionalId):
        txns.describe("idle")
    with pytest.raises(UnknownTransactionalId):
        txns.add_partitions("idle", 100, 0, PARTS, 0.0)
    assert txns.init("idle", T, 0.0)[1] == 0        # a new producer id at epoch 0


# ---------------------------------------------------------------------- brokers' questions
def test_verify_answers_the_open_transaction_holding_the_part():
    txns, pid, epoch = started()
    assert txns.verify(pid, epoch, ["out", 1], 0.0) == 1
    with pytest.raises(InvalidTxnState):
        txns.verify(pid, epoch, ["else", 0], 0.0)
    assert txns.verify(pid, epoch, ["else", 0], 0.0, add=True) == 1
    assert ("else", 0) in txns.txns["job-1"].parts
    with pytest.raises(InvalidTxnState):
        txns.verify(12345, 0, ["out", 1], 0.0)
    txns.end("job-1", pid, epoch, True, 0.0)
    with pytest.raises(InvalidTxnState):
        txns.verify(pid, epoch, ["out", 1], 0.0)       # a chunk after the decision: refused


def test_resolve_tells_a_broker_what_its_open_transaction_became():
    txns, pid, epoch = started()
    assert txns.resolve(pid, epoch, ("out", 0)) == ("open", 1)
    assert txns.resolve(pid, epoch, ("nowhere", 0)) == ("abort", -1)   # never verified there
    assert txns.resolve(pid, epoch + 1, ("out", 0)) == ("abort", -1)   # an epoch never issued
    assert txns.resolve(424242, 0, ("out", 0)) == ("abort", -1)
    markers = txns.end("job-1", pid, epoch, True, 0.0).markers
    assert txns.resolve(pid, epoch, ("out", 0)) == ("commit", 1)
    txns.marker_written(markers[0], 0.0)
    assert txns.resolve(pid, epoch, markers[0].part) == ("abort", -1)  # its marker is there
    write_all(txns, markers[1:])
    assert txns.resolve(pid, epoch, ("out", 1)) == ("abort", -1)       # complete: not open


def test_resolve_after_a_fence_aborts_the_old_epochs_transaction():
    txns, pid, epoch = started()
    with pytest.raises(ConcurrentTransactions):
        txns.init("job-1", T, 0.0)
    assert txns.resolve(pid, epoch, ("out", 0)) == ("abort", 1)        # the fence's abort
    write_all(txns, txns.markers_due(0.0))
    _, new = txns.init("job-1", T, 0.0)
    txns.add_partitions("job-1", pid, new, PARTS, 0.0)
    assert txns.resolve(pid, epoch, ("out", 0)) == ("abort", -1)       # an older epoch's
    assert txns.resolve(pid, new, ("out", 0)) == ("open", 2)


# ---------------------------------------------------------------------- failover
def _at_state(state: str):
    """A Transactions holding `job-1` in `state` (prepared ones with one marker written)."""
    txns, pid, epoch = started()
    txns.add_positions("job-1", pid, epoch, "g", {("in", 0): [[0, 4, 1]]}, 0.0)
    if state == EMPTY:
        txns.end("job-1", pid, epoch, False, 0.0)
        write_all(txns, txns.markers_due(0.0))
        txns.init("job-1", T, 0.0)
    elif state in (PREPARE_COMMIT, PREPARE_ABORT, COMPLETE_COMMIT, COMPLETE_ABORT):
        markers = txns.end("job-1", pid, epoch, state in (PREPARE_COMMIT, COMPLETE_COMMIT), 0.0)[0]
        write_all(txns, markers if state.startswith("Complete") else markers[:1])
    assert txns.txns["job-1"].state == state
    return txns, pid, epoch


@pytest.mark.parametrize("state", [EMPTY, ONGOING, PREPARE_COMMIT, PREPARE_ABORT,
                                   COMPLETE_COMMIT, COMPLETE_ABORT])
def test_the_state_survives_a_round_trip_in_every_state(state):
    txns, _, _ = _at_state(state)
    loaded = roundtrip(txns)
    assert loaded.to_state() == txns.to_state()
    assert loaded.by_producer == txns.by_producer
    assert loaded.parts_held == txns.parts_held == open_parts(txns)
    assert loaded.prepared == txns.prepared == ({"job-1"} if state in tx.PREPARED else set())
    assert loaded.describe("job-1") == txns.describe("job-1")


def test_a_coordinator_taking_over_mid_commit_resumes_writing_markers():
    txns, pid, epoch = _at_state(PREPARE_COMMIT)       # one of three markers written
    loaded = roundtrip(txns, now=50.0)
    due = loaded.markers_due(50.0)
    assert [m.part for m in due] == sorted(PARTS)[1:] and all(m.commit for m in due)
    assert write_all(loaded, due, 51.0) == [False, True]
    assert loaded.txns["job-1"].state == COMPLETE_COMMIT
    with pytest.raises(ConcurrentTransactions):
        roundtrip(txns).init("job-1", T, 0.0)          # the old state: still committing


def test_a_loaded_open_transaction_times_out_from_the_load():
    txns, pid, epoch = started(now=0.0)
    loaded = roundtrip(txns, now=100.0)
    assert loaded.expire(100.5) == []
    assert len(loaded.expire(101.5)) == len(PARTS)


def test_fencing_survives_a_round_trip():
    txns, pid, epoch = started()
    with pytest.raises(ConcurrentTransactions):
        txns.init("job-1", T, 0.0)
    loaded = roundtrip(txns)
    with pytest.raises(ProducerFenced):
        loaded.add_partitions("job-1", pid, epoch + 1, PARTS, 0.0)   # the fence's epoch
    timed, p2, e2 = started(tid="job-2")
    timed.expire(10.0)
    with pytest.raises(TransactionTimedOut):
        roundtrip(timed).add_partitions("job-2", p2, e2, PARTS, 10.0)


def test_a_bad_state_is_refused():
    txns, _, _ = _at_state(PREPARE_COMMIT)
    good = txns.to_state()
    for change in ({"state": "Dead"}, {"state": "Pending"}, {"written": [["zzz", 0]]},
                   {"producer_id": 0}, {"epoch": tx.EPOCH_MAX + 1}):
        with pytest.raises(ValueError):
            Transactions().load([{**good[0], **change}], 0.0)
    with pytest.raises(ValueError):
        Transactions().load(good + good, 0.0)
    for change in ({"parts": [["out", -1]]}, {"positions": "x"}, {"txn": None}):
        with pytest.raises(ValueError):
            Transactions().load([{**good[0], **change}], 0.0)
    missing = dict(good[0])
    del missing["fenced"]
    with pytest.raises(ValueError):
        Transactions().load([missing], 0.0)


# ---------------------------------------------------------------------- streams going away
def test_a_deleted_stream_leaves_every_transaction():
    txns, pid, epoch = started(parts=[("gone", 0), ("gone", 1)])
    txns.add_positions("job-1", pid, epoch, "g", {("gone", 0): [[0, 1, 1]]}, 0.0)
    txns.end("job-1", pid, epoch, True, 0.0)
    txns.forget_stream("gone", 0.0)
    assert txns.txns["job-1"].state == COMPLETE_COMMIT and txns.parts_held == 0
    other, p2, e2 = started(tid="job-2", parts=[("gone", 0), ("kept", 0)])
    other.forget_stream("gone", 0.0)
    assert other.txns["job-2"].parts == {("kept", 0)} and other.parts_held == 1


# ---------------------------------------------------------------------- bounds and bad input
def test_timeouts_outside_the_bounds_are_refused():
    txns = make()
    for bad in (tx.TIMEOUT_MS_MIN - 1, tx.TIMEOUT_MS_MAX + 1, 1.5, "60000", True):
        with pytest.raises(InvalidTransactionTimeout):
            txns.init("job-1", bad, 0.0)
    assert isinstance(InvalidTransactionTimeout(), BadRequest)
    assert txns.txns == {}


def test_ids_must_be_short_strings():
    txns = make()
    for bad in ("", "x" * (tx.TRANSACTIONAL_ID_CHARS_MAX + 1), None, 7):
        with pytest.raises(BadRequest):
            txns.init(bad, T, 0.0)


def test_the_number_of_ids_is_bounded(monkeypatch):
    monkeypatch.setattr(tx, "TRANSACTIONAL_IDS_MAX", 3)
    txns = make()
    for i in range(3):
        txns.init(f"job-{i}", T, 0.0)
    with pytest.raises(BadRequest, match="transactional ids are in use"):
        txns.init("job-3", T, 0.0)
    txns.init("job-0", T, 0.0)                         # a known id still starts


def test_parts_per_transaction_are_bounded_and_a_refusal_changes_nothing(monkeypatch):
    monkeypatch.setattr(tx, "PARTS_PER_TRANSACTION_MAX", 2)
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    txns.take_dirty()
    with pytest.raises(BadRequest, match="at most 2"):
        txns.add_partitions("job-1", pid, epoch, PARTS, 0.0)
    t = txns.txns["job-1"]
    assert (t.state, t.number, txns.parts_held, txns.take_dirty()) == (EMPTY, 0, 0, False)
    txns.add_partitions("job-1", pid, epoch, PARTS[:2], 0.0)
    txns.add_partitions("job-1", pid, epoch, PARTS[:1], 0.0)   # already in: no growth
    with pytest.raises(BadRequest):
        txns.add_partitions("job-1", pid, epoch, PARTS[2:], 0.0)


def test_parts_of_all_transactions_are_bounded(monkeypatch):
    monkeypatch.setattr(tx, "PARTS_ALL_TRANSACTIONS_MAX", 4)
    txns, pid, epoch = started()
    with pytest.raises(BadRequest, match="open transactions hold 3"):
        started(txns, "job-2")
    markers = txns.end("job-1", pid, epoch, False, 0.0).markers
    assert txns.parts_held == 3
    write_all(txns, markers)
    assert txns.parts_held == 0
    p2, e2 = txns.init("job-2", T, 0.0)
    txns.add_partitions("job-2", p2, e2, PARTS, 0.0)


def test_positions_are_bounded(monkeypatch):
    monkeypatch.setattr(tx, "GROUPS_PER_TRANSACTION_MAX", 2)
    monkeypatch.setattr(tx, "POSITIONS_PER_TRANSACTION_MAX", 3)
    txns, pid, epoch = started()
    txns.add_positions("job-1", pid, epoch, "a", {("in", 0): [1], ("in", 1): [1]}, 0.0)
    txns.add_positions("job-1", pid, epoch, "b", {}, 0.0)
    with pytest.raises(BadRequest, match="2 groups"):
        txns.add_positions("job-1", pid, epoch, "c", {}, 0.0)
    txns.add_positions("job-1", pid, epoch, "a", {("in", 0): [2], ("in", 2): [1]}, 0.0)
    with pytest.raises(BadRequest, match="at most 3 positions"):
        txns.add_positions("job-1", pid, epoch, "b", {("in", 3): [1]}, 0.0)
    for bad_group in ("", "g" * 256, 5):
        with pytest.raises(BadRequest):
            txns.add_positions("job-1", pid, epoch, bad_group, {}, 0.0)


def test_malformed_parts_are_refused():
    txns = make()
    pid, epoch = txns.init("job-1", T, 0.0)
    for bad in (["out"], [("out", -1)], [("out", "0")], [(7, 0)], [("", 0)], [("out", True)],
                [("out", 2**31)]):
        with pytest.raises(BadRequest):
            txns.add_partitions("job-1", pid, epoch, bad, 0.0)
    assert txns.txns["job-1"].state == EMPTY


def test_unknown_ids_are_reported_as_such():
    txns = make()
    with pytest.raises(UnknownTransactionalId):
        txns.end("nobody", 1, 0, True, 0.0)
    with pytest.raises(UnknownTransactionalId):
        txns.add_positions("nobody", 1, 0, "g", {}, 0.0)


def test_error_classes_say_who_may_retry():
    assert ConcurrentTransactions.retriable
    for cls in (ProducerFenced, TransactionTimedOut, InvalidTxnState, UnknownTransactionalId,
                InvalidTransactionTimeout):
        assert not cls.retriable and issubclass(cls, KeraError)
    assert len({cls.code for cls in tx.ERRORS}) == len(tx.ERRORS)
    assert issubclass(TransactionTimedOut, ProducerFenced)


# ---------------------------------------------------------------------- the ops
class FakeGroups:
    def __init__(self):
        self.applied = []

    def apply(self, group, positions):
        self.applied.append((group, positions))

    @staticmethod
    def check(f, group, positions):
        if any(not isinstance(v, list) for v in positions.values()):
            raise BadRequest("a position is a list")
        if f.str("member_id", "") == "zombie":
            raise KeraError("a stale member")


def call(handlers, op, now=0.0, **fields):
    return handlers[op](Fields(fields), now)


def test_the_ops_run_a_transaction_and_apply_positions_at_commit_only():
    txns, groups = make(), FakeGroups()
    h = tx.ops(txns, groups.apply, groups.check)
    me = call(h, "txn_init", transactional_id="job-1", timeout_ms=T)
    who = {"transactional_id": "job-1", "producer_id": me["producer_id"], "epoch": me["epoch"]}
    assert call(h, "txn_add_parts", parts=[["out", 0]], **who) == {"txn": 1}
    call(h, "txn_add_positions", group="g", positions=[["in", 0, [[0, 3, 1]]]], **who)
    with pytest.raises(KeraError, match="stale member"):
        call(h, "txn_add_positions", group="g", positions=[["in", 0, [[0, 9, 1]]]],
             member_id="zombie", **who)
    assert call(h, "txn_verify", producer_id=me["producer_id"], epoch=me["epoch"],
                part=["out", 0]) == {"txn": 1}
    assert call(h, "txn_resolve", producer_id=me["producer_id"], epoch=me["epoch"],
                part=["out", 0]) == {"decision": "open", "txn": 1}
    assert groups.applied == []
    assert call(h, "txn_end", commit=True, **who) == {"markers": 1}
    assert groups.applied == [("g", {("in", 0): [[0, 3, 1]]})]
    call(h, "txn_end", commit=True, **who)                      # a retry applies nothing
    assert len(groups.applied) == 1
    assert call(h, "txn_describe", transactional_id="job-1")["state"] == PREPARE_COMMIT
    assert call(h, "txn_list")["transactions"][0]["transactional_id"] == "job-1"


def test_an_aborted_transaction_applies_no_positions_through_the_ops():
    txns, groups = make(), FakeGroups()
    h = tx.ops(txns, groups.apply, groups.check)
    me = call(h, "txn_init", transactional_id="job-1")        # the default timeout
    assert txns.txns["job-1"].timeout_ms == tx.TIMEOUT_MS_DEFAULT
    who = {"transactional_id": "job-1", "producer_id": me["producer_id"], "epoch": me["epoch"]}
    call(h, "txn_add_positions", group="g", positions=[["in", 0, [[0, 3, 1]]]], **who)
    call(h, "txn_end", commit=False, **who)
    assert groups.applied == []


@pytest.mark.parametrize("op, fields", [
    ("txn_init", {}),
    ("txn_init", {"transactional_id": 5}),
    ("txn_init", {"transactional_id": "j", "timeout_ms": -1}),
    ("txn_init", {"transactional_id": "j", "epoch": tx.EPOCH_MAX + 1}),
    ("txn_add_parts", {"transactional_id": "j", "producer_id": 100, "epoch": 0}),
    ("txn_add_parts", {"transactional_id": "j", "producer_id": 100, "epoch": 0, "parts": "x"}),
    ("txn_add_parts", {"transactional_id": "j", "producer_id": -1, "epoch": 0, "parts": []}),
    ("txn_add_positions", {"transactional_id": "j", "producer_id": 100, "epoch": 0,
                           "group": "g", "positions": [["in", 0]]}),
    ("txn_add_positions", {"transactional_id": "j", "producer_id": 100, "epoch": 0,
                           "group": "g", "positions": [["in", 0, "not a list"]]}),
    ("txn_end", {"transactional_id": "j", "producer_id": 100, "epoch": 0}),
    ("txn_end", {"transactional_id": "j", "producer_id": 100, "epoch": 0, "commit": 1}),
    ("txn_verify", {"producer_id": 100, "epoch": 0, "part": ["out", 0, 1]}),
    ("txn_resolve", {"producer_id": 100, "epoch": 0, "part": "out"}),
])
def test_malformed_requests_are_refused_and_change_nothing(op, fields):
    txns, groups = make(), FakeGroups()
    h = tx.ops(txns, groups.apply, groups.check)
    call(h, "txn_init", transactional_id="j", timeout_ms=T)
    before = txns.to_state()
    with pytest.raises(BadRequest):
        call(h, op, **fields)
    assert txns.to_state() == before


# ---------------------------------------------------------------------- invariants under churn
def test_parts_held_and_states_stay_consistent_under_random_ops():
    """A seeded random walk of every op, a failover now and then: `parts_held` equals the
    open transactions' parts, every transaction ends committed or aborted, never half."""
    seed = 39
    rng = random.Random(seed)
    txns = make()
    ids = [f"job-{i}" for i in range(4)]
    holders = {}   # tid -> (pid, epoch) of the latest instance
    now = 0.0
    for step in range(3000):
        now += rng.random() * 0.2
        _random_op(txns, rng, ids, holders, now)
        if step % 300 == 299:
            txns = roundtrip(txns, now, ids=itertools.count(10_000).__next__)
        assert txns.parts_held == open_parts(txns), f"seed {seed} step {step}"
        assert txns.prepared == {t.id for t in txns.txns.values() if t.state in tx.PREPARED}
        for t in txns.txns.values():
            assert t.written <= t.parts and t.state in tx.STATES
            if t.state in (COMPLETE_COMMIT, COMPLETE_ABORT):
                assert t.written == t.parts, f"seed {seed}: {t.id} completed half"


def _random_op(txns, rng, ids, holders, now):
    tid = rng.choice(ids)
    pid, epoch = holders.get(tid, (1, 0))
    if rng.random() < 0.3 and rng.random() < 0.5:
        epoch = max(0, epoch - 1)                       # a zombie now and then
    op = rng.randrange(6)
    try:
        if op == 0:
            holders[tid] = txns.init(tid, T, now)
        elif op == 1:
            txns.add_partitions(tid, pid, epoch, [("s", rng.randrange(5))], now)
        elif op == 2:
            txns.add_positions(tid, pid, epoch, "g", {("in", rng.randrange(3)): [now]}, now)
        elif op == 3:
            txns.end(tid, pid, epoch, rng.random() < 0.6, now)
        elif op == 4:
            for m in txns.markers_due(now):
                if rng.random() < 0.7:
                    txns.marker_written(m, now)
        else:
            txns.expire(now)
    except KeraError:
        pass
