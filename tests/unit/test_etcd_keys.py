"""The coordinator's state as etcd keys (kera.coordinator.etcd_keys), on a dict standing in for
etcd: commits load back to the committed state, every prefix of a split commit is a state a
coordinator loads, batches respect etcd's bounds, and the replica order survives."""

import random

import pytest

from kera.coordinator import etcd_keys
from kera.coordinator.core import Coordinator
from kera.errors import StorageError
from tests.unit.test_coordinator_log import random_changes, register


class DictEtcd:
    """The store's write path on a dict: {key: (value, mod revision)}, one revision per batch.
    `prefixes` records the state after every batch of a split commit."""

    def __init__(self, ops_max: int = etcd_keys.TXN_OPS_MAX):
        self.kv: dict[str, tuple[str, int]] = {}
        self.revision = 1
        self.ops_max = ops_max
        self.stored: dict[str, str] = {}
        self.split_prefixes: list[dict] = []
        self.seq = etcd_keys.ReplicaSeq()

    def snapshot(self, state: dict) -> None:
        self._write(etcd_keys.snapshot_writes(self.stored, state, self.seq))

    def commit(self, base, replica_changes) -> int:
        return self._write(etcd_keys.plan(self.stored, base, replica_changes, self.seq))

    def _write(self, writes: dict) -> int:
        parts = etcd_keys.batches(writes, ops_max=self.ops_max)
        for batch in parts:
            self.revision += 1
            for key, value in batch:
                if value is None:
                    self.kv.pop(key, None)
                else:
                    self.kv[key] = (value, self.revision)
            etcd_keys.apply(self.stored, dict(batch))
            if len(parts) > 1:
                self.split_prefixes.append(self.load())
        return len(writes)

    def load(self) -> dict | None:
        return etcd_keys.load_state([(k, v) for k, (v, _) in sorted(self.kv.items())])[0]


def start(c: Coordinator, etcd: DictEtcd) -> list:
    c.replica_map.take_journal()
    etcd.snapshot(c.to_state())
    return [c.version]


def cluster() -> Coordinator:
    c = Coordinator(0.0)
    for i in range(3):
        register(c, "broker", 7100 + i)
    register(c, "backup", 7200)
    return c


def test_commits_load_back_to_the_committed_state():
    c, etcd = cluster(), DictEtcd()
    saved = start(c, etcd)
    states = random_changes(c, random.Random(7), 300, etcd, saved)
    assert etcd.load() == states[-1]
    restored = Coordinator(1.0, state=etcd.load())
    assert restored.replica_map.entries() == c.replica_map.entries()


def test_every_prefix_of_a_split_commit_loads():
    """Tiny transactions force every commit into many batches: each batch boundary (where a
    crash could stop the commit) leaves a state a coordinator starts from."""
    c, etcd = cluster(), DictEtcd(ops_max=2)
    saved = start(c, etcd)
    states = random_changes(c, random.Random(11), 120, etcd, saved)
    assert len(etcd.split_prefixes) > 100
    for state in etcd.split_prefixes:
        Coordinator(1.0, state=state)     # raises ValueError on an inconsistent state
    assert etcd.load() == states[-1]


def test_replica_entries_keep_their_age_order():
    """The oldest entry is the one eviction forgets: a re-reported entry moves last, and a
    load puts it last again."""
    c, etcd = cluster(), DictEtcd()
    saved = start(c, etcd)
    for entries in ([[0, 5, [3]], [0, 1, [3]]], [[0, 2, [3]]], [[0, 5, [3]]]):
        c.replica_map.report(0, entries)
        etcd.commit(None, c.replica_map.take_journal())
    assert list(Coordinator(1.0, state=etcd.load()).replica_map.tables[0]) == [(0, 1), (0, 2), (0, 5)]
    assert saved == [c.version]


def test_a_commit_writes_only_what_changed():
    c, etcd = cluster(), DictEtcd()
    start(c, etcd)
    c.handle("create_stream", {"name": "s", "streamlets": 2}, 0.0)
    writes = etcd_keys.plan(etcd.stored, c.base_state(), [], etcd.seq)
    assert set(writes) == {"streams/s", "meta/metadata_version", "meta/next_stream_id",
                           "meta/rotation"}
    assert etcd_keys.snapshot_writes(etcd.stored, c.to_state(), etcd.seq) == writes


def test_forgetting_a_broker_deletes_its_replicas_before_its_member():
    c, etcd = cluster(), DictEtcd()
    start(c, etcd)
    c.replica_map.report(2, [[0, v, [3]] for v in range(5)])
    etcd.commit(None, c.replica_map.take_journal())
    c.replica_map.forget(2)
    writes = etcd_keys.plan(etcd.stored, None, c.replica_map.take_journal(), etcd.seq)
    writes["members/broker/2"] = None
    order = [k for batch in etcd_keys.batches(writes) for k, _ in batch]
    assert order[-1] == "members/broker/2"
    assert sorted(order[:-1]) == [f"replicas/2/0/{v}" for v in range(5)]


def test_batches_respect_the_operation_and_byte_bounds():
    writes = {f"streams/s{i}": "x" * 1000 for i in range(300)}
    parts = etcd_keys.batches(writes, ops_max=128, bytes_max=100_000)
    assert all(len(p) <= 128 for p in parts)
    assert all(sum(etcd_keys.OP_OVERHEAD_BYTES + len(k) + len(v) for k, v in p) <= 100_000
               for p in parts)
    assert sorted(k for p in parts for k, _ in p) == sorted(writes)


def test_an_entry_too_large_for_etcd_is_refused_with_advice():
    with pytest.raises(StorageError, match="max-request-bytes"):
        etcd_keys.batches({"meta/acls": "x" * 200}, bytes_max=100)


def test_no_format_key_is_a_first_start():
    assert etcd_keys.load_state([("fence", "x")]) == (None, 0)


def test_a_snapshot_of_the_stored_state_writes_nothing():
    c, etcd = cluster(), DictEtcd()
    saved = start(c, etcd)
    random_changes(c, random.Random(3), 50, etcd, saved)
    assert etcd_keys.snapshot_writes(etcd.stored, c.to_state(), etcd.seq) == {}
    c.replica_map.report(1, [[0, 0, [3]]])        # an entry moves last: the map is written again
    c.replica_map.take_journal()
    etcd.snapshot(c.to_state())
    assert etcd.load() == c.to_state()
