"""Consumer groups (KIP-848's shape): membership, assignment, commits. Sans-IO.

A group's members heartbeat to the coordinator; the coordinator owns membership and computes
the assignment. The unit of assignment is a *part*, a (stream, streamlet) pair: the unit kera
keeps a producer's order in. The group *epoch* moves on every membership, subscription or
stream-shape change; the *target* assignment is recomputed then (balanced per stream, sticky:
a part stays with its owner while that owner is within its share).

Members converge incrementally and a part never has two owners: a heartbeat reply grants a
member only target parts that no other member holds, where *holds* means granted to it or
still reported by it in its heartbeat's `owned`. A part moving from A to B is first dropped from
A's grant (A stops reading it, commits its position, and acknowledges by no longer listing it),
and only then granted to B, which starts from that commit: no duplicate, no gap.

Commits are accepted only from the member holding the part at its current member epoch
(StaleMemberEpoch otherwise; UnknownMember for a member the group removed): a zombie that
missed its session timeout cannot overwrite its successor's positions. A group without
members takes commits without a member id (tools, a Spark query's progress).

Static membership: a member joining with an `instance_id` held by another member takes that
member's place (its id, grant and epoch) without a rebalance; leaving with epoch -2 keeps the
place for the session timeout, so a process restarting quickly resumes its parts at once.

Only committed positions (and the group epoch) are persisted; membership is soft state that a
coordinator restart forgets: members get UnknownMember, rejoin, and resume from the commits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from kera.codec.name_pattern import PATTERN_CHARS_MAX, NamePattern
from kera.coordinator.validate import NAME_CHARS_MAX
from kera.errors import (BadRequest, GroupNotEmpty, NotAuthorized, StaleMemberEpoch,
                         UnknownMember)

JOIN_EPOCH = 0          # member_epoch of a join
LEAVE_EPOCH = -1        # member_epoch of a leave
STATIC_LEAVE_EPOCH = -2  # a static member leaving for a restart: its place is kept
# Session timeouts a member may ask for. The floor keeps a member with a heartbeat interval
# of HEARTBEAT_INTERVAL_MS alive through a few lost beats; the ceiling bounds how long a dead
# member's parts stay unread (Kafka's group.consumer.max.session.timeout.ms is 60 s).
SESSION_TIMEOUT_MS_MIN = 1_000
SESSION_TIMEOUT_MS_MAX = 60_000
SESSION_TIMEOUT_MS_DEFAULT = 10_000
# How often a settled member heartbeats; one that waits on a revocation (its own or another's)
# is asked back sooner so a handover takes a few round trips, not a few intervals.
HEARTBEAT_INTERVAL_MS = 1_000
CONVERGING_INTERVAL_MS = 50
# A settled member's interval is at most this share of its session timeout: a member fences
# itself at 0.8 of it without an answered heartbeat (kera.consumer.membership), so a short
# session still leaves room for three lost beats.
HEARTBEAT_SESSION_SHARE = 0.2

# Bounds a flood of joins cannot pass: each group costs ~1 KB plus its committed positions and
# each member ~0.5 KB plus its parts, so the coordinator's memory stays bounded (~100 MB at the
# worst) whatever clients send; far above what the deployments kera targets run (Kafka's
# default group.max.size is unbounded, but its brokers cap membership per group by config).
GROUPS_MAX = 10_000
MEMBERS_PER_GROUP_MAX = 1_000

Part = tuple[str, int]


@dataclass
class GroupMember:
    member_id: str
    instance_id: str | None
    streams: tuple[str, ...]
    session_timeout_s: float
    last_seen_s: float
    epoch: int = 0
    granted: set = field(default_factory=set)   # parts it may read now
    owned: set = field(default_factory=set)     # parts it reported still holding
    target: set = field(default_factory=set)    # parts the assignment gives it
    left: bool = False                          # a static member away for a restart
    pattern: NamePattern | None = None          # also every stream whose whole name matches
    # Whether the member's principal may read a stream: its subscription holds only those
    # (a pattern must not reveal or hold back streams ACLs hide from it). None: plaintext.
    may_read: Callable[[str], bool] | None = None

    def holds(self) -> set:
        return self.granted | self.owned


@dataclass
class Group:
    name: str
    epoch: int = 0
    members: dict[str, GroupMember] = field(default_factory=dict)
    committed: dict[Part, list[list]] = field(default_factory=dict)  # part -> [[g, off, ep]]
    shape: tuple = ()   # (members' subscriptions, parts) the target was computed for

    def holder(self, part: Part, besides: str | None = None) -> str | None:
        for mid, m in self.members.items():
            if mid != besides and part in m.holds():
                return mid
        return None


class Groups:
    """Every consumer group of the cluster. `streamlets_of(stream) -> int | None` is the
    coordinator's view of a stream's shape (None: no such stream); `stream_names()` lists the
    streams, for pattern subscriptions."""

    def __init__(self, streamlets_of, stream_names=tuple, id_source=None):
        self.groups: dict[str, Group] = {}
        self.streamlets_of, self.stream_names = streamlets_of, stream_names
        self._id_source = id_source or (lambda: os.urandom(8).hex())
        self.dirty = False   # committed positions changed since take_dirty()
        # Membership is soft state: after a coordinator restart, members of the previous
        # incarnation may still hold parts until they notice (a heartbeat answered
        # unknown_member, or their own fence at 0.8 of their session timeout). So no part is
        # granted before `grants_after_s`: the start plus the longest session timeout any
        # member has had (`session_max_ms`, persisted).
        self.session_max_ms = 0
        self.grants_after_s = float("-inf")
        self.changes = 0     # counts changes of committed positions (consumption retention)
        # Names Kafka-protocol groups hold (kera.coordinator.kafka_offsets): a group is used by
        # one protocol at a time.
        self.foreign_names = frozenset

    # ------------------------------------------------------------------ membership
    def heartbeat(self, name: str, member_id: str, member_epoch: int, now: float, *,
                  streams=(), owned=(), instance_id: str | None = None, pattern: str | None = None,
                  session_timeout_ms: int = SESSION_TIMEOUT_MS_DEFAULT,
                  may_read: Callable[[str], bool] | None = None) -> dict:
        group = self.groups.get(name)
        if may_read is not None:
            streams = [s for s in streams if may_read(s)]
        if member_epoch == JOIN_EPOCH and not member_id:
            group = self._group_for_writes(name)
            member = self._join(group, instance_id, tuple(streams), session_timeout_ms, now,
                                pattern)
            member.may_read = may_read
        else:
            member = self._member(group, name, member_id)
            if member_epoch in (LEAVE_EPOCH, STATIC_LEAVE_EPOCH):
                return self._leave(group, member, member_epoch == STATIC_LEAVE_EPOCH)
            if member_epoch > member.epoch:
                raise StaleMemberEpoch(f"member {member_id} of group '{name}' claims epoch "
                                       f"{member_epoch}, never issued (its epoch is {member.epoch})")
            member.streams = tuple(streams) or member.streams
        member.last_seen_s, member.left = now, False
        member.owned = set(map(_part, owned)) & member.holds()
        self._reshape(group)
        self._reconcile(group, member, now)
        return self._reply(group, member)

    def check_committer(self, name: str, member_id: str | None, member_epoch: int,
                        positions) -> None:
        """Whether `member_id` at `member_epoch` may commit `positions` (parts) for the group
        now (a commit's checks, also those of positions joining a transaction): its current
        epoch and parts; without a member id, only while the group has no live member."""
        group = self.groups.get(name)
        if member_id:
            member = self._member(group, name, member_id)
            if member_epoch != member.epoch:
                raise StaleMemberEpoch(f"positions from member {member_id} of group '{name}' at "
                                       f"epoch {member_epoch}; its epoch is {member.epoch}: "
                                       f"heartbeat, then send them again")
            foreign = sorted(p for p in positions if p not in member.holds())
            if foreign:
                raise StaleMemberEpoch(f"member {member_id} of group '{name}' does not hold "
                                       f"{foreign} (revoked or never assigned)")
        elif group is not None and group.members:
            raise GroupNotEmpty(f"group '{name}' has {len(group.members)} live members: only "
                                f"they commit; pass their member id, or stop them first")

    def _member(self, group: Group | None, name: str, member_id: str) -> GroupMember:
        member = group.members.get(member_id) if group is not None else None
        if member is None:
            raise UnknownMember(f"member {member_id!r} is not in group '{name}' (it missed its "
                                f"session timeout or left): rejoin")
        return member

    def _join(self, group: Group, instance_id, streams, session_timeout_ms, now,
              pattern: str | None) -> GroupMember:
        if not streams and pattern is None:
            raise BadRequest("a member joining a group must subscribe to at least one stream "
                             "or a pattern")
        if not SESSION_TIMEOUT_MS_MIN <= session_timeout_ms <= SESSION_TIMEOUT_MS_MAX:
            raise BadRequest(f"session_timeout_ms={session_timeout_ms} is outside "
                             f"[{SESSION_TIMEOUT_MS_MIN}, {SESSION_TIMEOUT_MS_MAX}]")
        if len(group.members) >= MEMBERS_PER_GROUP_MAX:
            raise BadRequest(f"group '{group.name}' has {MEMBERS_PER_GROUP_MAX} members, the "
                             f"most one group may have: use another group or fewer consumers")
        member = GroupMember(self._id_source(), instance_id, streams, session_timeout_ms / 1000,
                             now, pattern=None if pattern is None else NamePattern(pattern))
        if session_timeout_ms > self.session_max_ms:
            self.session_max_ms = session_timeout_ms   # persisted before the reply goes
            self.dirty = True
        previous = next((m for m in group.members.values()
                         if instance_id is not None and m.instance_id == instance_id), None)
        if previous is not None:
            # The restarted static member takes its predecessor's place: same parts, same
            # epoch, no rebalance; the predecessor is fenced (its id is gone).
            del group.members[previous.member_id]
            member.epoch, member.target = previous.epoch, previous.target
            member.granted = previous.holds()
        group.members[member.member_id] = member
        return member

    def _leave(self, group: Group, member: GroupMember, static: bool) -> dict:
        if static and member.instance_id is not None:
            member.left = True    # its place is kept until its session timeout
        else:
            del group.members[member.member_id]
            self._forget_if_unused(group)
        return {"member_id": member.member_id, "member_epoch": LEAVE_EPOCH,
                "group_epoch": group.epoch, "assignment": [], "heartbeat_interval_ms": 0}

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Remove members silent past their session timeout; returns (group, member id)."""
        gone = []
        for group in self.groups.values():
            for mid, m in list(group.members.items()):
                if now - m.last_seen_s > m.session_timeout_s:
                    del group.members[mid]
                    gone.append((group.name, mid))
        for name in {g for g, _ in gone}:
            self._forget_if_unused(self.groups[name])
        return gone

    def _forget_if_unused(self, group: Group) -> None:
        """A group without members or commits is nothing to keep (a join that came to naught)."""
        if not group.members and not group.committed:
            del self.groups[group.name]

    def _group_for_writes(self, name: str) -> Group:
        group = self.groups.get(name)
        if group is None:
            if name in self.foreign_names():
                raise BadRequest(f"group {name!r} is a Kafka consumer group (its offsets were "
                                 f"committed through the Kafka listener): a group is used by "
                                 f"one protocol at a time; use another group name")
            if len(self.groups) >= GROUPS_MAX:
                raise BadRequest(f"the cluster has {GROUPS_MAX} consumer groups, the most it "
                                 f"keeps: delete unused ones (kera group delete)")
            group = self.groups[name] = Group(name)
        return group

    # ------------------------------------------------------------------ assignment
    def _parts(self, streams) -> list[Part]:
        return [(s, sl) for s in sorted(streams) for sl in range(self.streamlets_of(s) or 0)]

    def _reshape(self, group: Group) -> None:
        """A new epoch and target when members, subscriptions or streams changed."""
        names = list(self.stream_names()) if any(
            m.pattern for m in group.members.values()) else []
        wanted = {mid: self._subscription(m, names) for mid, m in group.members.items()}
        # A static member counts by its instance id: its restart is not a membership change.
        subs = tuple(sorted((m.instance_id or mid, wanted[mid])
                            for mid, m in group.members.items()))
        streams = {s for subscribed in wanted.values() for s in subscribed}
        shape = (subs, tuple(self._parts(streams)))
        if shape == group.shape:
            return
        group.shape = shape
        group.epoch += 1
        targets = assign_parts(shape[1], wanted,
                               {mid: m.target for mid, m in group.members.items()})
        for mid, m in group.members.items():
            m.target = targets[mid]

    @staticmethod
    def _subscription(member: GroupMember, names) -> tuple[str, ...]:
        if member.pattern is None:
            return member.streams
        matched = member.pattern.select(names)
        if member.may_read is not None:
            matched = [n for n in matched if member.may_read(n)]
        return tuple(sorted(set(member.streams) | set(matched)))

    def _reconcile(self, group: Group, member: GroupMember, now: float) -> None:
        kept = member.granted & member.target
        free = {p for p in member.target - kept if group.holder(p, member.member_id) is None}
        if now < self.grants_after_s:
            free = set()   # a previous incarnation's members may still hold them
        member.granted = kept | free
        if member.granted == member.target and member.owned <= member.target:
            member.epoch = group.epoch

    def _reply(self, group: Group, member: GroupMember) -> dict:
        waiting = member.epoch != group.epoch or any(
            m.epoch != group.epoch for m in group.members.values())
        granted = sorted(member.granted)
        return {"member_id": member.member_id, "member_epoch": member.epoch,
                "group_epoch": group.epoch, "assignment": [list(p) for p in granted],
                "positions": [[s, sl, group.committed[(s, sl)]] for s, sl in granted
                              if (s, sl) in group.committed],
                "heartbeat_interval_ms": CONVERGING_INTERVAL_MS if waiting
                else min(HEARTBEAT_INTERVAL_MS,
                         int(member.session_timeout_s * 1000 * HEARTBEAT_SESSION_SHARE))}

    # ------------------------------------------------------------------ commits
    def commit(self, name: str, member_id: str | None, member_epoch: int, positions) -> None:
        """Record `positions` ({part: [[group, offset, epoch], ...]}) for the group."""
        self.check_committer(name, member_id, member_epoch, positions)
        group = self._group_for_writes(name)
        group.committed.update(positions)
        self.dirty = True
        self.changes += 1

    def consumed_below(self, stream: str, streamlets: int) -> list[int]:
        """Per streamlet of `stream`, the group number below which every consumer group of
        the stream has consumed everything (the lowest group its committed position lists);
        0 where one of them has no commit there, or the stream has no consumer group at all.
        A consumer group of the stream: one with a commit on it or a member subscribed to it."""
        marks: list[int] | None = None
        for group in self.groups.values():
            parts = {sl: min(g for g, _off, _ep in pos)
                     for (s, sl), pos in group.committed.items() if s == stream}
            if not parts and not any(_subscribed(m, stream) for m in group.members.values()):
                continue
            mine = [parts.get(sl, 0) for sl in range(streamlets)]
            marks = mine if marks is None else [min(a, b) for a, b in zip(marks, mine)]
        return marks or [0] * streamlets

    def reset(self, name: str, positions, streams=()) -> None:
        """Replace the committed positions of an empty group: drop every part of `streams`,
        then record `positions`. A group not known yet is created (Kafka's reset-offsets
        does the same), so positions can be set before its first member starts."""
        if name in self.groups:
            self._empty(name)
        group = self._group_for_writes(name)
        for part in [p for p in group.committed if p[0] in set(streams)]:
            del group.committed[part]
        group.committed.update(positions)
        self.dirty = True
        self.changes += 1

    def delete(self, name: str) -> None:
        self._empty(name)
        del self.groups[name]
        self.dirty = True
        self.changes += 1

    def _empty(self, name: str) -> Group:
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"no consumer group '{name}' (`kera group list` shows them)")
        if group.members:
            raise GroupNotEmpty(f"group '{name}' has {len(group.members)} live members "
                                f"({', '.join(sorted(group.members))}): stop them first")
        return group

    # ------------------------------------------------------------------ views
    def describe(self, name: str) -> dict:
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"no consumer group '{name}' (`kera group list` shows them)")
        members = [{"member_id": m.member_id, "instance_id": m.instance_id, "epoch": m.epoch,
                    "streams": list(m.streams),
                    "pattern": m.pattern.text if m.pattern else None,
                    "assignment": [list(p) for p in sorted(m.granted)],
                    "pending": [list(p) for p in sorted(m.target - m.granted)]}
                   for _, m in sorted(group.members.items())]
        return {"group": name, "epoch": group.epoch, "state": _state(group),
                "members": members,
                "positions": [[s, sl, pos] for (s, sl), pos in sorted(group.committed.items())]}

    def summaries(self) -> list[dict]:
        return [{"group": g.name, "epoch": g.epoch, "state": _state(g),
                 "members": len(g.members), "parts_committed": len(g.committed)}
                for _, g in sorted(self.groups.items())]

    def take_dirty(self) -> bool:
        dirty, self.dirty = self.dirty, False
        return dirty

    # ------------------------------------------------------------------ persistence
    def to_state(self) -> list[dict]:
        return [{"name": g.name, "epoch": g.epoch,
                 "committed": [[s, sl, pos] for (s, sl), pos in sorted(g.committed.items())]}
                for _, g in sorted(self.groups.items())]

    def load(self, state: list[dict], now: float, session_max_ms: int | None = None) -> None:
        """Groups as `to_state` wrote them, loaded at `now` by a restarted coordinator: no
        part is granted for the longest session timeout (`session_max_ms`; unknown in older
        files, so the largest allowed) while the previous incarnation's members let go."""
        if session_max_ms is None:
            session_max_ms = SESSION_TIMEOUT_MS_MAX if state else 0
        self.session_max_ms = session_max_ms
        self.grants_after_s = now + session_max_ms / 1000
        for g in state:
            group = Group(str(g["name"]), int(g["epoch"]))
            group.committed = {(str(s), int(sl)): pos for s, sl, pos in g["committed"]}
            self.groups[group.name] = group


def _state(group: Group) -> str:
    if not group.members:
        return "empty"
    settled = all(m.epoch == group.epoch and m.granted == m.target for m in group.members.values())
    return "stable" if settled else "reconciling"


def _part(value) -> Part:
    stream, streamlet = value
    return str(stream), int(streamlet)


def assign_parts(parts, subscriptions: dict[str, tuple], previous: dict[str, set]) -> dict:
    """Target assignment: each stream's parts spread evenly over the members subscribed to it,
    a part staying with its previous owner while that owner is under its share."""
    out: dict[str, set] = {mid: set() for mid in subscriptions}
    by_stream: dict[str, list[Part]] = {}
    for part in parts:
        by_stream.setdefault(part[0], []).append(part)
    for index, (stream, stream_parts) in enumerate(sorted(by_stream.items())):
        members = sorted(mid for mid, subs in subscriptions.items() if stream in subs)
        if members:
            _spread(stream_parts, members, index, previous, out)
    return out


def _spread(parts, members, rotation, previous, out) -> None:
    base, extra = divmod(len(parts), len(members))
    # The members getting one more part rotate with the stream, so that over many streams
    # of a few streamlets the load evens out instead of piling on the first member.
    caps = {mid: base + (1 if (i - rotation) % len(members) < extra else 0)
            for i, mid in enumerate(members)}
    counts = dict.fromkeys(members, 0)
    left = []
    for part in parts:
        owner = next((mid for mid in members if part in previous.get(mid, ())), None)
        if owner is not None and counts[owner] < caps[owner]:
            out[owner].add(part)
            counts[owner] += 1
        else:
            left.append(part)
    for part in left:
        mid = min(members, key=lambda m: (counts[m] - caps[m], m))
        out[mid].add(part)
        counts[mid] += 1


# ---------------------------------------------------------------------- the coordinator's ops
GROUP_NAME_CHARS_MAX = 255       # Kafka's group.id bound
MEMBER_ID_CHARS_MAX = 64         # ours are 16 hex characters
STREAMS_PER_MEMBER_MAX = 4096    # streams one consumer subscribes to
PARTS_PER_REQUEST_MAX = 65536    # parts in one heartbeat's `owned` or one commit
GROUPS_PER_POSITION_MAX = 4096   # groups listed in one part's position (positions() lists
                                 # every group from the lowest unfinished one up)


def ops(groups: Groups, caller_may_read: Callable[[], Callable[[str], bool] | None]) -> dict:
    """Request handlers of the group ops, for Coordinator.handle: (Fields, now) -> reply.
    `caller_may_read()`: for the request being handled, whether its principal may read a
    stream (None in plaintext): subscriptions hold and commits name only such streams."""
    def name(f):
        return f.str("group", hi=GROUP_NAME_CHARS_MAX)

    def heartbeat(f, now):
        return groups.heartbeat(
            name(f), f.str("member_id", "", hi=MEMBER_ID_CHARS_MAX),
            f.int("member_epoch", lo=STATIC_LEAVE_EPOCH, hi=2**62), now,
            streams=[_name(s) for s in f.list("streams", [], STREAMS_PER_MEMBER_MAX)],
            owned=[_part_field(p) for p in f.list("owned", [], PARTS_PER_REQUEST_MAX)],
            instance_id=f.str("instance_id", None, hi=GROUP_NAME_CHARS_MAX),
            pattern=f.str("pattern", None, hi=PATTERN_CHARS_MAX),
            session_timeout_ms=f.int("session_timeout_ms", SESSION_TIMEOUT_MS_DEFAULT),
            may_read=caller_may_read())

    def commit(f, now):
        positions = _positions(f)
        check_readable(caller_may_read(), {s for s, _sl in positions}, name(f))
        groups.commit(name(f), f.str("member_id", "", hi=MEMBER_ID_CHARS_MAX),
                      f.int("member_epoch", 0, lo=0, hi=2**62), positions)
        return {}

    def offsets(f, now):
        group = groups.groups.get(name(f))
        committed = group.committed if group is not None else {}
        return {"positions": [[s, sl, pos] for (s, sl), pos in sorted(committed.items())]}

    def reset(f, now):
        streams = [_name(s) for s in f.list("streams", [], STREAMS_PER_MEMBER_MAX)]
        groups.reset(name(f), _positions(f), streams)
        return {}

    def delete(f, now):
        groups.delete(name(f))
        return {}

    return {"group_heartbeat": heartbeat, "group_commit": commit, "group_offsets": offsets,
            "group_list": lambda f, now: {"groups": groups.summaries()},
            "group_describe": lambda f, now: groups.describe(name(f)),
            "group_reset": reset, "group_delete": delete}


def _name(value, hi: int = NAME_CHARS_MAX) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= hi:
        raise BadRequest(f"a stream name must be a string of 1 to {hi} characters, not {value!r}")
    return value


def check_readable(may_read: Callable[[str], bool] | None, streams, group: str) -> None:
    """A commit on a stream its principal cannot read would hold back that stream's
    retain-until-consumed retention: refused."""
    hidden = sorted(s for s in streams if may_read is not None and not may_read(s))
    if hidden:
        raise NotAuthorized(f"group '{group}': this principal may not read stream(s) {hidden} "
                            f"and so may not commit positions on them")


def _subscribed(member: GroupMember, stream: str) -> bool:
    return stream in member.streams or (
        member.pattern is not None and member.pattern.matches(stream)
        and (member.may_read is None or member.may_read(stream)))


def _part_field(value) -> Part:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)
            and not isinstance(value[1], bool) and value[1] >= 0):
        raise BadRequest(f"a part is [stream, streamlet], not {value!r}")
    return _name(value[0]), value[1]


def _positions(f) -> dict[Part, list[list]]:
    out = {}
    for entry in f.list("positions", [], PARTS_PER_REQUEST_MAX):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list)
                and 0 < len(entry[2]) <= GROUPS_PER_POSITION_MAX):
            raise BadRequest("positions are [stream, streamlet, [[group, offset, epoch], ...]]")
        out[_part_field(entry[:2])] = [group_position(g) for g in entry[2]]
    return out


def group_position(value) -> list:
    """A group position from the wire, checked: [group, offset, history epoch or None]."""
    ok = (isinstance(value, list) and len(value) == 3
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value[:2])
          and (value[2] is None or (isinstance(value[2], int) and value[2] >= 0)))
    if not ok:
        raise BadRequest(f"a group position is [group, offset, epoch or null], not {value!r}")
    return list(value)
