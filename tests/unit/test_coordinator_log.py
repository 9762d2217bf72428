"""The coordinator's change log (kera.coordinator.store.MetadataStore): commits replay to the
state they described, a torn last record is ignored with a warning, damage is refused, and the
log folds into a snapshot when long."""

import json
import logging
import random

import pytest

from kera.coordinator import replica_map
from kera.coordinator import store
from kera.coordinator.core import Coordinator


def register(c: Coordinator, kind: str, port: int) -> int:
    return c.handle("register", {"kind": kind, "address": f"127.0.0.1:{port}", "node": "n"},
                    0.0)["daemon_id"]


def start(tmp_path, c: Coordinator):
    """A store holding `c` as a snapshot (the journal so far is in it)."""
    s = store.MetadataStore(tmp_path)
    c.replica_map.take_journal()
    s.snapshot(c.to_state())
    return s, [c.version]


def commit(s: store.MetadataStore, c: Coordinator, saved: list) -> int:
    """What CoordinatorServer._persist does: the base state when the version moved, and the
    replica journal."""
    moved = c.version != saved[0]
    saved[0] = c.version
    return s.commit(c.base_state() if moved else None, c.replica_map.take_journal())


def random_changes(c: Coordinator, rng: random.Random, steps: int, s, saved) -> list[dict]:
    """Apply `steps` random changes, committing after each; returns the state after each."""
    states = []
    for step in range(steps):
        what = rng.random()
        brokers = list(c.members["broker"])
        if what < 0.6 and brokers:
            entries = [[rng.randrange(3), rng.randrange(50), [rng.randrange(4)]]
                       for _ in range(rng.randrange(1, 20))]
            bid = rng.choice(brokers)
            c.handle("heartbeat", {"kind": "broker", "daemon_id": bid, "metadata_version": 0,
                                   "token": c.members["broker"][bid].token, "vsegs": entries},
                     0.0)
        elif what < 0.75:
            c.handle("create_stream", {"name": f"s{step}", "streamlets": rng.randrange(1, 5)}, 0.0)
        elif what < 0.85 and c.streams:
            c.handle("delete_stream", {"name": rng.choice(sorted(c.streams))}, 0.0)
        else:
            register(c, "broker", 7100 + rng.randrange(3))   # a restart clears its replicas
        commit(s, c, saved)
        states.append(c.to_state())
    return states


def test_commits_replay_to_the_committed_state(tmp_path):
    rng = random.Random(7)
    c = Coordinator(0.0)
    for i in range(3):
        register(c, "broker", 7100 + i)
    register(c, "backup", 7200)
    s, saved = start(tmp_path, c)
    states = random_changes(c, rng, 300, s, saved)
    assert store.MetadataStore(tmp_path).load() == states[-1]
    restored = Coordinator(1.0, state=store.load(tmp_path))
    assert restored.replica_map.entries() == c.replica_map.entries()
    assert restored.list_streams()  # and it starts


def test_replayed_eviction_forgets_the_same_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(replica_map, "REPLICA_ENTRIES_PER_BROKER_MAX", 10)
    c = Coordinator(0.0)
    register(c, "broker", 7100)
    s, saved = start(tmp_path, c)
    for n in range(5):
        c.replica_map.report(0, [[0, n * 7 + k, [1]] for k in range(7)])
        c.replica_map.report(0, [[0, 3, [2]]])   # moved to the newest end again
        commit(s, c, saved)
    assert store.load(tmp_path)["replicas"] == c.to_state()["replicas"]
    assert len(c.replica_map.tables[0]) == 10


def test_a_heartbeat_commit_is_a_small_record(tmp_path):
    c = Coordinator(0.0)
    register(c, "broker", 7100)
    c.replica_map.report(0, [[0, n, [0, 1]] for n in range(60_000)])
    s, saved = start(tmp_path, c)
    c.handle("heartbeat", {"kind": "broker", "daemon_id": 0, "metadata_version": c.version,
                           "token": c.members["broker"][0].token,
                           "vsegs": [[0, 60_001, [1, 2]]]}, 0.0)
    assert commit(s, c, saved) < 100   # not a rewrite of the 60,000 entries


def test_torn_last_record_is_ignored_with_a_warning(tmp_path, caplog):
    rng = random.Random(3)
    c = Coordinator(0.0)
    for i in range(2):
        register(c, "broker", 7100 + i)
    s, saved = start(tmp_path, c)
    states = random_changes(c, rng, 20, s, saved)
    path = tmp_path / store.log_name(s.generation)
    full = path.read_bytes()
    for cut in range(1, 30):   # every way of tearing the last record
        path.write_bytes(full[:-cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            state = store.load(tmp_path)
        assert state == states[-2], cut
        assert "torn last record" in caplog.text
        assert path.stat().st_size < len(full) - cut   # the torn bytes are cut off
    # A last record with whole length but garbage bytes is torn too.
    path.write_bytes(full[:-3] + b"\x00\x00\x00")
    assert store.load(tmp_path) == states[-2]


def test_a_damaged_record_before_intact_ones_is_refused(tmp_path):
    c = Coordinator(0.0)
    register(c, "broker", 7100)
    s, saved = start(tmp_path, c)
    random_changes(c, random.Random(5), 10, s, saved)
    path = tmp_path / store.log_name(s.generation)
    data = bytearray(path.read_bytes())
    data[12] ^= 0x01          # inside the first record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        store.load(tmp_path)


def test_long_log_folds_into_a_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "SNAPSHOT_LOG_BYTES", 500)
    c = Coordinator(0.0)
    register(c, "broker", 7100)
    s, saved = start(tmp_path, c)
    for n in range(100):
        c.replica_map.report(0, [[0, n, [1]]])
        commit(s, c, saved)
        if s.wants_snapshot():
            s.snapshot(c.to_state())
    assert s.generation > 2
    logs = sorted(p.name for p in tmp_path.glob("*.log"))
    assert logs == [store.log_name(s.generation)]           # old logs removed
    assert store.load(tmp_path) == c.to_state()


def test_crash_between_new_log_and_snapshot_keeps_the_old_pair(tmp_path):
    c = Coordinator(0.0)
    register(c, "broker", 7100)
    s, saved = start(tmp_path, c)
    c.replica_map.report(0, [[0, 1, [1]]])
    commit(s, c, saved)
    # The next snapshot's empty log exists, its snapshot was never written.
    (tmp_path / store.log_name(s.generation + 1)).write_bytes(b"")
    assert store.load(tmp_path) == c.to_state()
    again = store.MetadataStore(tmp_path)
    again.load()
    again.snapshot(c.to_state())          # a restart folds and removes the stray log
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [store.log_name(again.generation)]
    assert store.load(tmp_path) == c.to_state()


def _fill_then_switch(tmp_path, monkeypatch, write: bool):
    c = Coordinator(0.0)
    register(c, "broker", 7100)
    s, saved = start(tmp_path, c)
    if not write:   # the coordinator dies before the snapshot thread writes anything
        monkeypatch.setattr(store.MetadataStore, "_write_snapshot", lambda self, *a: None)
    for n in range(50):
        c.replica_map.report(0, [[0, n, [1]]])
        commit(s, c, saved)
    s.start_snapshot(c.base_state(), {b: dict(t) for b, t in c.replica_map.tables.items()})
    for n in range(50, 80):     # appended to the new log while the snapshot is written
        c.replica_map.report(0, [[0, n, [2]]])
        commit(s, c, saved)
    s.close_writer()
    return c, s


def test_snapshot_off_the_loop_then_more_commits(tmp_path, monkeypatch):
    c, s = _fill_then_switch(tmp_path, monkeypatch, write=True)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [store.log_name(s.generation)]
    assert store.load(tmp_path) == c.to_state()


def test_crash_before_the_background_snapshot_is_written_loses_nothing(tmp_path, monkeypatch):
    c, s = _fill_then_switch(tmp_path, monkeypatch, write=False)
    # The old snapshot and both logs: replayed one after the other.
    assert len(list(tmp_path.glob("*.log"))) == 2
    assert store.load(tmp_path) == c.to_state()


def test_a_snapshot_encoded_in_steps_is_the_state_encoded_at_once(monkeypatch):
    """The off-loop snapshot encodes the replica map in bounded steps; what it writes loads
    as the one-call encoding does."""
    monkeypatch.setattr(store, "SNAPSHOT_ENCODE_ENTRIES", 7)
    rng = random.Random(5)
    tables = {bid: {(rng.randrange(4), v): sorted(rng.sample(range(9), 2)) for v in range(n)}
              for bid, n in ((0, 30), (1, 7), (2, 0), (3, 1))}
    base = {"version": 9, "streams": {"s": {"id": 1}}, "log_generation": 4}
    whole = {**base, "replicas": {str(bid): [[vl, vs, b] for (vl, vs), b in t.items()]
                                  for bid, t in tables.items() if t}}
    assert json.loads(store.encode_snapshot(base, tables)) == whole
    assert json.loads(store.encode_snapshot({}, {})) == {"replicas": {}}
