"""Transactions wired into the coordinator (kera.coordinator.core, txn_positions): the txn ops
through Coordinator.handle, positions reaching their group only at a commit decision, fencing,
timeouts from the tick, deleted streams, ACLs, and the state surviving a restart mid-commit
through the file store and etcd's keys."""

import argparse
import random

import pytest

from kera.cli.security import _entries

from kera.codec import wire
from kera.coordinator import store
from kera.coordinator import transactions as tx
from kera.coordinator.core import TXN_EXPIRY_CHECK_S, Coordinator
from kera.errors import (BadRequest, ConcurrentTransactions, GroupNotEmpty, InvalidTxnState,
                         NotAuthorized, ProducerFenced, StaleMemberEpoch, TransactionTimedOut,
                         UnknownMember, UnknownTransactionalId)
from kera.net.access import Guard
from kera.net.acl import Acl, Acls
from kera.net.keys import Principal
from tests.unit.test_etcd_keys import DictEtcd

TOKEN = "0123456789abcdef0123456789abcdef"
TID = "billing-3"
ALICE = Principal("alice", "client")
BROKER0 = Principal("broker-0", "broker")
COORDINATOR = Principal("coordinator", "coordinator")


def cluster(now=0.0) -> Coordinator:
    """Two brokers, streams `in` and `out` of two streamlets each."""
    c = Coordinator(now, token_source=lambda: TOKEN)
    for i in range(2):
        c.handle("register", {"kind": "broker", "address": f"127.0.0.1:{9000 + i}",
                              "node": f"n{i}"}, now)
    for name in ("in", "out"):
        c.handle("create_stream", {"name": name, "streamlets": 2}, now)
    return c


def init(c: Coordinator, now=0.0, **fields) -> tuple[int, int]:
    reply = c.handle("txn_init", {"transactional_id": TID, **fields}, now)
    return reply["producer_id"], reply["epoch"]


def owner(pid: int, epoch: int) -> dict:
    return {"transactional_id": TID, "producer_id": pid, "epoch": epoch}


def position(offset: int) -> list:
    return [[0, offset, None]]    # a kera group position: [[group, offset, epoch]]


def committed(c: Coordinator, group: str) -> dict:
    return {(s, sl): pos for s, sl, pos in c.handle("group_offsets", {"group": group},
                                                   0.0)["positions"]}


def read_write(c: Coordinator, now=0.0, **position_fields) -> tuple[int, int]:
    """A transaction writing out/0 and out/1 with the position of in/0 joined."""
    pid, epoch = init(c, now)
    c.handle("txn_add_parts", {**owner(pid, epoch), "parts": [["out", 0], ["out", 1]]}, now)
    c.handle("txn_add_positions", {**owner(pid, epoch), "group": "g",
                                   "positions": [["in", 0, position(42)]], **position_fields},
             now)
    return pid, epoch


# ---------------------------------------------------------------------- positions and commits

def test_positions_reach_the_group_only_with_the_commit_decision():
    c = cluster()
    pid, epoch = read_write(c)
    assert committed(c, "g") == {}                       # joined, not applied
    assert c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 1.0) == {"markers": 2}
    assert committed(c, "g") == {("in", 0): position(42)}
    described = c.handle("txn_describe", {"transactional_id": TID}, 1.0)
    assert described["state"] == tx.PREPARE_COMMIT
    assert described["pending_markers"] == [["out", 0], ["out", 1]]
    assert c.handle("txn_list", {}, 1.0)["transactions"] == [
        {"transactional_id": TID, "producer_id": pid, "state": tx.PREPARE_COMMIT}]


def test_an_abort_drops_the_positions():
    c = cluster()
    pid, epoch = read_write(c)
    c.handle("txn_end", {**owner(pid, epoch), "commit": False}, 1.0)
    assert committed(c, "g") == {}
    assert c.transactions.txns[TID].state == tx.PREPARE_ABORT


def test_markers_acknowledged_complete_the_commit_and_the_next_transaction_may_begin():
    c = cluster()
    pid, epoch = read_write(c)
    c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 1.0)
    with pytest.raises(ConcurrentTransactions):
        c.handle("txn_add_parts", {**owner(pid, epoch), "parts": [["out", 0]]}, 1.0)
    for marker in c.transactions.markers_due(1.0):
        c.transactions.marker_written(marker, 1.0)
    assert c.transactions.txns[TID].state == tx.COMPLETE_COMMIT
    assert c.handle("txn_add_parts", {**owner(pid, epoch), "parts": [["out", 0]]},
                    2.0) == {"txn": 2}


def test_member_and_epoch_are_checked_when_positions_join():
    c = cluster()
    beat = c.handle("group_heartbeat", {"group": "g", "member_epoch": 0, "streams": ["in"]}, 0.0)
    member, member_epoch = beat["member_id"], beat["member_epoch"]
    held = [list(p) for p in beat["assignment"]]
    assert held, beat
    pid, epoch = init(c)
    join = {**owner(pid, epoch), "group": "g", "positions": [[*held[0], position(7)]]}
    with pytest.raises(GroupNotEmpty):            # a live group takes its members' positions only
        c.handle("txn_add_positions", join, 0.0)
    with pytest.raises(UnknownMember):
        c.handle("txn_add_positions", {**join, "member_id": "nobody"}, 0.0)
    with pytest.raises(StaleMemberEpoch):
        c.handle("txn_add_positions", {**join, "member_id": member,
                                       "member_epoch": member_epoch + 1}, 0.0)
    with pytest.raises(StaleMemberEpoch):
        c.handle("txn_add_positions", {**join, "member_id": member, "member_epoch": member_epoch,
                                       "positions": [["out", 0, position(1)]]}, 0.0)
    assert c.transactions.txns[TID].state == tx.EMPTY     # every refusal changed nothing
    c.handle("txn_add_positions", {**join, "member_id": member, "member_epoch": member_epoch},
             0.0)
    c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 0.0)
    assert committed(c, "g") == {tuple(held[0]): position(7)}


def test_malformed_positions_are_refused_when_they_join():
    c = cluster()
    pid, epoch = init(c)
    for bad in ([["in", 0, 5]], [["in", 0, [[0, -1, None]]]], [["in", 0, []]]):
        with pytest.raises(BadRequest):
            c.handle("txn_add_positions", {**owner(pid, epoch), "group": "g",
                                           "positions": bad}, 0.0)


def test_kafka_positions_go_to_the_kafka_offsets_and_a_name_has_one_protocol():
    c = cluster()
    pid, epoch = init(c)
    c.handle("txn_add_positions", {**owner(pid, epoch), "group": "kg", "kafka": True,
                                   "positions": [["in", 1, [17, "meta"]]]}, 0.0)
    with pytest.raises(BadRequest, match="one protocol"):
        c.handle("txn_add_positions", {**owner(pid, epoch), "group": "kg",
                                       "positions": [["in", 0, position(1)]]}, 0.0)
    c.handle("kafka_offset_commit", {"group": "other", "offsets": [["in", 0, 1, ""]]}, 0.0)
    with pytest.raises(BadRequest, match="one protocol"):
        c.handle("txn_add_positions", {**owner(pid, epoch), "group": "other",
                                       "positions": [["in", 0, position(1)]]}, 0.0)
    assert c.handle("kafka_offset_fetch", {"group": "kg"}, 0.0)["offsets"] == []
    c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 0.0)
    assert c.handle("kafka_offset_fetch", {"group": "kg"}, 0.0)["offsets"] == [
        ["in", 1, 17, "meta"]]
    assert "kg" not in c.groups.groups


# ---------------------------------------------------------------------- fencing and time

def test_a_second_init_fences_the_first_instance_and_aborts_its_transaction():
    c = cluster()
    pid, epoch = read_write(c)
    with pytest.raises(ConcurrentTransactions):   # its abort's markers are written first
        init(c, 1.0)
    for marker in c.transactions.markers_due(1.0):
        assert not marker.commit
        c.transactions.marker_written(marker, 1.0)
    pid2, epoch2 = init(c, 2.0)
    assert (pid2, epoch2) == (pid, epoch + 2)      # the fence's epoch, then the new instance's
    with pytest.raises(ProducerFenced):
        c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 2.0)
    assert committed(c, "g") == {}


def test_errors_cross_the_wire_as_their_classes():
    for err in (ProducerFenced("x"), TransactionTimedOut("x"), ConcurrentTransactions("x"),
                InvalidTxnState("x"), UnknownTransactionalId("x"),
                tx.InvalidTransactionTimeout("x")):
        header = wire.unpack_header(wire.error_reply(1, err))
        with pytest.raises(type(err)) as raised:
            wire.raise_for_reply(header)
        assert type(raised.value) is type(err) and raised.value.retriable == err.retriable


def test_the_tick_aborts_a_transaction_past_its_timeout_at_most_once_a_second():
    c = cluster()
    pid, epoch = init(c, 0.0, timeout_ms=1_000)
    c.handle("txn_add_parts", {**owner(pid, epoch), "parts": [["out", 0]]}, 0.0)
    c.tick(0.5)
    assert c.transactions.txns[TID].state == tx.ONGOING
    c.tick(1.2)     # past its timeout, and a second after the coordinator started: a pass
    assert c.transactions.txns[TID].state == tx.PREPARE_ABORT
    with pytest.raises(TransactionTimedOut):
        c.handle("txn_add_parts", {**owner(pid, epoch), "parts": [["out", 1]]}, 1.3)
    assert c.handle("txn_end", {**owner(pid, epoch), "commit": False}, 1.3) == {"markers": 0}


def test_expiry_passes_are_throttled():
    c = cluster()
    pid, epoch = init(c, 0.0, timeout_ms=1_000)
    c.handle("txn_add_parts", {**owner(pid, epoch), "parts": [["out", 0]]}, 0.5)
    c.tick(TXN_EXPIRY_CHECK_S)               # a pass: the transaction is 0.5 s old
    c.tick(TXN_EXPIRY_CHECK_S + 0.6)         # 1.1 s old, but no pass within the second
    assert c.transactions.txns[TID].state == tx.ONGOING
    c.tick(2 * TXN_EXPIRY_CHECK_S)
    assert c.transactions.txns[TID].state == tx.PREPARE_ABORT


def test_a_deleted_stream_leaves_every_transaction():
    c = cluster()
    pid, epoch = read_write(c)
    c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 1.0)
    c.handle("delete_stream", {"name": "out"}, 2.0)
    assert c.transactions.txns[TID].state == tx.COMPLETE_COMMIT   # nothing left to mark
    assert c.marker_owner(("out", 0)) is None


def test_marker_owner_is_the_live_owning_broker():
    c = cluster()
    owners = c.streams["out"].placement
    assert c.marker_owner(("out", 1)) == c.members["broker"][owners[1]].address
    assert c.marker_owner(("out", 2)) is None and c.marker_owner(("nope", 0)) is None
    c.members["broker"][owners[0]].alive = False
    assert c.marker_owner(("out", 0)) is None


# ---------------------------------------------------------------------- access

def test_rules_transactional_ids_are_a_resource_and_broker_ops_are_brokers_only():
    guard = Guard(Acls([Acl.parse(["alice", "allow", "write", "transactional_id", "job-",
                                   "prefixed"])]))
    for op in ("txn_init", "txn_add_parts", "txn_add_positions", "txn_end", "txn_describe"):
        guard.admit(ALICE, op, {"transactional_id": "job-1"})
        with pytest.raises(NotAuthorized, match="--transactional-id other"):
            guard.admit(ALICE, op, {"transactional_id": "other"})
        guard.admit(BROKER0, op, {"transactional_id": "other"})   # its Kafka listener's call
    for op in ("txn_verify", "txn_resolve"):
        guard.admit(BROKER0, op, {})
        for who in (ALICE, COORDINATOR, Principal("root", "admin")):
            with pytest.raises(NotAuthorized):
                guard.admit(who, op, {})
    guard.admit(COORDINATOR, "txn_markers", {})
    for who in (ALICE, BROKER0, Principal("root", "admin")):
        with pytest.raises(NotAuthorized):
            guard.admit(who, "txn_markers", {})
    with pytest.raises(NotAuthorized):
        guard.admit(ALICE, "txn_list", {})


def test_positions_need_the_groups_read_grant():
    c = cluster()
    c.access.acls.replace([Acl.parse(["alice", "allow", "read", "stream", "in", "literal"])])
    pid, epoch = init(c)
    join = {**owner(pid, epoch), "group": "g", "positions": [["in", 0, position(3)]]}
    with pytest.raises(NotAuthorized, match="read group 'g'"):
        c.handle("txn_add_positions", join, 0.0, ALICE)
    c.access.acls.add(Acl.parse(["alice", "allow", "read", "group", "g", "literal"]))
    c.handle("txn_add_positions", join, 0.0, ALICE)
    with pytest.raises(NotAuthorized, match="out"):          # and the streams' read grant
        c.handle("txn_add_positions", {**join, "positions": [["out", 0, position(3)]]}, 0.0,
                 ALICE)


# ---------------------------------------------------------------------- persistence

def mid_commit() -> tuple[Coordinator, tuple[int, int]]:
    """A commit decided, one of its two markers written."""
    c = cluster()
    pid, epoch = read_write(c)
    c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 1.0)
    c.transactions.marker_written(c.transactions.markers_due(1.0)[0], 1.0)
    return c, (pid, epoch)


def check_restored(c: Coordinator, pid: int, epoch: int) -> None:
    t = c.transactions.txns[TID]
    assert (t.state, t.producer_id, t.epoch, t.written) == (tx.PREPARE_COMMIT, pid, epoch,
                                                           {("out", 0)})
    assert committed(c, "g") == {("in", 0): position(42)}
    due = c.transactions.markers_due(100.0)     # the unwritten one is sent again
    assert [(m.part, m.commit) for m in due] == [(("out", 1), True)]
    assert c.transactions.marker_written(due[0], 100.0)
    assert c.transactions.txns[TID].state == tx.COMPLETE_COMMIT


def commit_like_the_server(s, c: Coordinator, saved: list) -> None:
    """CoordinatorServer._persist: the base state when groups, Kafka offsets, transactions
    or the version moved."""
    moved = (c.groups.take_dirty() | c.kafka_offsets.take_dirty()
             | c.transactions.take_dirty() or c.version != saved[0])
    saved[0] = c.version
    s.commit(c.base_state() if moved else None, c.replica_map.take_journal())


def test_a_restart_mid_commit_through_the_file_store(tmp_path):
    c = cluster()
    s = store.MetadataStore(tmp_path)
    c.replica_map.take_journal()
    s.snapshot(c.to_state())
    saved = [c.version]
    pid, epoch = read_write(c)
    commit_like_the_server(s, c, saved)
    c.handle("txn_end", {**owner(pid, epoch), "commit": True}, 1.0)
    c.transactions.marker_written(c.transactions.markers_due(1.0)[0], 1.0)
    commit_like_the_server(s, c, saved)      # only transactions and groups changed
    assert c.version == saved[0]
    s.close()
    restored = Coordinator(50.0, state=store.MetadataStore(tmp_path).load())
    check_restored(restored, pid, epoch)


def test_a_restart_mid_commit_through_etcd_keys():
    etcd = DictEtcd()
    c, (pid, epoch) = mid_commit()
    c.replica_map.take_journal()
    etcd.snapshot(c.to_state())
    assert any(k.startswith("transactions/") for k in etcd.kv)
    check_restored(Coordinator(50.0, state=etcd.load()), pid, epoch)


def test_every_prefix_of_a_split_commit_with_transactions_loads():
    c = cluster()
    etcd = DictEtcd(ops_max=2)
    c.replica_map.take_journal()
    etcd.snapshot(c.to_state())
    rng = random.Random(5)
    for step in range(40):
        tid = f"t{rng.randrange(4)}"
        pid, epoch = (c.handle("txn_init", {"transactional_id": tid}, step)[k]
                      for k in ("producer_id", "epoch"))
        c.handle("txn_add_parts", {"transactional_id": tid, "producer_id": pid, "epoch": epoch,
                                   "parts": [["out", rng.randrange(2)]]}, step)
        c.handle("txn_end", {"transactional_id": tid, "producer_id": pid, "epoch": epoch,
                             "commit": rng.random() < 0.5}, step)
        for marker in c.transactions.markers_due(step):
            c.transactions.marker_written(marker, step)
        etcd.commit(c.base_state(), c.replica_map.take_journal())
    for state in etcd.split_prefixes:
        Coordinator(1.0, state=state)
    assert etcd.load()["transactions"] == c.to_state()["transactions"]


def test_kera_acl_names_a_transactional_id():
    args = argparse.Namespace(stream=None, group=None, transactional_id="job-", cluster=False,
                              prefixed=True, deny=False, principal="alice",
                              operation=["write", "describe"])
    assert [e.to_list() for e in _entries(args)] == [
        ["alice", "allow", "write", "transactional_id", "job-", "prefixed"],
        ["alice", "allow", "describe", "transactional_id", "job-", "prefixed"]]
