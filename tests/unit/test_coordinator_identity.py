"""The coordinator core's identity rules, driven with an injected clock and token source:
incarnation tokens, epochs of its own, tombstones, the cluster id and stream-id marks."""

import itertools

import pytest

from kera.coordinator import recovery
from kera.coordinator.core import TOMBSTONES_MAX, Coordinator
from kera.errors import BadRequest, IdInUse, NotReady, WrongCluster

INTERVAL_S = 0.1
MISSED = 20
DEAD_AFTER_S = INTERVAL_S * MISSED


def make(now=0.0, state=None) -> Coordinator:
    counter = itertools.count(1)
    return Coordinator(now, heartbeat_interval_s=INTERVAL_S, heartbeat_missed_max=MISSED,
                       state=state, token_source=lambda: f"{next(counter):032x}")


def register(c, kind="broker", i=0, now=0.0, port=None, **fields) -> dict:
    return c.handle("register", {"kind": kind, "address": f"127.0.0.1:{port or 9000 + i}",
                                 "node": "n", "daemon_id": i, **fields}, now)


def beat(c, token, kind="broker", i=0, now=0.1, version=0, **fields) -> dict:
    return c.handle("heartbeat", {"kind": kind, "daemon_id": i, "metadata_version": version,
                                  "token": token, **fields}, now)


def test_register_issues_a_distinct_token_per_incarnation_and_heartbeats_need_it():
    c = make()
    first = register(c)["token"]
    beat(c, first)
    with pytest.raises(IdInUse, match="another incarnation"):
        beat(c, "f" * 32)
    with pytest.raises(IdInUse):
        c.handle("heartbeat", {"kind": "broker", "daemon_id": 0, "metadata_version": 0}, 0.2)
    second = register(c, now=0.3, token=first)["token"]     # a restart presenting its token
    assert second != first
    with pytest.raises(IdInUse):
        beat(c, first, now=0.4)                              # the old incarnation is over
    beat(c, second, now=0.4)


@pytest.mark.parametrize("kind", ["broker", "backup"])
def test_a_live_id_is_refused_to_a_second_process_and_the_holder_is_undisturbed(kind, caplog):
    c = make()
    token = register(c, kind)["token"]
    c.handle("create_stream", {"name": "s", "replication": 1}, 0.0) if kind == "broker" else None
    before = (c.version, c.to_state())
    for now in (0.5, DEAD_AFTER_S):                          # heard from within the dead window
        with pytest.raises(IdInUse) as refused:
            register(c, kind, now=now, port=9999, stream_id_mark=1000)
        assert not refused.value.retriable
        msg = refused.value.message
        assert f"{kind} id 0 is in use by a live {kind} at 127.0.0.1:9000" in msg
        assert "another --id" in msg and "stop the other process" in msg
    assert (c.version, c.to_state()) == before
    assert "127.0.0.1:9000" in caplog.text and "127.0.0.1:9999" in caplog.text
    beat(c, token, kind, now=1.0)                            # the holder goes on


def test_refusals_that_repeat_log_one_warning_a_minute_not_one_each(caplog):
    # A second process left running with a taken --id retries its register, and a stale
    # incarnation keeps beating with its old token: each is refused every time, but its
    # warning is logged once, then at most once a minute with the count left out.
    c = make()
    token = register(c)["token"]
    caplog.set_level("WARNING", logger="kera.coordinator.core")
    for i in range(50):
        now = 0.1 + i * 0.01
        beat(c, token, now=now)                             # the holder stays live
        with pytest.raises(IdInUse):
            register(c, now=now, port=9999)
        with pytest.raises(IdInUse):
            beat(c, "f" * 32, now=now)
    claims = [r.getMessage() for r in caplog.records if "refused it to a second" in r.getMessage()]
    stale = [r.getMessage() for r in caplog.records if "without the token" in r.getMessage()]
    assert len(claims) == 1 and len(stale) == 1
    caplog.clear()
    for now in (DEAD_AFTER_S - 0.5, 61.0):
        beat(c, token, now=now)                             # the holder stays live
        with pytest.raises(IdInUse):
            register(c, now=now, port=9999)
    claims = [r.getMessage() for r in caplog.records if "refused it to a second" in r.getMessage()]
    assert len(claims) == 1 and "50 more like it in the last 60 s not logged" in claims[0]


def test_a_restarted_coordinator_reports_each_members_last_registration():
    # Found by the simulation (seed 1981 with produce runs): a backup restarted and registered
    # while a broker was cut off from the coordinator; the coordinator then restarted and, not
    # keeping the version, reported 0 ("unknown"). The broker never learned that the backup's
    # in-memory replicas were gone, and a finished virtual segment stayed on one backup.
    c = make()
    register(c, "backup", 0)
    register(c, "backup", 1)
    register(c, "backup", 0, now=DEAD_AFTER_S + 1.0)        # backup 0 restarted
    versions = {m["id"]: m["registered_version"] for m in c.cluster()["backups"]}
    assert versions[0] > versions[1] > 0
    r = make(now=100.0, state=c.to_state())
    assert {m["id"]: m["registered_version"] for m in r.cluster()["backups"]} == versions
    old = c.to_state()                                      # a file from before it was kept
    for m in old["members"]["backup"]:
        del m["registered_version"]
    assert {m["registered_version"] for m in make(now=100.0, state=old).cluster()["backups"]} == {0}
    old["members"]["backup"][0]["registered_version"] = old["metadata_version"] + 1
    with pytest.raises(ValueError, match="newer than the metadata version"):
        make(now=100.0, state=old)


def test_a_dead_id_may_be_reclaimed_without_its_token():
    c = make()
    register(c)
    token = register(c, now=DEAD_AFTER_S + 0.5, port=9999)["token"]   # ordinary restart
    assert c.members["broker"][0].address == "127.0.0.1:9999"
    beat(c, token, now=DEAD_AFTER_S + 0.6)


def test_the_holders_own_address_may_register_again_without_the_token():
    # No second process can bind a live daemon's address: a register from it is the holder's
    # retry after a lost reply, or its restart on the same host and port without a data dir.
    c = make()
    first = register(c)["token"]
    again = register(c, now=0.2)["token"]
    assert again != first
    beat(c, again, now=0.3)
    with pytest.raises(IdInUse):
        register(c, now=0.4, token=first, port=9999)       # the old token is over


def test_tokens_survive_a_coordinator_restart_but_only_their_hash_is_stored():
    c = make()
    token = register(c)["token"]
    state = c.to_state()
    assert token not in str(state)
    r = make(now=100.0, state=state)
    with pytest.raises(IdInUse):                            # the holder may still be running
        register(r, now=100.1, port=9999)
    beat(r, token, now=100.1)
    with pytest.raises(IdInUse):
        beat(r, "0" * 32, now=100.2)


def test_a_version_or_epoch_never_issued_is_refused_and_changes_nothing():
    c = make()
    token = register(c)["token"]
    before = (c.version, c.to_state())
    with pytest.raises(BadRequest, match="never issued"):
        beat(c, token, version=2**62)
    epoch = c.failover.epochs[0]
    with pytest.raises(BadRequest, match="never issued"):
        beat(c, token, epoch=epoch + 1)
    with pytest.raises(BadRequest):
        beat(c, token, epoch=2**40)
    assert (c.version, c.to_state()) == before
    beat(c, token, version=c.version, epoch=epoch)


def test_epochs_are_their_own_counter_persisted_and_bounded(monkeypatch):
    c = make()
    for i in range(3):
        register(c, i=i)
    c.handle("create_stream", {"name": "s", "streamlets": 3}, 0.0)
    assert [c.failover.epochs[i] for i in range(3)] == [1, 2, 3]   # not metadata versions
    r = make(state=c.to_state())
    assert r.failover.next_epoch == 4
    monkeypatch.setattr(recovery, "EPOCH_MAX", 4)
    register(r, i=3, now=1.0)
    before = r.to_state()
    with pytest.raises(NotReady, match="epochs"):
        register(r, i=4, now=1.0)
    assert r.to_state() == before


def test_deletion_leaves_a_bounded_persisted_tombstone_in_broker_streams(monkeypatch):
    c = make()
    register(c)
    kept = c.handle("create_stream", {"name": "kept", "replication": 1}, 0.0)["stream"]
    gone = c.handle("create_stream", {"name": "gone", "replication": 1}, 0.0)["stream"]
    c.handle("delete_stream", {"name": "gone"}, 0.0)
    reply = c.handle("broker_streams", {"broker_id": 0}, 0.0)
    assert [s["id"] for s in reply["streams"]] == [kept["id"]]
    assert reply["deleted"] == [[gone["id"], c.version]]
    r = make(state=c.to_state())
    assert r.handle("broker_streams", {"broker_id": 0}, 0.0)["deleted"] == reply["deleted"]
    monkeypatch.setattr("kera.coordinator.core.TOMBSTONES_MAX", 2)
    for name in ("a", "b"):
        c.handle("create_stream", {"name": name, "replication": 1}, 0.0)
        c.handle("delete_stream", {"name": name}, 0.0)
    deleted = [sid for sid, _ in c.handle("broker_streams", {"broker_id": 0}, 0.0)["deleted"]]
    assert deleted == [gone["id"] + 1, gone["id"] + 2]                  # the oldest forgotten
    assert TOMBSTONES_MAX >= 1000


def test_a_fresh_coordinator_halts_on_a_daemon_of_a_cluster():
    c = make()
    before = c.to_state()
    with pytest.raises(NotReady):
        register(c, cluster_id="c" * 32, stream_id_mark=7)
    assert c.halted is not None
    assert "metadata directory is empty or wrong" in c.halted and "c" * 32 in c.halted
    assert "restore DIR/coordinator.json" in c.halted and "127.0.0.1:9000" in c.halted
    assert c.to_state() == before                          # nothing admitted, nothing issued


def test_a_coordinator_with_state_refuses_a_daemon_of_another_cluster():
    c = make()
    reply = register(c)
    assert reply["cluster_id"] == c.cluster_id
    register(c, i=1, cluster_id=c.cluster_id)             # of this cluster: fine
    for other in ("d" * 32, "\u00e9t\u00e9"):                   # any text, non-ASCII too
        with pytest.raises(WrongCluster, match="runs cluster"):
            register(c, i=2, cluster_id=other)
    with pytest.raises(IdInUse):
        beat(c, "\u00e9" * 10, i=1)
    assert c.halted is None and 2 not in c.members["broker"]
    assert make(state=c.to_state()).cluster_id == c.cluster_id      # persisted


def test_stream_ids_move_above_a_reported_mark():
    c = make()
    register(c, stream_id_mark=41)
    assert c.handle("create_stream", {"name": "s", "replication": 1}, 0.0)["stream"]["id"] == 42
    register(c, i=1, stream_id_mark=5)                     # below: no effect
    assert c.handle("create_stream", {"name": "t", "replication": 1}, 0.0)["stream"]["id"] == 43
    with pytest.raises(BadRequest):
        register(c, i=2, stream_id_mark=2**60)             # beyond any real cluster's ids
    token = register(c, i=3)["token"]
    version = c.version
    beat(c, token, i=3, stream_id_mark=99)                 # also reported in heartbeats
    assert c.version == version + 1 and make(state=c.to_state()).next_stream_id == 100


def test_recovered_needs_the_token():
    c = make()
    token = register(c)["token"]
    fields = {"broker_id": 0, "epoch": c.failover.epochs[0], "streamlets": []}
    with pytest.raises(IdInUse):
        c.handle("recovered", fields, 0.1)
    assert c.handle("recovered", {**fields, "token": token}, 0.1) == {"cleared": 0}
