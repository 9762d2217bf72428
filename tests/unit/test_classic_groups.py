"""Kafka classic consumer groups (kera.broker.kafka.classic_groups): JoinGroup held until a
generation forms, SyncGroup held until the leader's assignments, heartbeats, leaving, silent
members, OffsetCommit's member checks, bounds. Sans-IO, driven by a fake clock (seconds)."""

import pytest

from kera.broker.kafka.classic_groups import (
    COMPLETING, COORDINATOR_NOT_AVAILABLE, DEAD, EMPTY, GROUP_ID_NOT_FOUND,
    GROUP_MAX_SIZE_REACHED, ILLEGAL_GENERATION, INCONSISTENT_GROUP_PROTOCOL, INVALID_GROUP_ID,
    INVALID_SESSION_TIMEOUT, MEMBER_ID_REQUIRED, NON_EMPTY_GROUP, NONE, PREPARING,
    REBALANCE_IN_PROGRESS, STABLE, UNKNOWN_MEMBER_ID, ClassicGroups, JoinResult, SyncResult)

SESSION_MS, REBALANCE_MS = 10_000, 30_000
RANGE = [("range", b"meta-range")]


def join(g, member_id, token, now, *, client="c", protocols=RANGE, protocol_type="consumer",
         group="g", require_known=False, session_ms=SESSION_MS):
    return g.join(group, member_id, client, "/10.0.0.1", session_ms, REBALANCE_MS,
                  protocol_type, protocols, require_known, token, now)


def answers(g, now) -> dict:
    return dict(g.take_ready(now))


def joined_alone(g, token, now, **kw) -> JoinResult:
    """A first member of an empty group (no initial delay): its generation forms at once."""
    assert join(g, "", token, now, **kw) is None
    return answers(g, now)[token]


def stable_pair(g, now=0.0):
    """Members a (leader) and b of group "g", Stable in generation 2 with assignments."""
    a = joined_alone(g, "ja", now).member_id
    assert join(g, "", "jb", now) is None
    assert g.heartbeat("g", 1, a, now) == REBALANCE_IN_PROGRESS
    assert join(g, a, "ja2", now) is None
    got = answers(g, now)
    b = got["jb"].member_id
    assert g.sync("g", 2, b, [], "sb", now) is None
    g.sync("g", 2, a, [(a, b"A"), (b, b"B")], "sa", now)
    assert {t: r.assignment for t, r in g.take_ready(now)} == {"sa": b"A", "sb": b"B"}
    return a, b


@pytest.fixture
def g():
    return ClassicGroups(initial_rebalance_delay_ms=0)


def test_the_second_member_is_held_until_the_first_rejoins_and_only_the_leader_gets_members(g):
    first = joined_alone(g, "ja", 0.0, client="app")
    a = first.member_id
    assert a.startswith("app-")
    assert (first.error, first.generation_id, first.leader_id) == (NONE, 1, a)

    assert join(g, "", "jb", 1.0, protocols=[("range", b"meta-b")]) is None
    assert g.take_ready(1.0) == [], "b waits for a, a known member, to rejoin"
    assert g.describe("g").state == PREPARING
    assert g.heartbeat("g", 1, a, 1.5) == REBALANCE_IN_PROGRESS, "a learns of the rebalance"
    assert join(g, a, "ja2", 2.0) is None

    got = answers(g, 2.0)
    leader, follower = got["ja2"], got["jb"]
    b = follower.member_id
    assert (leader.error, leader.generation_id, leader.leader_id) == (NONE, 2, a)
    assert (follower.error, follower.generation_id, follower.leader_id) == (NONE, 2, a)
    assert (leader.protocol_type, leader.protocol_name) == ("consumer", "range")
    assert leader.members == [(a, b"meta-range"), (b, b"meta-b")]
    assert follower.members == []
    assert g.describe("g").state == COMPLETING


def test_syncs_deliver_each_member_its_own_assignment_once_the_leader_sends_them(g):
    a = joined_alone(g, "ja", 0.0).member_id
    join(g, "", "jb", 0.0)
    join(g, "", "jc", 0.0)
    join(g, a, "ja2", 0.0)
    got = answers(g, 0.0)
    b, c = got["jb"].member_id, got["jc"].member_id

    assert g.sync("g", 2, b, [], "sb", 1.0) is None, "a follower waits for the leader"
    assert g.take_ready(1.0) == []
    assert g.sync("g", 2, a, [(a, b"for-a"), (b, b"for-b")], "sa", 2.0) is None
    got = answers(g, 2.0)
    assert got == {"sa": SyncResult(NONE, b"for-a", "consumer", "range"),
                   "sb": SyncResult(NONE, b"for-b", "consumer", "range")}
    assert g.sync("g", 2, c, [], "sc", 3.0) == SyncResult(NONE, b"", "consumer", "range"), \
        "a member the leader gave nothing gets empty bytes, at once once Stable"
    d = g.describe("g")
    assert d.state == STABLE and d.protocol_name == "range"
    assert [(m.member_id, m.assignment) for m in d.members] == [
        (a, b"for-a"), (b, b"for-b"), (c, b"")]
    assert g.heartbeat("g", 2, b, 4.0) == NONE


def test_sync_errors_name_the_fault(g):
    a, b = stable_pair(g)
    assert g.sync("g", 2, "nobody", [], "t", 1.0).error == UNKNOWN_MEMBER_ID
    assert g.sync("other", 2, a, [], "t", 1.0).error == UNKNOWN_MEMBER_ID
    assert g.sync("g", 1, a, [], "t", 1.0).error == ILLEGAL_GENERATION
    assert g.sync("g", 2, a, [], "t", 1.0, protocol_name="roundrobin").error == \
        INCONSISTENT_GROUP_PROTOCOL
    join(g, "", "jc", 2.0)
    assert g.sync("g", 2, b, [], "t", 2.0).error == REBALANCE_IN_PROGRESS


def test_a_third_member_triggers_a_rebalance_and_a_new_generation(g):
    a, b = stable_pair(g)
    assert join(g, "", "jc", 5.0) is None
    assert g.describe("g").state == PREPARING
    assert g.heartbeat("g", 2, a, 6.0) == REBALANCE_IN_PROGRESS
    assert g.heartbeat("g", 2, b, 6.0) == REBALANCE_IN_PROGRESS
    assert g.commit_allowed("g", 2, a) == NONE, "commits go on while preparing (as Kafka)"
    join(g, b, "jb", 7.0)
    assert g.take_ready(7.0) == [], "a has not rejoined yet"
    join(g, a, "ja", 8.0)
    got = answers(g, 8.0)
    assert {r.generation_id for r in got.values()} == {3}
    assert got["ja"].leader_id == a, "the leader stays the leader"
    assert len(got["ja"].members) == 3 and got["jb"].members == got["jc"].members == []
    assert g.heartbeat("g", 2, a, 9.0) == ILLEGAL_GENERATION
    assert g.commit_allowed("g", 3, a) == REBALANCE_IN_PROGRESS, "until the leader syncs"


def test_a_silent_member_is_removed_at_its_session_timeout_and_the_survivor_rebalances_alone(g):
    a, b = stable_pair(g, now=0.0)
    assert g.next_deadline() == pytest.approx(SESSION_MS / 1000)
    for now in (3.0, 6.0, 9.0):
        assert g.heartbeat("g", 2, a, now) == NONE
    g.tick(9.99)
    assert [m.member_id for m in g.describe("g").members] == [a, b]
    g.tick(10.0)
    assert [m.member_id for m in g.describe("g").members] == [a]
    assert g.heartbeat("g", 2, b, 10.5) == UNKNOWN_MEMBER_ID
    assert g.heartbeat("g", 2, a, 11.0) == REBALANCE_IN_PROGRESS
    join(g, a, "ja", 11.5)
    alone = answers(g, 11.5)["ja"]
    assert (alone.generation_id, alone.leader_id, alone.members) == (3, a, [(a, b"meta-range")])


def test_a_member_that_does_not_rejoin_within_the_rebalance_timeout_is_dropped(g):
    a, b = stable_pair(g, now=0.0)
    join(g, "", "jc", 1.0)
    join(g, a, "ja", 2.0)
    assert g.next_deadline() <= 1.0 + REBALANCE_MS / 1000
    for now in range(3, 31, 3):   # b heartbeats (each answered 27) but never rejoins
        assert g.heartbeat("g", 2, b, float(now)) == REBALANCE_IN_PROGRESS
    assert g.take_ready(30.99) == []
    got = answers(g, 31.0)
    assert {t: r.generation_id for t, r in got.items()} == {"ja": 3, "jc": 3}
    assert [m for m, _ in got["ja"].members] == [a, got["jc"].member_id]
    assert g.heartbeat("g", 3, b, 31.5) == UNKNOWN_MEMBER_ID


def test_a_leader_that_never_syncs_is_dropped_and_the_held_followers_are_told_to_rejoin(g):
    a = joined_alone(g, "ja", 0.0).member_id
    join(g, "", "jb", 0.0)
    join(g, a, "ja2", 0.0)
    b = answers(g, 0.0)["jb"].member_id
    assert g.sync("g", 2, b, [], "sb", 1.0) is None
    for now in range(3, 30, 3):   # the leader heartbeats but never sends its SyncGroup
        assert g.heartbeat("g", 2, a, float(now)) == NONE
    assert g.take_ready(29.9) == [], "b is held (and kept alive) while it waits"
    assert answers(g, 30.0) == {"sb": SyncResult(REBALANCE_IN_PROGRESS)}
    assert [m.member_id for m in g.describe("g").members] == [b]


def test_member_id_required_hands_out_an_id_the_member_joins_with(g):
    first = join(g, "", "j1", 0.0, client="rdkafka", require_known=True)
    assert first.error == MEMBER_ID_REQUIRED and first.generation_id == -1
    assert first.member_id.startswith("rdkafka-")
    assert g.describe("g").members == [] and g.describe("g").state == EMPTY
    assert join(g, first.member_id, "j2", 0.1, require_known=True) is None
    got = answers(g, 0.1)["j2"]
    assert (got.error, got.member_id, got.leader_id) == (NONE, first.member_id, first.member_id)


def test_an_unused_member_id_expires_after_the_session_timeout(g):
    given = join(g, "", "j1", 0.0, require_known=True).member_id
    g.tick(SESSION_MS / 1000)
    assert join(g, given, "j2", 10.0, require_known=True).error == UNKNOWN_MEMBER_ID
    assert join(g, "made-up", "j3", 10.0).error == UNKNOWN_MEMBER_ID


def test_leave_answers_per_member_and_the_rest_rebalance(g):
    a, b = stable_pair(g)
    assert g.leave("g", [b, "ghost"], 1.0) == [(b, NONE), ("ghost", UNKNOWN_MEMBER_ID)]
    assert g.heartbeat("g", 2, a, 1.5) == REBALANCE_IN_PROGRESS
    join(g, a, "ja", 2.0)
    assert answers(g, 2.0)["ja"].members == [(a, b"meta-range")]
    assert g.leave("g", [a], 3.0) == [(a, NONE)]
    assert g.describe("g").state == EMPTY
    assert g.leave("unknown", ["x"], 3.0) == [("x", UNKNOWN_MEMBER_ID)]


def test_a_member_leaving_while_held_answers_its_join_unknown_member(g):
    a = joined_alone(g, "ja", 0.0).member_id
    join(g, "", "jb", 0.0)
    b_id = g.describe("g").members[1].member_id
    assert g.leave("g", [b_id], 1.0) == [(b_id, NONE)]
    assert answers(g, 1.0)["jb"] == JoinResult(UNKNOWN_MEMBER_ID, member_id=b_id)
    assert g.describe("g").members[0].member_id == a


def test_commit_allowed(g):
    assert g.commit_allowed("tools", -1, "") == NONE, "a simple consumer on an unknown group"
    assert g.commit_allowed("tools", 3, "m") == ILLEGAL_GENERATION
    a, b = stable_pair(g)
    assert g.commit_allowed("g", 2, a) == NONE
    assert g.commit_allowed("g", -1, "") == UNKNOWN_MEMBER_ID, "the group has members"
    assert g.commit_allowed("g", 2, "stranger") == UNKNOWN_MEMBER_ID
    assert g.commit_allowed("g", 1, b) == ILLEGAL_GENERATION
    g.leave("g", [a, b], 1.0)
    assert g.commit_allowed("g", -1, "") == NONE, "an Empty group"
    assert g.commit_allowed("g", 2, a) == UNKNOWN_MEMBER_ID


def test_a_commit_counts_as_a_heartbeat(g):
    a = joined_alone(g, "ja", 0.0).member_id
    g.sync("g", 1, a, [(a, b"x")], "sa", 0.0)
    assert g.commit_allowed("g", 1, a, now=8.0) == NONE
    g.tick(12.0)
    assert g.heartbeat("g", 1, a, 12.0) == NONE


def test_inconsistent_protocols_are_refused_and_the_common_one_is_chosen(g):
    two = [("cooperative-sticky", b"cs"), ("range", b"r")]
    a = joined_alone(g, "ja", 0.0, protocols=two).member_id
    assert join(g, "", "x", 1.0, protocol_type="connect").error == INCONSISTENT_GROUP_PROTOCOL
    assert join(g, "", "x", 1.0, protocols=[("roundrobin", b"")]).error == \
        INCONSISTENT_GROUP_PROTOCOL
    assert join(g, "", "x", 1.0, protocols=[]).error == INCONSISTENT_GROUP_PROTOCOL
    assert join(g, "", "jb", 1.0, protocols=[("range", b"rb"), ("roundrobin", b"")]) is None
    join(g, a, "ja", 1.0, protocols=two)
    got = answers(g, 1.0)
    assert got["ja"].protocol_name == got["jb"].protocol_name == "range"
    assert got["ja"].members == [(a, b"r"), (got["jb"].member_id, b"rb")]


def test_the_protocol_most_members_prefer_wins_and_ties_follow_the_leader():
    g = ClassicGroups(initial_rebalance_delay_ms=1000)
    both = [("range", b""), ("roundrobin", b"")]
    join(g, "", "j1", 0.0, protocols=[("roundrobin", b""), ("range", b"")])
    join(g, "", "j2", 0.1, protocols=both)
    join(g, "", "j3", 0.2, protocols=both)
    assert {r.protocol_name for r in answers(g, 1.2).values()} == {"range"}
    g2 = ClassicGroups(initial_rebalance_delay_ms=1000)
    join(g2, "", "j1", 0.0, protocols=[("roundrobin", b""), ("range", b"")])
    join(g2, "", "j2", 0.1, protocols=both)
    assert {r.protocol_name for r in answers(g2, 1.1).values()} == {"roundrobin"}


def test_the_initial_delay_gathers_consumers_started_together_into_one_generation():
    g = ClassicGroups(initial_rebalance_delay_ms=100)
    assert join(g, "", "j1", 0.0) is None
    assert join(g, "", "j2", 0.05) is None
    assert g.take_ready(0.1) == [], "each new member extends the delay"
    assert g.next_deadline() == pytest.approx(0.15)
    assert g.take_ready(0.14) == []
    got = answers(g, 0.16)
    assert {r.generation_id for r in got.values()} == {1}
    assert len(got["j1"].members) == 2


def test_join_validates_the_request(g):
    assert join(g, "", "t", 0.0, session_ms=5_999).error == INVALID_SESSION_TIMEOUT
    assert join(g, "", "t", 0.0, session_ms=1_800_001).error == INVALID_SESSION_TIMEOUT
    assert join(g, "", "t", 0.0, group="").error == INVALID_GROUP_ID
    assert g.list() == [], "a refused join creates no group"


def test_a_known_follower_rejoining_unchanged_gets_the_current_generation_at_once(g):
    a, b = stable_pair(g)
    again = join(g, b, "jb", 1.0)
    assert (again.error, again.generation_id, again.members) == (NONE, 2, [])
    assert g.describe("g").state == STABLE
    assert join(g, a, "ja", 1.0) is None, "the leader rejoining starts a rebalance (as Kafka)"


def test_describe_list_delete(g):
    assert g.describe("nope").state == DEAD and g.describe("nope").members == []
    a, b = stable_pair(g)
    d = g.describe("g")
    assert [(m.client_id, m.client_host, m.metadata) for m in d.members] == [
        ("c", "/10.0.0.1", b"meta-range")] * 2
    assert g.list() == [("g", "consumer", STABLE)]
    assert g.delete("g") == NON_EMPTY_GROUP
    assert g.delete("nope") == GROUP_ID_NOT_FOUND
    g.leave("g", [a, b], 1.0)
    assert g.list() == [("g", "consumer", EMPTY)]
    assert g.delete("g") == NONE
    assert g.list() == []


def test_a_closed_connection_forgets_its_held_requests(g):
    a = joined_alone(g, "ja", 0.0).member_id
    join(g, "", "jb", 0.0)
    assert g.parked == 1
    g.forget_token("jb")
    assert g.parked == 0
    join(g, a, "ja2", 1.0)
    assert list(answers(g, 1.0)) == ["ja2"], "nothing comes out for the forgotten token"


def test_group_size_is_bounded_counting_handed_out_ids():
    g = ClassicGroups(initial_rebalance_delay_ms=0, members_max=2)
    joined_alone(g, "ja", 0.0)
    assert join(g, "", "jb", 0.0, require_known=True).error == MEMBER_ID_REQUIRED
    assert join(g, "", "jc", 0.0, require_known=True).error == GROUP_MAX_SIZE_REACHED
    assert join(g, "", "jc", 0.0).error == GROUP_MAX_SIZE_REACHED


def test_groups_are_bounded_and_an_empty_one_makes_room():
    g = ClassicGroups(initial_rebalance_delay_ms=0, groups_max=2)
    joined_alone(g, "j1", 0.0, group="g1")
    joined_alone(g, "j2", 0.0, group="g2")
    assert join(g, "", "j3", 0.0, group="g3").error == COORDINATOR_NOT_AVAILABLE
    g.leave("g1", [g.describe("g1").members[0].member_id], 1.0)
    assert join(g, "", "j3", 1.0, group="g3") is None
    assert sorted(name for name, _, _ in g.list()) == ["g2", "g3"]


def test_parked_requests_are_bounded(g):
    g = ClassicGroups(initial_rebalance_delay_ms=0, parked_max=1)
    a = joined_alone(g, "ja", 0.0).member_id
    assert join(g, "", "jb", 0.0) is None
    assert join(g, "", "jc", 0.0).error == COORDINATOR_NOT_AVAILABLE
    assert g.parked == 1
    assert g.heartbeat("g", 1, a, 0.0) == REBALANCE_IN_PROGRESS, "heartbeats are never held"


@pytest.mark.parametrize("seed", range(40))
def test_seeded_random_traffic_answers_every_held_request_exactly_once(seed):
    """Random joins, syncs, heartbeats, leaves, commits, closed connections and deletes over
    three groups with tight bounds: every held request is answered once (or forgotten), the
    parked count matches, deadlines lie ahead, and once all sessions are over nothing is left
    held."""
    import random
    rnd = random.Random(seed)
    g = ClassicGroups(initial_rebalance_delay_ms=rnd.choice([0, 100, 3000]),
                      members_max=rnd.choice([2, 50]), parked_max=rnd.choice([3, 1000]),
                      groups_max=rnd.choice([1, 3]))
    now, held, ids, generation = 0.0, {}, {"a": [], "b": [], "c": []}, {}  # held: token->group
    for step in range(300):
        now += rnd.choice([0, 0.01, 0.5, 3, 11, 31])
        group = rnd.choice("abc")
        member = rnd.choice(ids[group] + [""])
        token, op = (seed, step), rnd.random()
        if op < 0.35:
            protocols = rnd.choice([RANGE, [("rr", b""), ("range", b"")], [("rr", b"")]])
            r = join(g, member, token, now, group=group, protocols=protocols,
                     protocol_type=rnd.choice(["consumer", "connect"]),
                     require_known=rnd.random() < 0.5, session_ms=rnd.choice([6000, 10000]))
            ids[group] += [r.member_id] if r is not None and r.member_id else []
        elif op < 0.55:
            r = g.sync(group, generation.get(group, 0), member,
                       [(m, b"x") for m in ids[group]], token, now)
        elif op < 0.8:
            r = g.heartbeat(group, generation.get(group, 0), member, now)
        elif op < 0.85:
            r = g.leave(group, [member], now)
        elif op < 0.9:
            r = g.commit_allowed(group, rnd.choice([-1, generation.get(group, 0)]), member, now)
        elif op < 0.94 and held:
            forgotten = rnd.choice(sorted(held))
            r = g.forget_token(forgotten)
            del held[forgotten]
        else:
            r = g.delete(group)
        if r is None and op < 0.55:
            held[token] = group
        for answered, result in g.take_ready(now):
            of = held.pop(answered)   # KeyError: answered twice, or never held
            if isinstance(result, JoinResult) and result.error == NONE:
                generation[of] = result.generation_id
                ids[of].append(result.member_id)
        assert g.parked == len(held)
        assert g.next_deadline() is None or g.next_deadline() > now
    for _ in range(5):
        now += 2 * REBALANCE_MS / 1000
        for answered, _result in g.take_ready(now):
            del held[answered]
    assert held == {} and g.parked == 0


# --- the coordinator's state (kera.broker.kafka.group_state)

def test_parked_requests_count_held_ones_and_drop_the_answers_of_forgotten_tokens():
    from kera.broker.kafka.group_state import Group, Member, ParkedRequests
    parked, group = ParkedRequests(), Group("g")
    a, b = Member("a", "c", "h"), Member("b", "c", "h")
    a.join_wait = parked.park("t1", group, a)
    b.sync_wait = parked.park("t2", group, b)
    assert parked.count == 2
    parked.forget("t2")
    assert parked.count == 1
    parked.answer(b.sync_wait, "lost")
    parked.answer(a.join_wait, "answer")
    assert (a.join_wait, b.sync_wait, parked.count) == (None, None, 0)
    assert parked.take() == [("t1", "answer")] and parked.take() == []


def test_deadlines_keep_each_groups_earliest_and_pop_due_ones_lazily():
    from kera.broker.kafka.group_state import Deadlines, Group
    deadlines, g1, g2 = Deadlines(), Group("g1"), Group("g2")
    deadlines.schedule(g1, 5.0)
    deadlines.schedule(g1, 7.0)   # later than its earliest: not pushed
    deadlines.schedule(g2, 6.0)
    assert deadlines.next() == 5.0
    due = []
    for group in deadlines.due(6.0):
        due.append(group.group_id)
        if due == ["g1"]:
            deadlines.schedule(g1, 5.5)   # scheduled during the look: due in the same pass
    assert due == ["g1", "g1", "g2"] and deadlines.next() is None
    assert g1.scheduled is None and g2.scheduled is None
