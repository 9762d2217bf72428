"""Broker failover in the coordinator (kera.coordinator.recovery), driven with an injected
clock: incarnations, reassignment spread over live brokers, recovery markers and their
sources, zombie incarnations refused, persistence, and the release of dead replicas."""

import pytest

from kera.coordinator.core import Coordinator
from kera.errors import BadRequest, NotReady

INTERVAL_S = 0.1
MISSED = 20
TOKEN = "0123456789abcdef0123456789abcdef"   # every incarnation's token (a fixed source)
DEAD_S = INTERVAL_S * MISSED


def make(now=0.0, **kw):
    kw.setdefault("token_source", lambda: TOKEN)
    return Coordinator(now, heartbeat_interval_s=INTERVAL_S, heartbeat_missed_max=MISSED, **kw)


def register(c, kind, i, now=0.0):
    return c.handle("register", {"kind": kind, "address": f"127.0.0.1:{9000 + i}",
                                 "node": f"{kind}-{i}", "daemon_id": i, "token": TOKEN},
                    now)["daemon_id"]


def beat(c, kind, i, now, **fields):
    return c.handle("heartbeat", {"token": TOKEN, "kind": kind, "daemon_id": i, "metadata_version": 0, **fields}, now)


def cluster(brokers=3, backups=2):
    c = make()
    for i in range(brokers):
        register(c, "broker", i)
    for i in range(backups):
        register(c, "backup", i)
    return c


def epoch(c, b):
    return c.handle("broker_streams", {"broker_id": b}, 0.0)["epoch"]


def recovering(c, name):
    return c.describe_stream(name).get("recovering", [])


def test_dead_broker_streamlets_spread_over_live_brokers_marked_recovering():
    c = cluster(brokers=3)
    c.handle("create_stream", {"name": "s", "streamlets": 6, "replication": 3}, 0.0)
    assert c.describe_stream("s")["placement"] == [0, 1, 2, 0, 1, 2]
    e0 = epoch(c, 0)
    for t in (1.0, 2.0, 2.5):
        beat(c, "broker", 1, t)
        beat(c, "broker", 2, t)
    dead = c.tick(DEAD_S + 0.5)
    assert [m.id for m in dead if m.kind == "broker"] == [0]
    d = c.describe_stream("s")
    assert d["placement"] == [1, 1, 2, 2, 1, 2]   # both others take a share
    assert d["recovering"] == [[0, [[0, e0]]], [3, [[0, e0]]]]
    assert d["version"] == c.version and "0" not in d["brokers"]
    # Brokers learn it from broker_streams (with their own epoch).
    reply = c.handle("broker_streams", {"broker_id": 1}, 3.0)
    assert reply["epoch"] == epoch(c, 1) and reply["streams"][0]["recovering"]
    # Only the new owner, as its current incarnation, clears a marker.
    with pytest.raises(NotReady):
        c.handle("recovered", {"token": TOKEN, "broker_id": 1, "epoch": e0, "streamlets": [[1, 0]]}, 3.0)
    v = c.version
    out = c.handle("recovered", {"token": TOKEN, "broker_id": 2, "epoch": epoch(c, 2), "streamlets": [[1, 0], [1, 3]]}, 3.0)
    assert out == {"cleared": 1} and c.version == v + 1
    assert recovering(c, "s") == [[0, [[0, e0]]]]
    c.handle("recovered", {"token": TOKEN, "broker_id": 1, "epoch": epoch(c, 1), "streamlets": [[1, 0]]}, 3.0)
    assert recovering(c, "s") == []
    with pytest.raises(BadRequest):
        c.handle("recovered", {"token": TOKEN, "broker_id": 1, "epoch": 1, "streamlets": [[1]]}, 3.0)


def test_owner_dying_while_recovering_keeps_the_sources_and_adds_its_own():
    c = cluster(brokers=3)
    c.handle("create_stream", {"name": "s", "streamlets": 1, "replication": 2}, 0.0)
    e0, e1 = epoch(c, 0), epoch(c, 1)
    beat(c, "broker", 1, 1.5)
    beat(c, "broker", 2, 1.5)
    c.tick(2.1)                                  # broker 0 dies: streamlet 0 -> broker 1
    assert c.describe_stream("s")["placement"] == [1]
    beat(c, "broker", 2, 3.5)
    c.tick(3.7)                                  # broker 1 dies before it recovered
    d = c.describe_stream("s")
    assert d["placement"] == [2] and d["recovering"] == [[0, [[0, e0], [1, e1]]]]


def test_heartbeat_of_a_failed_over_incarnation_is_refused_until_it_registers_again():
    c = cluster(brokers=2)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 2}, 0.0)
    e0 = epoch(c, 0)
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)
    with pytest.raises(NotReady, match="register again"):
        beat(c, "broker", 0, 2.2)
    assert not c.members["broker"][0].alive
    register(c, "broker", 0, 2.3)                # comes back as a new, empty incarnation
    assert epoch(c, 0) > e0
    beat(c, "broker", 0, 2.4, epoch=epoch(c, 0))
    with pytest.raises(NotReady):                # a stale process of the old one
        beat(c, "broker", 0, 2.5, epoch=e0)
    assert c.describe_stream("s")["placement"] == [1, 1]


def test_dead_broker_without_streamlets_just_comes_back():
    c = cluster(brokers=2)
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)
    v = c.version
    beat(c, "broker", 0, 2.2)
    assert c.members["broker"][0].alive and c.version == v + 1


def test_restarted_broker_is_failed_over_at_once_even_back_onto_itself():
    c = cluster(brokers=1, backups=2)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 3}, 0.0)
    e0 = epoch(c, 0)
    register(c, "broker", 0, 0.5)                # restarted before anyone noticed it died
    d = c.describe_stream("s")
    assert d["placement"] == [0, 0]              # the only live broker: itself, recovering
    assert d["recovering"] == [[0, [[0, e0]]], [1, [[0, e0]]]]
    status = c.handle("recovery_status", {}, 0.5)
    assert status["failed"] == [[0, e0]] and status["failovers"] == 1


def test_streamlets_wait_for_a_live_broker_then_move():
    c = cluster(brokers=1, backups=1)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 2}, 0.0)
    e0 = epoch(c, 0)
    c.tick(2.1)                                  # the only broker dies
    d = c.describe_stream("s")
    assert d["placement"] == [0, 0] and len(d["recovering"]) == 2
    register(c, "broker", 5, 3.0)                # a new broker joins: it takes them
    d = c.describe_stream("s")
    assert d["placement"] == [5, 5] and d["recovering"][0] == [0, [[0, e0]]]


def broker_0_failed_over():
    """Two brokers, a stream of 2 streamlets at R=2; broker 0 dies and broker 1 takes its
    streamlet (recovering). Returns (coordinator, epoch of broker 0, epoch of broker 1)."""
    c = cluster(brokers=2)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 2}, 0.0)
    e0, e1 = epoch(c, 0), epoch(c, 1)
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)
    assert c.describe_stream("s")["placement"] == [1, 1]
    return c, e0, e1


def test_coordinator_restart_keeps_markers_and_fails_over_brokers_that_never_return():
    c, e0, e1 = broker_0_failed_over()
    state = c.to_state()
    r = make(now=100.0, state=state)
    assert recovering(r, "s") == [[0, [[0, e0]]]]
    assert r.handle("broker_streams", {"broker_id": 1}, 100.0)["epoch"] == e1
    # Broker 1 died while the coordinator was down: failed over after the grace.
    r.tick(100.0 + DEAD_S)
    assert r.describe_stream("s")["placement"] == [1, 1]
    r.tick(100.0 + 2 * DEAD_S + 0.1)
    assert r.handle("recovery_status", {}, 0.0)["failed"] == [[0, e0], [1, e1]]
    assert recovering(r, "s") == [[0, [[0, e0], [1, e1]]], [1, [[1, e1]]]]
    with pytest.raises(ValueError):
        make(state=dict(state, recovery={"epochs": [["x", 1]], "failed": [], "recovering": []}))


def test_a_restarted_coordinator_leaves_a_recovering_streamlet_with_an_owner_not_heard_from_yet():
    # Seed 1857: broker 1 took broker 0's streamlet and appended to it; the coordinator
    # restarted; broker 0 registered again before broker 1's first heartbeat, and got the
    # streamlet with broker 0's replicas as its only source: broker 1's appends were lost.
    c, e0, e1 = broker_0_failed_over()
    r = make(now=100.0, state=c.to_state())
    register(r, "broker", 0, 100.1)
    assert r.describe_stream("s")["placement"] == [1, 1]
    assert recovering(r, "s") == [[0, [[0, e0]]]]
    # Broker 1 never returns: after the grace it is failed over, named as a source.
    beat(r, "broker", 0, 100.0 + 2 * DEAD_S)
    r.tick(100.0 + 2 * DEAD_S + 0.1)
    assert r.describe_stream("s")["placement"] == [0, 0]
    assert recovering(r, "s") == [[0, [[0, e0], [1, e1]]], [1, [[1, e1]]]]


def test_backups_free_replicas_of_finished_incarnations_only():
    c = cluster(brokers=2, backups=1)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 2}, 0.0)
    e0, e1 = epoch(c, 0), epoch(c, 1)
    held = [[0, e0, 3, 300], [1, e1, 2, 200], [7, 1, 1, 10]]
    assert "free" not in beat(c, "backup", 0, 0.5, held=held)   # all live or unknown
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)                                  # broker 0 dead, its streamlet recovering
    assert "free" not in beat(c, "backup", 0, 2.2, held=held)
    c.handle("recovered", {"token": TOKEN, "broker_id": 1, "epoch": e1, "streamlets": [[1, 0]]}, 2.3)
    assert beat(c, "backup", 0, 2.4, held=held)["free"] == [[0, e0]]
    status = c.handle("recovery_status", {}, 2.4)
    assert status["holders"] == [[0, b, e, n, size] for b, e, n, size in sorted(held)]
    with pytest.raises(BadRequest):
        beat(c, "backup", 0, 2.5, held=[[0, 1]])


def test_deleting_a_recovering_stream_drops_its_markers():
    c = cluster(brokers=2)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 2}, 0.0)
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)
    assert c.handle("recovery_status", {}, 2.1)["recovering"]
    c.handle("delete_stream", {"name": "s"}, 2.2)
    assert c.handle("recovery_status", {}, 2.2)["recovering"] == []


def test_r1_streamlets_stay_with_their_broker_and_do_not_fail_it_over():
    c = cluster(brokers=2)
    c.handle("create_stream", {"name": "one", "streamlets": 2, "replication": 1}, 0.0)
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)
    assert c.describe_stream("one")["placement"] == [0, 1]   # no replica to recover from
    assert c.handle("recovery_status", {}, 2.1)["failed"] == []
    beat(c, "broker", 0, 2.2)                                   # it was only slow: welcome back
    assert c.members["broker"][0].alive


def test_cluster_view_is_settled_once_every_daemon_could_have_heartbeated():
    c = make(now=10.0)
    assert c.handle("cluster", {}, 10.5)["settled"] is False
    assert c.handle("cluster", {}, 10.0 + DEAD_S + 0.1)["settled"] is True


def test_cut_off_broker_nobody_took_over_comes_back_with_its_streamlets():
    c = cluster(brokers=1, backups=2)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 3}, 0.0)
    e0 = epoch(c, 0)
    beat(c, "backup", 0, 1.5)                    # the backups are heard: only the broker is cut off
    beat(c, "backup", 1, 1.5)
    c.tick(2.1)                                  # cut off: failed over, but no live broker
    assert len(recovering(c, "s")) == 2
    v = c.version
    beat(c, "broker", 0, 2.5, epoch=e0)          # the same process is back
    assert c.members["broker"][0].alive and c.version > v
    assert recovering(c, "s") == [] and c.describe_stream("s")["placement"] == [0, 0]
    assert c.handle("recovery_status", {}, 2.5)["failed"] == []


def test_cut_off_broker_whose_streamlets_were_taken_must_come_back_empty():
    c = cluster(brokers=2, backups=1)
    c.handle("create_stream", {"name": "s", "streamlets": 2, "replication": 2}, 0.0)
    e0 = epoch(c, 0)
    beat(c, "broker", 1, 1.5)
    c.tick(2.1)
    c.handle("recovered", {"token": TOKEN, "broker_id": 1, "epoch": epoch(c, 1), "streamlets": [[1, 0]]}, 2.2)
    assert recovering(c, "s") == []
    with pytest.raises(NotReady):
        beat(c, "broker", 0, 2.5, epoch=e0)


def test_fence_tokens_go_to_the_recovering_brokers_and_the_key_to_backups():
    from kera.net.fence import fence_token
    c = cluster(brokers=3)
    c.handle("create_stream", {"name": "s", "streamlets": 3, "replication": 2}, 0.0)
    e0 = epoch(c, 0)
    assert "fence_tokens" not in c.handle("broker_streams", {"broker_id": 1}, 0.0)
    for t in (1.0, 2.0, 2.5):
        beat(c, "broker", 1, t)
        beat(c, "broker", 2, t)
    c.tick(DEAD_S + 0.5)
    owners = c.describe_stream("s")["placement"]
    recoverer = owners[0]
    reply = c.handle("broker_streams", {"broker_id": recoverer}, 3.0)
    assert reply["fence_tokens"] == [[0, e0, fence_token(c.fence_key, 0, e0)]]
    backup = beat(c, "backup", 0, 3.0)
    assert backup["fence_key"] == c.fence_key
    assert "fence_key" not in beat(c, "broker", 1, 3.0)
    restored = make(now=3.0, state=c.to_state())
    assert restored.fence_key == c.fence_key   # tokens stay valid across a restart
