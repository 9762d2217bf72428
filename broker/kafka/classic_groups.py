"""Kafka's classic consumer-group membership (JoinGroup, SyncGroup, Heartbeat, LeaveGroup and
the member checks of OffsetCommit), as Kafka's GroupCoordinator keeps it. Sans-IO.

A group goes Empty -> PreparingRebalance -> CompletingRebalance -> Stable and back to
PreparingRebalance whenever a member joins, changes its protocols, leaves or goes silent. A
rebalance holds every JoinGroup until each known member has rejoined, or the longest rebalance
timeout of its members has passed (members that did not rejoin are dropped); then a generation
forms: one protocol every member supports, a leader, and every held JoinGroup is answered, the
leader's with the members' metadata. Followers' SyncGroups are held until the leader's brings
the assignments.

A request that must wait is parked under the shell's `token` (hashable: it routes the answer)
and its call returns None; its answer comes out of `take_ready`, possibly at once. Time is the
`now` passed in (seconds, monotonic); every call first applies what `now` has expired, and
`next_deadline` says when the shell must call `tick` next. Offsets are stored elsewhere:
`commit_allowed` only says whether a member may commit. What is held between calls (groups,
members, parked requests, deadlines) and its bookkeeping is kera.broker.kafka.group_state's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kera.broker.kafka.consumer_protocol import subscribed_topics
from kera.broker.kafka.group_state import (
    COMPLETING, DEAD, EMPTY, PREPARING, STABLE, Deadlines, Group, Joining, Member, Parked,
    ParkedRequests)

# Kafka error codes (kio.schema.errors.ErrorCode) this module answers.
NONE = 0
COORDINATOR_NOT_AVAILABLE = 15
ILLEGAL_GENERATION = 22
INCONSISTENT_GROUP_PROTOCOL = 23
INVALID_GROUP_ID = 24
UNKNOWN_MEMBER_ID = 25
INVALID_SESSION_TIMEOUT = 26
REBALANCE_IN_PROGRESS = 27
NON_EMPTY_GROUP = 68
GROUP_ID_NOT_FOUND = 69
MEMBER_ID_REQUIRED = 79
GROUP_MAX_SIZE_REACHED = 81

# Kafka's group.min.session.timeout.ms / group.max.session.timeout.ms defaults: a member asking
# for a session outside them gets INVALID_SESSION_TIMEOUT. kafka-python asks 10 s, librdkafka
# 45 s.
SESSION_TIMEOUT_MIN_MS = 6_000
SESSION_TIMEOUT_MAX_MS = 1_800_000
# How long the first join of an empty group is held for others to join too, extended by each
# new member up to the rebalance timeout (Kafka's group.initial.rebalance.delay.ms, 3000 ms by
# default). Consumers started together then form one generation instead of one each: without
# it the first forms a group alone and learns of the second only at its next heartbeat (3 s).
# 100 ms covers consumers started by one script or one deploy and costs a lone consumer 0.1 s.
INITIAL_REBALANCE_DELAY_MS = 100
# Groups held at once, Empty ones included (a member-less group is a few hundred bytes). Past
# it an Empty group is forgotten to make room; when none is Empty a new group's first join
# gets COORDINATOR_NOT_AVAILABLE, which Kafka clients retry after finding the coordinator again.
GROUPS_MAX = 10_000
# Members (and member ids handed out by MEMBER_ID_REQUIRED, not yet used) of one group. Kafka's
# group.max.size is unbounded by default; the leader's JoinGroup answer carries every member's
# metadata (~100 B-1 KB each), so 1,000 keeps it near 1 MB. Past it: GROUP_MAX_SIZE_REACHED.
GROUP_MEMBERS_MAX = 1_000
# JoinGroups and SyncGroups held at once over all groups, each a parked request of the shell's
# (its connection muted until answered). Past it a JoinGroup or SyncGroup is refused with
# COORDINATOR_NOT_AVAILABLE (retried by clients) rather than held.
PARKED_REQUESTS_MAX = 100_000


@dataclass(frozen=True, slots=True)
class JoinResult:
    error: int
    generation_id: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader_id: str = ""
    member_id: str = ""
    members: list = field(default_factory=list)   # [(member_id, metadata)], the leader's only


@dataclass(frozen=True, slots=True)
class SyncResult:
    error: int
    assignment: bytes = b""
    protocol_type: str | None = None
    protocol_name: str | None = None


@dataclass(frozen=True, slots=True)
class MemberDescription:
    member_id: str
    client_id: str
    client_host: str
    metadata: bytes      # for the group's protocol; b"" unless the group is Stable (as Kafka)
    assignment: bytes    # b"" unless the group is Stable


@dataclass(frozen=True, slots=True)
class GroupDescription:
    group_id: str
    state: str
    protocol_type: str
    protocol_name: str   # "" unless the group is Stable (as Kafka's DescribeGroups)
    members: list        # [MemberDescription]


class ClassicGroups:
    def __init__(self, *, groups_max: int = GROUPS_MAX, members_max: int = GROUP_MEMBERS_MAX,
                 parked_max: int = PARKED_REQUESTS_MAX,
                 initial_rebalance_delay_ms: int = INITIAL_REBALANCE_DELAY_MS,
                 session_timeout_min_ms: int = SESSION_TIMEOUT_MIN_MS,
                 session_timeout_max_ms: int = SESSION_TIMEOUT_MAX_MS):
        self.groups_max = groups_max
        self.members_max = members_max
        self.parked_max = parked_max
        self.initial_delay_s = initial_rebalance_delay_ms / 1000
        self.session_min_ms = session_timeout_min_ms
        self.session_max_ms = session_timeout_max_ms
        self.groups: dict[str, Group] = {}
        self.rebalances = 0                       # generations formed, since start
        self._parked = ParkedRequests()
        self._deadlines = Deadlines()

    @property
    def parked(self) -> int:
        """JoinGroups and SyncGroups held now, forgotten ones not counted."""
        return self._parked.count

    # --- JoinGroup

    def join(self, group_id: str, member_id: str, client_id: str, client_host: str,
             session_timeout_ms: int, rebalance_timeout_ms: int, protocol_type: str,
             protocols: list[tuple[str, bytes]], require_known_member: bool, token,
             now: float) -> JoinResult | None:
        """A JoinGroup: its answer now, or None when parked under `token` (see take_ready).
        `require_known_member` for v4+; a v0 request passes its session timeout as
        `rebalance_timeout_ms`."""
        self.tick(now)
        args = Joining(client_id, client_host, session_timeout_ms, rebalance_timeout_ms,
                       protocol_type, protocols)
        error = _join_error(group_id, args, self.session_min_ms, self.session_max_ms)
        if error:
            return JoinResult(error, member_id=member_id)
        group = self.groups.get(group_id)
        if group is None and member_id:
            return JoinResult(UNKNOWN_MEMBER_ID, member_id=member_id)
        if group is not None and not _supports(group, member_id, protocol_type, protocols):
            return JoinResult(INCONSISTENT_GROUP_PROTOCOL, member_id=member_id)
        if self.parked >= self.parked_max:
            return JoinResult(COORDINATOR_NOT_AVAILABLE, member_id=member_id)
        group = group or self._new_group(group_id)
        if group is None:
            return JoinResult(COORDINATOR_NOT_AVAILABLE, member_id=member_id)
        if not member_id:
            return self._join_new(group, require_known_member, args, token, now)
        if group.pending.pop(member_id, None) is not None:
            member = group.add_member(member_id, args)
            return self._update_and_rebalance(group, member, args, token, now, new=True)
        member = group.members.get(member_id)
        if member is None:
            return JoinResult(UNKNOWN_MEMBER_ID, member_id=member_id)
        return self._rejoin(group, member, args, token, now)

    def _new_group(self, group_id: str) -> Group | None:
        """A new Empty group, making room by forgetting an Empty one; None when all are busy."""
        if len(self.groups) >= self.groups_max:
            idle = next((g for g in self.groups.values() if g.forgettable()), None)
            if idle is None:
                return None
            del self.groups[idle.group_id]
        group = self.groups[group_id] = Group(group_id)
        return group

    def _join_new(self, group: Group, require_known_member: bool, args: Joining, token,
                  now: float) -> JoinResult | None:
        if group.size() >= self.members_max:
            return JoinResult(GROUP_MAX_SIZE_REACHED)
        member_id = f"{args.client_id}-{uuid.uuid4()}"
        if not require_known_member:
            member = group.add_member(member_id, args)
            return self._update_and_rebalance(group, member, args, token, now, new=True)
        expires_at = now + args.session_timeout_ms / 1000
        group.pending[member_id] = expires_at
        self._deadlines.schedule(group, expires_at)
        return JoinResult(MEMBER_ID_REQUIRED, member_id=member_id)

    def _rejoin(self, group: Group, member: Member, args: Joining, token,
                now: float) -> JoinResult | None:
        """A known member's JoinGroup: answered at once with the current generation when
        nothing changed (a follower of a Stable group, anyone while CompletingRebalance), else
        a rebalance."""
        same = args.protocols == member.protocols
        if group.state == COMPLETING and same or (
                group.state == STABLE and same and member.member_id != group.leader):
            self._start_session(group, member, now)
            return _join_result(group, member)
        return self._update_and_rebalance(group, member, args, token, now)

    def _update_and_rebalance(self, group: Group, member: Member, args: Joining, token,
                              now: float, new: bool = False) -> None:
        _update(group, member, args)
        member.joined = True
        if member.join_wait is not None:   # a retry on another connection: the old one gives up
            self._answer(member.join_wait, JoinResult(REBALANCE_IN_PROGRESS,
                                                      member_id=member.member_id), now)
        member.join_wait = self._parked.park(token, group, member)
        if group.state != PREPARING:
            self._prepare(group, now)
        elif new and group.initial_until is not None:
            self._deadlines.schedule(group, group.extend_initial_delay(now, self.initial_delay_s))
        if group.ready_to_form(now):
            self._complete_join(group, now)
        return None

    # --- rebalance

    def _prepare(self, group: Group, now: float) -> None:
        """Start a rebalance: held SyncGroups of the unfinished generation are answered 27."""
        for member in group.members.values():
            if member.sync_wait is not None:
                self._answer(member.sync_wait, SyncResult(REBALANCE_IN_PROGRESS), now)
        self._deadlines.schedule(group, group.begin_rebalance(now, self.initial_delay_s))

    def _complete_join(self, group: Group, now: float) -> None:
        """The rebalance ends: members that did not rejoin leave, a generation forms (or the
        group is Empty) and every held JoinGroup is answered."""
        for member in [m for m in group.members.values() if not m.joined]:
            self._drop(group, member, now)
        if not group.form_generation(now):
            return
        self.rebalances += 1
        self._deadlines.schedule(group, group.sync_deadline)
        for member in group.members.values():
            member.joined, member.synced, member.assignment = False, False, b""
            self._start_session(group, member, now)   # also of members whose join was forgotten
            if member.join_wait is not None:
                self._answer(member.join_wait, _join_result(group, member), now)

    # --- SyncGroup

    def sync(self, group_id: str, generation_id: int, member_id: str,
             assignments: list[tuple[str, bytes]], token, now: float,
             protocol_type: str | None = None,
             protocol_name: str | None = None) -> SyncResult | None:
        """A SyncGroup: its answer now, or None when parked under `token` until the leader's
        arrives. `protocol_type`/`protocol_name` (v5+) are checked when given."""
        self.tick(now)
        group = self.groups.get(group_id)
        member = group.members.get(member_id) if group is not None else None
        if member is None:
            return SyncResult(UNKNOWN_MEMBER_ID)
        error = _sync_error(group, generation_id, protocol_type, protocol_name)
        if error:
            return SyncResult(error)
        if group.state == STABLE:
            member.synced = True
            group.close_sync_if_all_synced()
            self._start_session(group, member, now)
            return _sync_result(group, member)
        if self.parked >= self.parked_max:
            return SyncResult(COORDINATOR_NOT_AVAILABLE)
        member.synced = True
        if member.sync_wait is not None:
            self._answer(member.sync_wait, SyncResult(REBALANCE_IN_PROGRESS), now)
        member.sync_wait = self._parked.park(token, group, member)
        if member_id == group.leader:
            self._assign(group, assignments, now)
        return None

    def _assign(self, group: Group, assignments: list[tuple[str, bytes]], now: float) -> None:
        """The leader's SyncGroup: every member gets its assignment (b"" if the leader gave it
        none) and the group is Stable."""
        given = dict(assignments)
        group.state = STABLE
        for member in group.members.values():
            member.assignment = bytes(given.get(member.member_id, b""))
            if member.sync_wait is not None:
                self._answer(member.sync_wait, _sync_result(group, member), now)
        group.close_sync_if_all_synced()

    # --- Heartbeat, LeaveGroup, OffsetCommit

    def heartbeat(self, group_id: str, generation_id: int, member_id: str, now: float) -> int:
        """A Heartbeat's error code; REBALANCE_IN_PROGRESS tells the member to rejoin."""
        self.tick(now)
        group = self.groups.get(group_id)
        member = group.members.get(member_id) if group is not None else None
        if member is None:
            return UNKNOWN_MEMBER_ID
        if generation_id != group.generation:
            return ILLEGAL_GENERATION
        member.expires_at = now + member.session_s
        return REBALANCE_IN_PROGRESS if group.state == PREPARING else NONE

    def leave(self, group_id: str, member_ids: list[str], now: float) -> list[tuple[str, int]]:
        """A LeaveGroup: (member id, error code) for each; the group rebalances without them."""
        self.tick(now)
        group = self.groups.get(group_id)
        if group is None:
            return [(member_id, UNKNOWN_MEMBER_ID) for member_id in member_ids]
        answers = [(member_id, self._leave_one(group, member_id, now))
                   for member_id in member_ids]
        if any(error == NONE for _, error in answers):
            self._after_departures(group, now)
        return answers

    def _leave_one(self, group: Group, member_id: str, now: float) -> int:
        if group.pending.pop(member_id, None) is not None:
            return NONE
        member = group.members.get(member_id)
        if member is None:
            return UNKNOWN_MEMBER_ID
        self._drop(group, member, now)
        return NONE

    def commit_allowed(self, group_id: str, generation_id: int, member_id: str,
                       now: float | None = None) -> int:
        """Whether an OffsetCommit may store its offsets (0) or its error code. A commit with
        no generation (< 0) and no member id is a simple consumer's or a tool's: allowed while
        the group has no members. A member's allowed commit counts as a heartbeat when `now`
        is given, as in Kafka."""
        group = self.groups.get(group_id)
        if generation_id < 0 and not member_id:
            return NONE if group is None or group.state == EMPTY else UNKNOWN_MEMBER_ID
        if group is None:
            return ILLEGAL_GENERATION if generation_id >= 0 else UNKNOWN_MEMBER_ID
        member = group.members.get(member_id)
        if member is None:
            return UNKNOWN_MEMBER_ID
        if generation_id != group.generation:
            return ILLEGAL_GENERATION
        if group.state == COMPLETING:
            return REBALANCE_IN_PROGRESS
        if now is not None:
            member.expires_at = max(member.expires_at, now + member.session_s)
        return NONE

    # --- DescribeGroups, ListGroups, DeleteGroups

    def describe(self, group_id: str) -> GroupDescription:
        """As Kafka's DescribeGroups: an unknown group is Dead with no members."""
        group = self.groups.get(group_id)
        if group is None:
            return GroupDescription(group_id, DEAD, "", "", [])
        stable = group.state == STABLE
        protocol = group.protocol_name if stable else None
        members = [MemberDescription(m.member_id, m.client_id, m.client_host,
                                     m.metadata(protocol), m.assignment if stable else b"")
                   for m in group.members.values()]
        return GroupDescription(group_id, group.state, group.protocol_type, protocol or "",
                                members)

    def subscribed(self, group_id: str) -> set[str] | None:
        """Topics the group's members subscribe to (every protocol each lists: any of them may
        be chosen), empty for a group with no members; None when the group has members of
        another protocol type than "consumer", whose bytes say nothing of topics (Kafka's
        OffsetDelete then refuses: NON_EMPTY_GROUP)."""
        group = self.groups.get(group_id)
        if group is None or not group.members:
            return set()
        if group.protocol_type != "consumer":
            return None
        return {t for m in group.members.values() for _, meta in m.protocols
                for t in subscribed_topics(meta)}

    def list(self) -> list[tuple[str, str, str]]:
        """(group id, protocol type, state) of every group held."""
        return [(g.group_id, g.protocol_type, g.state) for g in self.groups.values()]

    def delete(self, group_id: str) -> int:
        group = self.groups.get(group_id)
        if group is None:
            return GROUP_ID_NOT_FOUND
        if group.members:
            return NON_EMPTY_GROUP
        del self.groups[group_id]
        return NONE

    # --- time and parked requests

    def tick(self, now: float) -> None:
        """Apply what has expired by `now`: silent members, rebalances and syncs whose time is
        up, member ids handed out and not used."""
        for group in self._deadlines.due(now):
            if self.groups.get(group.group_id) is group:   # else deleted or forgotten since
                self._expire(group, now)

    def next_deadline(self) -> float | None:
        """When `tick` has something to do next (it may find nothing: a heartbeat moved it)."""
        return self._deadlines.next()

    def take_ready(self, now: float) -> list[tuple[object, JoinResult | SyncResult]]:
        """(token, answer) of the parked requests answered by `now`, in the order answered."""
        self.tick(now)
        return self._parked.take()

    def forget_token(self, token) -> None:
        """The connection of `token` closed: its parked requests are never answered. Their
        members stay held, as in Kafka (which cannot tell): the member may come back on
        another connection, and the rebalance or sync timeout bounds the wait."""
        self._parked.forget(token)

    def stats(self) -> dict:
        return {"kafka_groups": len(self.groups), "kafka_groups_parked": self.parked,
                "kafka_groups_rebalances": self.rebalances}

    # --- internals

    def _expire(self, group: Group, now: float) -> None:
        group.expire_pending(now)
        silent = group.silent_members(now)
        for member in silent:
            self._drop(group, member, now)
        if silent:
            self._after_departures(group, now)
        if group.state == PREPARING and group.join_deadline <= now:
            self._complete_join(group, now)
        late = group.late_to_sync(now)   # did not sync within the rebalance timeout: they leave
        for member in late:
            self._drop(group, member, now)
        if late:
            self._after_departures(group, now)
        if group.ready_to_form(now):   # a pending id that expired may have held it
            self._complete_join(group, now)
        when = group.next_expiry()
        if when is not None:
            self._deadlines.schedule(group, when)

    def _after_departures(self, group: Group, now: float) -> None:
        if group.state in (STABLE, COMPLETING):
            self._prepare(group, now)
        if group.ready_to_form(now):
            self._complete_join(group, now)

    def _drop(self, group: Group, member: Member, now: float) -> None:
        """Remove a member; its held requests are answered UNKNOWN_MEMBER_ID."""
        del group.members[member.member_id]
        if member.join_wait is not None:
            self._answer(member.join_wait, JoinResult(UNKNOWN_MEMBER_ID,
                                                      member_id=member.member_id), now)
        if member.sync_wait is not None:
            self._answer(member.sync_wait, SyncResult(UNKNOWN_MEMBER_ID), now)

    def _start_session(self, group: Group, member: Member, now: float) -> None:
        member.expires_at = now + member.session_s
        self._deadlines.schedule(group, member.expires_at)

    def _answer(self, parked: Parked, result: JoinResult | SyncResult, now: float) -> None:
        """Release a held request; its member's session starts again (as Kafka's)."""
        self._parked.answer(parked, result)
        member, group = parked.member, parked.group
        if group.members.get(member.member_id) is member:
            self._start_session(group, member, now)


def _join_error(group_id: str, args: Joining, session_min_ms: int, session_max_ms: int) -> int:
    if not group_id:
        return INVALID_GROUP_ID
    if not session_min_ms <= args.session_timeout_ms <= session_max_ms:
        return INVALID_SESSION_TIMEOUT
    if not args.protocol_type or not args.protocols:
        return INCONSISTENT_GROUP_PROTOCOL
    return NONE


def _join_result(group: Group, member: Member) -> JoinResult:
    members = []
    if member.member_id == group.leader:
        members = [(m.member_id, m.metadata(group.protocol_name))
                   for m in group.members.values()]
    return JoinResult(NONE, group.generation, group.protocol_type, group.protocol_name,
                      group.leader, member.member_id, members)


def _sync_result(group: Group, member: Member) -> SyncResult:
    return SyncResult(NONE, member.assignment, group.protocol_type, group.protocol_name)


def _update(group: Group, member: Member, args: Joining) -> None:
    """A member's JoinGroup replaces what it said before; the first member sets the type."""
    member.client_id, member.client_host = args.client_id, args.client_host
    member.session_s = args.session_timeout_ms / 1000
    rebalance_ms = args.rebalance_timeout_ms
    member.rebalance_s = (rebalance_ms if rebalance_ms > 0 else args.session_timeout_ms) / 1000
    member.protocols = [(name, bytes(meta)) for name, meta in args.protocols]
    if len(group.members) == 1:
        group.protocol_type = args.protocol_type


def _supports(group: Group, member_id: str, protocol_type: str, protocols: list) -> bool:
    """Whether a member can join: once the group has members, the same protocol type and a
    protocol every other member supports too."""
    others = [m for m in group.members.values() if m.member_id != member_id]
    if not others:
        return True
    if protocol_type != group.protocol_type:
        return False
    common = set.intersection(*({name for name, _ in m.protocols} for m in others))
    return any(name in common for name, _ in protocols)


def _sync_error(group: Group, generation_id: int, protocol_type: str | None,
                protocol_name: str | None) -> int:
    if generation_id != group.generation:
        return ILLEGAL_GENERATION
    if protocol_type is not None and protocol_type != group.protocol_type:
        return INCONSISTENT_GROUP_PROTOCOL
    if protocol_name is not None and protocol_name != group.protocol_name:
        return INCONSISTENT_GROUP_PROTOCOL
    return REBALANCE_IN_PROGRESS if group.state == PREPARING else NONE

