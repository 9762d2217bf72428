"""Rebalancing in the coordinator (kera.coordinator.rebalance), driven with an injected clock:
plans, a step handing a broker's replicated streamlets over through its re-registration (the
failover path), one step at a time, R=1 streamlets kept, and the automatic policy."""

import pytest

from kera.coordinator import rebalance
from kera.coordinator.core import Coordinator
from kera.errors import NotReady

INTERVAL_S = 0.1
MISSED = 20
TOKEN = "0123456789abcdef0123456789abcdef"
DEAD_S = INTERVAL_S * MISSED


def make(**kw):
    return Coordinator(0.0, heartbeat_interval_s=INTERVAL_S, heartbeat_missed_max=MISSED,
                       token_source=lambda: TOKEN, **kw)


def register(c, kind, i, now):
    return c.handle("register", {"kind": kind, "address": f"127.0.0.1:{9000 + i}",
                                 "node": f"{kind}-{i}", "daemon_id": i, "token": TOKEN}, now)


def beat(c, i, now, kind="broker"):
    epoch = c.failover.epochs.get(i) if kind == "broker" else None
    fields = {"token": TOKEN, "kind": kind, "daemon_id": i, "metadata_version": 0}
    if epoch is not None:
        fields["epoch"] = epoch
    return c.handle("heartbeat", fields, now)


def keep_alive(c, brokers, now, backups=(0, 1)):
    for b in brokers:
        beat(c, b, now)
    for b in backups:
        beat(c, b, now, kind="backup")
    c.tick(now)


def recover_all(c, now):
    """Every new owner reports its recovering streamlets recovered."""
    for sid, per in list(c.failover.recovering.items()):
        stream = next(s for s in c.streams.values() if s.id == sid)
        for sl in list(per):
            owner = stream.placement[sl]
            c.handle("recovered", {"token": TOKEN, "broker_id": owner,
                                   "epoch": c.failover.epochs[owner],
                                   "streamlets": [[sid, sl]]}, now)


def loads(c):
    out = {}
    for s in c.streams.values():
        for b in s.placement:
            out[b] = out.get(b, 0) + 1
    return out


def unbalanced(**kw):
    """Brokers 0 and 1 hold 6 replicated streamlets each; broker 2 joined later, empty."""
    c = make(**kw)
    for i in (0, 1):
        register(c, "broker", i, 0.0)
        register(c, "backup", i, 0.0)
    c.handle("create_stream", {"name": "s", "streamlets": 12, "replication": 2}, 0.0)
    register(c, "broker", 2, 0.0)
    return c


def test_plan_hands_over_the_broker_whose_handover_evens_out_most():
    c = unbalanced(auto_rebalance=False)
    p = c.handle("rebalance", {"dry_run": True}, 0.0)
    assert p["loads"] == {"0": 6, "1": 6, "2": 0} and p["spread"] == 6
    assert p["broker"] == 0 and p["moves"] == 6
    assert p["after"] == {"0": 3, "1": 6, "2": 3} and p["spread_after"] == 3
    assert not p["started"] and p["busy"] is None
    assert loads(c) == {0: 6, 1: 6}, "a dry run moves nothing"


def test_a_step_goes_through_the_brokers_reregistration_and_recovery():
    c = unbalanced(auto_rebalance=False)
    e0 = c.failover.epochs[0]
    assert c.handle("rebalance", {}, 0.1)["started"]
    with pytest.raises(NotReady, match="busy|in progress"):
        c.handle("rebalance", {}, 0.1)
    beat(c, 1, 0.2)                                   # others carry on
    with pytest.raises(NotReady, match="register again"):
        beat(c, 0, 0.2)
    assert loads(c) == {0: 6, 1: 6}, "nothing moves before the broker registers again"
    register(c, "broker", 0, 0.3)                     # a new incarnation, memory dropped
    assert c.failover.epochs[0] != e0
    assert loads(c) == {0: 3, 1: 6, 2: 3}
    d = c.describe_stream("s")
    assert all(srcs == [[0, e0]] for _, srcs in d["recovering"]) and len(d["recovering"]) == 6
    assert c.handle("rebalance", {"dry_run": True}, 0.4)["busy"] == "6 streamlets are recovering"
    recover_all(c, 0.5)
    for b in (0, 1):
        beat(c, b, 0.6, kind="backup")
    p = c.handle("rebalance", {}, 0.6)
    assert p["broker"] == 1 and p["started"]
    register(c, "broker", 1, 0.7)
    recover_all(c, 0.8)
    for b in (0, 1):
        beat(c, b, 0.9, kind="backup")
    assert loads(c) == {0: 4, 1: 4, 2: 4}
    p = c.handle("rebalance", {}, 0.9)
    assert p["broker"] is None and not p["started"] and p["spread"] == 0


def test_unreplicated_streamlets_never_move():
    c = make(auto_rebalance=False)
    register(c, "broker", 0, 0.0)
    c.handle("create_stream", {"name": "one", "streamlets": 4, "replication": 1}, 0.0)
    register(c, "broker", 1, 0.0)
    p = c.handle("rebalance", {}, 0.1)
    assert p["loads"] == {"0": 4, "1": 0} and p["broker"] is None and not p["started"]


def test_a_pending_handover_ends_when_its_broker_dies():
    c = unbalanced(auto_rebalance=False)
    c.handle("rebalance", {}, 0.0)
    keep_alive(c, (1, 2), DEAD_S / 2)
    keep_alive(c, (1, 2), DEAD_S + 0.5)               # broker 0 silent: dead, failed over
    assert c.rebalancer.pending is None
    assert 0 not in loads(c)


def test_the_automatic_policy_waits_for_steady_brokers_then_steps():
    c = unbalanced()
    t = 0.0
    while t < rebalance.AUTO_STEADY_S - 1:
        t += 0.5
        keep_alive(c, (0, 1, 2), t)
    assert c.rebalancer.pending is None, "not before the brokers were steady"
    while c.rebalancer.pending is None and t < rebalance.AUTO_STEADY_S + 3:
        t += 0.5
        keep_alive(c, (0, 1, 2), t)   # the step starts in this tick
    assert c.rebalancer.pending == 0 and c.rebalancer.last_step["why"] == "automatic"


def test_the_automatic_policy_can_be_turned_off():
    c = unbalanced(auto_rebalance=False)
    t = 0.0
    while t < rebalance.AUTO_STEADY_S * 2:
        t += 0.5
        keep_alive(c, (0, 1, 2), t)
    assert c.rebalancer.pending is None and c.rebalancer.steps == 0


def test_no_step_while_a_backup_may_be_down():
    c = unbalanced(auto_rebalance=False)
    silent_s = INTERVAL_S * rebalance.BACKUP_SILENT_INTERVALS_MAX + 0.1
    beat(c, 0, silent_s, kind="backup")               # backup 1 is silent
    p = c.handle("rebalance", {"dry_run": True}, silent_s)
    assert p["busy"] == f"backup 1 has not heartbeated for {silent_s - 0.1:.1f} s"
    with pytest.raises(NotReady, match="backup 1"):
        c.handle("rebalance", {}, silent_s)
    # A replica of broker 0 on a backup the coordinator holds dead: broker 0 must keep it.
    beat(c, 1, silent_s, kind="backup")
    c.replica_map.tables[0] = {(0, 1): [1]}
    c.members["backup"][1].alive = False
    p = c.handle("rebalance", {"dry_run": True}, silent_s)
    assert "dead backup 1" in p["busy"] and c.rebalancer.pending is None
