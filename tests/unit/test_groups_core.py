"""The consumer-group state machine (kera.coordinator.groups): assignment, handover, commits."""

import itertools
import random

import pytest

from kera.coordinator.core import Coordinator
from kera.coordinator.groups import (LEAVE_EPOCH, STATIC_LEAVE_EPOCH, Groups, assign_parts)
from kera.errors import BadRequest, GroupNotEmpty, StaleMemberEpoch, UnknownMember

SHAPE = {"a": 4, "b": 3}


def make_groups():
    ids = itertools.count()
    return Groups(SHAPE.get, id_source=lambda: f"m{next(ids)}")


def join(g, now=0.0, streams=("a",), **kw):
    return g.heartbeat("g", "", 0, now, streams=streams, **kw)


def beat(g, reply, now=0.0, owned=None):
    owned = reply["assignment"] if owned is None else owned
    return g.heartbeat("g", reply["member_id"], reply["member_epoch"], now, owned=owned)


def test_a_lone_member_gets_every_streamlet_of_its_streams():
    g = make_groups()
    r = join(g, streams=("a", "b"))
    assert sorted(map(tuple, r["assignment"])) == [("a", i) for i in range(4)] + [("b", i) for i in range(3)]
    assert r["member_epoch"] == r["group_epoch"] == 1


def test_a_part_moves_only_after_its_old_owner_lets_go():
    g = make_groups()
    a = join(g)
    b = join(g, now=0.1)
    # b's share is held by a until a acknowledges: nothing granted yet, a new epoch.
    assert b["assignment"] == [] and b["group_epoch"] == 2
    a2 = beat(g, a, owned=a["assignment"])             # a learns its revocation
    revoked = {tuple(p) for p in a["assignment"]} - {tuple(p) for p in a2["assignment"]}
    assert len(revoked) == 2
    assert beat(g, b)["assignment"] == []               # a still lists them as owned
    beat(g, a2)                                          # a acknowledges (owned = its grant)
    b2 = beat(g, b)
    assert {tuple(p) for p in b2["assignment"]} == revoked
    assert b2["member_epoch"] == 2


def test_the_new_owner_starts_from_the_old_owners_commit():
    g = make_groups()
    a = join(g)
    join(g, now=0.1)
    a2 = beat(g, a)
    revoked = [p for p in a["assignment"] if p not in a2["assignment"]]
    # The revoked member may still commit what it holds until it acknowledges.
    g.commit("g", a2["member_id"], a2["member_epoch"], {tuple(revoked[0]): [[0, 7, None]]})
    beat(g, a2)
    b = g.heartbeat("g", "m1", 0, 0.2, owned=[])
    assert [revoked[0][0], revoked[0][1], [[0, 7, None]]] in b["positions"]


def test_commits_from_a_non_holder_or_stale_epoch_are_refused():
    g = make_groups()
    a = join(g)
    b = join(g, now=0.1)
    with pytest.raises(StaleMemberEpoch, match="does not hold"):
        g.commit("g", b["member_id"], b["member_epoch"], {("a", 0): [[0, 1, None]]})
    with pytest.raises(StaleMemberEpoch, match="epoch"):
        g.commit("g", a["member_id"], a["member_epoch"] + 1, {("a", 0): [[0, 1, None]]})
    with pytest.raises(UnknownMember):
        g.commit("g", "nobody", 0, {("a", 0): [[0, 1, None]]})
    with pytest.raises(GroupNotEmpty):
        g.commit("g", "", 0, {("a", 0): [[0, 1, None]]})


def test_a_silent_member_is_removed_and_its_parts_reassigned():
    g = make_groups()
    a = join(g, session_timeout_ms=1000)
    b = join(g, now=0.1, session_timeout_ms=1000)
    beat(g, beat(g, a))
    b = beat(g, b, now=1.0)
    assert g.expire(1.05) == [("g", "m0")]
    with pytest.raises(UnknownMember):
        beat(g, a, now=1.1)
    assert len(beat(g, b, now=1.1)["assignment"]) == 4


def test_a_static_member_reclaims_its_place_without_a_rebalance():
    g = make_groups()
    a = join(g, instance_id="host-1")
    b = join(g, now=0.1, instance_id="host-2")
    a = beat(g, beat(g, a))
    b = beat(g, b)
    epoch = b["group_epoch"]
    g.heartbeat("g", b["member_id"], b["member_epoch"], 0.2, owned=b["assignment"])
    assert g.heartbeat("g", b["member_id"], STATIC_LEAVE_EPOCH, 0.3)["member_epoch"] == LEAVE_EPOCH
    back = join(g, now=0.5, instance_id="host-2")
    assert back["assignment"] == b["assignment"] and back["group_epoch"] == epoch
    with pytest.raises(UnknownMember):   # the old incarnation is fenced
        g.commit("g", b["member_id"], b["member_epoch"], {})


def test_delete_and_reset_need_an_empty_group():
    g = make_groups()
    a = join(g)
    with pytest.raises(GroupNotEmpty):
        g.delete("g")
    g.heartbeat("g", a["member_id"], LEAVE_EPOCH, 0.1)
    g.reset("g", {("a", 1): [[0, 3, None]]}, streams=["a"])
    assert g.describe("g")["positions"] == [["a", 1, [[0, 3, None]]]]
    g.delete("g")
    with pytest.raises(BadRequest, match="no consumer group"):
        g.describe("g")


def test_assignment_is_balanced_and_sticky():
    subs = {"x": ("a",), "y": ("a",), "z": ("a",)}
    parts = [("a", i) for i in range(7)]
    first = assign_parts(parts, subs, {})
    assert sorted(len(v) for v in first.values()) == [2, 2, 3]
    del subs["z"]
    second = assign_parts(parts, subs, first)
    assert first["x"] <= second["x"] and first["y"] <= second["y"]


@pytest.mark.parametrize("seed", range(30))
def test_never_two_holders_under_random_membership(seed):
    """Random joins, leaves, silences and lost replies: at every step each part is held
    (granted or still owned) by at most one member, and a settled group covers every part."""
    rng = random.Random(seed)
    g = make_groups()
    replies: dict[str, dict] = {}
    now = 0.0
    for _ in range(300):
        now += rng.uniform(0.0, 0.3)
        action = rng.random()
        if action < 0.15 or not replies:
            r = join(g, now, streams=rng.choice([("a",), ("a", "b"), ("b",)]),
                      session_timeout_ms=2000)
            replies[r["member_id"]] = r
        elif action < 0.2:
            mid = rng.choice(sorted(replies))
            g.heartbeat("g", mid, LEAVE_EPOCH, now)
            del replies[mid]
        else:
            mid = rng.choice(sorted(replies))
            held = replies[mid]["assignment"]
            if rng.random() < 0.3:     # still busy letting go: keeps reporting an older set
                held = held + [p for p in rng.sample(held, len(held) // 2)]
            try:
                r = beat(g, replies[mid], now, owned=held)
            except UnknownMember:
                del replies[mid]
                continue
            if rng.random() > 0.1:     # 10% of replies are lost
                replies[mid] = r
        for gone_group, mid in g.expire(now):
            replies.pop(mid, None)
        holders = {}
        for mid, m in (g.groups["g"].members if "g" in g.groups else {}).items():
            for part in m.holds():
                assert part not in holders, f"{part} held by {holders.get(part)} and {mid}"
                holders[part] = mid
    # Settle: everyone heartbeats its grant until nothing moves.
    for _ in range(10):
        for mid in sorted(replies):
            replies[mid] = beat(g, replies[mid], now)
    members = g.groups["g"].members if "g" in g.groups else {}
    streams = {s for m in members.values() for s in m.streams}
    wanted = {(s, i) for s in streams for i in range(SHAPE[s])}
    assert {p for m in members.values() for p in m.granted} == wanted


def test_commits_persist_through_the_coordinators_state():
    c = Coordinator(0.0)
    c.groups.commit("g", "", 0, {("a", 0): [[2, 5, 1]]})
    restored = Coordinator(1.0, state=c.to_state())
    assert restored.handle("group_offsets", {"group": "g"}, 1.0) == \
        {"positions": [["a", 0, [[2, 5, 1]]]]}


def test_the_ops_refuse_malformed_positions():
    c = Coordinator(0.0)
    with pytest.raises(BadRequest, match="group position"):
        c.handle("group_commit", {"group": "g", "positions": [["a", 0, [[1, -2, None]]]]}, 0.0)
    with pytest.raises(BadRequest, match="part"):
        c.handle("group_heartbeat", {"group": "g", "member_epoch": 0, "streams": ["a"],
                                     "owned": [["a", "x"]]}, 0.0)


def test_a_pattern_subscription_takes_streams_created_later():
    shape = {"clicks-1": 2}
    ids = itertools.count()
    g = Groups(shape.get, shape.keys, id_source=lambda: f"m{next(ids)}")
    r = g.heartbeat("g", "", 0, 0.0, pattern="clicks-.*")
    assert sorted(map(tuple, r["assignment"])) == [("clicks-1", 0), ("clicks-1", 1)]
    shape["clicks-2"] = 1
    shape["views"] = 3
    r = beat(g, r, 0.1)
    assert ("clicks-2", 0) in map(tuple, r["assignment"]) and r["group_epoch"] == 2
    assert not any(p[0] == "views" for p in r["assignment"])


def test_groups_and_members_are_bounded_and_empty_groups_forgotten(monkeypatch):
    from kera.coordinator import groups as groups_mod
    monkeypatch.setattr(groups_mod, "GROUPS_MAX", 3)
    monkeypatch.setattr(groups_mod, "MEMBERS_PER_GROUP_MAX", 2)
    g = make_groups()
    for name in ("g1", "g2", "g3"):
        g.heartbeat(name, "", 0, 0.0, streams=["a"], session_timeout_ms=1000)
    with pytest.raises(BadRequest, match="consumer groups"):
        g.heartbeat("g4", "", 0, 0.0, streams=["a"])
    g.heartbeat("g1", "", 0, 0.0, streams=["a"], session_timeout_ms=1000)
    with pytest.raises(BadRequest, match="members"):
        g.heartbeat("g1", "", 0, 0.0, streams=["a"])
    g.commit("g2", "m1", 1, {("a", 0): [[0, 1, None]]})
    g.expire(5.0)                      # every member silent: groups without commits go
    assert sorted(g.groups) == ["g2"]


def test_a_non_member_commits_only_while_the_group_has_no_live_members():
    # Kafka's rule for commits from outside the group (a Spark query's progress, tools).
    g = make_groups()
    g.commit("g", "", 0, {("a", 0): [[0, 5, None]]})          # an unknown group is created
    assert g.describe("g")["positions"] == [["a", 0, [[0, 5, None]]]]
    a = join(g, now=0.1)
    with pytest.raises(GroupNotEmpty, match="live members"):
        g.commit("g", "", 0, {("a", 0): [[0, 9, None]]})
    g.heartbeat("g", a["member_id"], LEAVE_EPOCH, 0.2)
    g.commit("g", "", 0, {("a", 0): [[0, 9, None]]})
    assert g.describe("g")["positions"] == [["a", 0, [[0, 9, None]]]]


def test_consumed_below_is_the_least_committed_group_over_every_consumer_group():
    groups = Groups(lambda name: 3 if name in ("s", "t") else None, lambda: ["s", "t"])
    assert groups.consumed_below("s", 3) == [0, 0, 0]            # nobody consumes it
    groups.commit("a", None, 0, {("s", 0): [[5, 10, 0], [6, 0, 0]], ("s", 1): [[2, 0, 0]]})
    assert groups.consumed_below("s", 3) == [5, 2, 0]            # streamlet 2: no commit
    groups.commit("b", None, 0, {("s", 0): [[3, 1, 0]], ("s", 1): [[9, 0, 0]],
                                 ("s", 2): [[4, 0, 0]]})
    assert groups.consumed_below("s", 3) == [3, 2, 0]
    groups.commit("a", None, 0, {("s", 2): [[7, 0, 0]]})
    assert groups.consumed_below("s", 3) == [3, 2, 4]
    assert groups.consumed_below("t", 3) == [0, 0, 0]            # other streams unaffected
    before = groups.changes
    groups.commit("a", None, 0, {("s", 2): [[8, 0, 0]]})
    assert groups.changes > before


def test_a_subscription_holds_only_streams_the_member_may_read():
    shape = {"clicks-1": 1, "clicks-secret": 1}
    ids = itertools.count()
    g = Groups(shape.get, shape.keys, id_source=lambda: f"m{next(ids)}")
    may_read = lambda stream: stream != "clicks-secret"   # noqa: E731 (an ACL's answer)
    r = g.heartbeat("g", "", 0, 0.0, pattern="clicks-.*", streams=["clicks-secret"],
                    may_read=may_read)
    assert sorted(map(tuple, r["assignment"])) == [("clicks-1", 0)]
    from kera.coordinator.groups import _subscribed
    member = next(iter(g.groups["g"].members.values()))
    assert not _subscribed(member, "clicks-secret") and _subscribed(member, "clicks-1")


def test_a_commit_on_a_stream_the_principal_cannot_read_is_refused():
    from kera.coordinator.groups import ops
    from kera.errors import NotAuthorized
    from kera.codec.wire import Fields
    shape = {"a": 1, "secret": 1}
    g = Groups(shape.get, shape.keys)
    handlers = ops(g, lambda: (lambda stream: stream == "a"))
    with pytest.raises(NotAuthorized, match="secret"):
        handlers["group_commit"](Fields({"group": "g", "positions": [["secret", 0, [[0, 5, 0]]]]}),
                                 0.0)
    assert "g" not in g.groups or not g.groups["g"].committed
