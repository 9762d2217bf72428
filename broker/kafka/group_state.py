"""What the classic consumer-group coordinator (kera.broker.kafka.classic_groups) holds between
calls: its groups and their members, the requests it holds for them, and when it must look at
a group next. Plain state and its bookkeeping: the decisions of the protocol (who is answered
what, when a rebalance starts) stay in classic_groups.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator, NamedTuple

EMPTY, PREPARING, COMPLETING, STABLE, DEAD = (
    "Empty", "PreparingRebalance", "CompletingRebalance", "Stable", "Dead")


class Joining(NamedTuple):
    """What a JoinGroup says of its member."""
    client_id: str
    client_host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: list[tuple[str, bytes]]


class Member:
    __slots__ = ("member_id", "client_id", "client_host", "session_s", "rebalance_s",
                 "protocols", "assignment", "expires_at", "joined", "synced",
                 "join_wait", "sync_wait")

    def __init__(self, member_id: str, client_id: str, client_host: str):
        self.member_id = member_id
        self.client_id = client_id
        self.client_host = client_host
        self.session_s = 0.0
        self.rebalance_s = 0.0
        self.protocols: list[tuple[str, bytes]] = []
        self.assignment = b""
        self.expires_at = 0.0        # session deadline, while not kept alive
        self.joined = False          # rejoined in the rebalance under way
        self.synced = True           # sent its SyncGroup for the current generation
        self.join_wait: Parked | None = None
        self.sync_wait: Parked | None = None

    def metadata(self, protocol: str | None) -> bytes:
        return next((meta for name, meta in self.protocols if name == protocol), b"")


class Group:
    """One group and the transitions of its own state; answering held requests and
    scheduling its deadlines are the coordinator's."""
    __slots__ = ("group_id", "state", "generation", "protocol_type", "protocol_name", "leader",
                 "members", "pending", "join_deadline", "initial_until", "rebalance_start",
                 "sync_deadline", "scheduled")

    def __init__(self, group_id: str):
        self.group_id = group_id
        self.state = EMPTY
        self.generation = 0
        self.protocol_type = ""
        self.protocol_name: str | None = None
        self.leader: str | None = None
        self.members: dict[str, Member] = {}      # in joining order: the first may lead
        self.pending: dict[str, float] = {}       # member id handed out -> when it expires
        self.join_deadline: float | None = None   # PreparingRebalance ends by then
        self.initial_until: float | None = None   # an empty group's first join held till then
        self.rebalance_start = 0.0
        self.sync_deadline: float | None = None   # members that did not sync by then leave
        self.scheduled: float | None = None       # earliest deadline in the heap for it

    def size(self) -> int:
        return len(self.members) + len(self.pending)

    def forgettable(self) -> bool:
        return self.state == EMPTY and not self.pending

    def add_member(self, member_id: str, args: Joining) -> Member:
        member = self.members[member_id] = Member(member_id, args.client_id, args.client_host)
        return member

    def kept_alive(self, member: Member) -> bool:
        """A member whose JoinGroup or SyncGroup is held is not timed out by its session."""
        return (self.state == PREPARING and member.joined) or member.sync_wait is not None

    def longest_rebalance(self) -> float:
        return max((m.rebalance_s for m in self.members.values()), default=0.0)

    # --- rebalance

    def begin_rebalance(self, now: float, initial_delay_s: float) -> float:
        """PreparingRebalance until the returned time: the longest rebalance timeout of the
        members, or the initial delay when the group was Empty."""
        initial = self.state == EMPTY
        self.state = PREPARING
        self.sync_deadline = None
        self.rebalance_start = now
        longest = self.longest_rebalance()
        delay = min(initial_delay_s, longest) if initial else longest
        self.join_deadline = now + delay
        self.initial_until = self.join_deadline if initial else None
        return self.join_deadline

    def extend_initial_delay(self, now: float, initial_delay_s: float) -> float:
        """A new member during the initial delay holds it open a while longer, never past the
        rebalance timeout; returns when to look again."""
        until = min(now + initial_delay_s, self.rebalance_start + self.longest_rebalance())
        self.initial_until = self.join_deadline = max(until, self.initial_until)
        return until

    def ready_to_form(self, now: float) -> bool:
        """Whether the rebalance can end now: every known member rejoined, no member id handed
        out is still unused, and the initial delay is over."""
        if self.state != PREPARING or self.pending:
            return False
        if self.initial_until is not None and now < self.initial_until:
            return False
        return all(m.joined for m in self.members.values())

    def form_generation(self, now: float) -> bool:
        """The rebalance ends with the members left: a new generation, its leader and
        protocol, CompletingRebalance until the sync deadline; False (and Empty) when none."""
        self.join_deadline = self.initial_until = None
        if not self.members:
            self.state, self.protocol_name, self.leader = EMPTY, None, None
            return False
        self.generation += 1
        if self.leader not in self.members:
            self.leader = next(iter(self.members))
        self.protocol_name = self.select_protocol()
        self.state = COMPLETING
        self.sync_deadline = now + self.longest_rebalance()
        return True

    def select_protocol(self) -> str:
        """Kafka's choice: among the protocols every member supports, the one most members list
        first; ties go to the leader's order of preference."""
        members = list(self.members.values())
        common = set.intersection(*({name for name, _ in m.protocols} for m in members))
        votes: dict[str, int] = {}
        for member in members:
            first = next(name for name, _ in member.protocols if name in common)
            votes[first] = votes.get(first, 0) + 1
        leader_order = [name for name, _ in self.members[self.leader].protocols
                        if name in common]
        return max(leader_order, key=lambda name: votes.get(name, 0))

    def close_sync_if_all_synced(self) -> None:
        if all(m.synced for m in self.members.values()):
            self.sync_deadline = None

    # --- expiry

    def expire_pending(self, now: float) -> None:
        for member_id in [m for m, until in self.pending.items() if until <= now]:
            del self.pending[member_id]

    def silent_members(self, now: float) -> list[Member]:
        return [m for m in self.members.values()
                if not self.kept_alive(m) and m.expires_at <= now]

    def late_to_sync(self, now: float) -> list[Member]:
        """Once the sync deadline has passed (and only once): the members that did not sync."""
        if self.sync_deadline is None or self.sync_deadline > now:
            return []
        self.sync_deadline = None
        return [m for m in self.members.values() if not m.synced]

    def next_expiry(self) -> float | None:
        """The earliest of its sessions, handed-out ids and rebalance or sync deadline."""
        times = [m.expires_at for m in self.members.values() if not self.kept_alive(m)]
        times.extend(self.pending.values())
        times.extend(t for t in (self.join_deadline, self.sync_deadline) if t is not None)
        return min(times, default=None)


class Parked:
    """One held JoinGroup or SyncGroup: the shell's token and the member it answers."""
    __slots__ = ("token", "group", "member", "forgotten")

    def __init__(self, token, group: Group, member: Member):
        self.token = token
        self.group = group
        self.member = member
        self.forgotten = False   # its connection closed: answered into the void


class ParkedRequests:
    """The held requests by the shell's token, their count, and the answers the shell has not
    taken yet (in the order answered)."""

    def __init__(self):
        self.count = 0
        self._by_token: dict[object, list[Parked]] = {}
        self._ready: list = []

    def park(self, token, group: Group, member: Member) -> Parked:
        parked = Parked(token, group, member)
        self._by_token.setdefault(token, []).append(parked)
        self.count += 1
        return parked

    def answer(self, parked: Parked, result) -> None:
        """Unhold `parked` from its member; its answer is ready unless its token was
        forgotten (already uncounted then)."""
        member = parked.member
        if member.join_wait is parked:
            member.join_wait = None
        if member.sync_wait is parked:
            member.sync_wait = None
        if parked.forgotten:
            return
        others = self._by_token[parked.token]
        others.remove(parked)
        if not others:
            del self._by_token[parked.token]
        self.count -= 1
        self._ready.append((parked.token, result))

    def forget(self, token) -> None:
        """Requests of `token` are still held but their answers are dropped."""
        for parked in self._by_token.pop(token, ()):
            parked.forgotten = True
            self.count -= 1

    def take(self) -> list:
        ready, self._ready = self._ready, []
        return ready


class Deadlines:
    """When each group needs a look next: a heap of (when, tiebreak, group). An entry is pushed
    only when earlier than the group's earliest one, so later entries go stale; a stale one
    costs a look that finds nothing, which is cheaper than removing it from the heap."""

    def __init__(self):
        self._heap: list = []
        self._tiebreak = itertools.count()   # groups do not compare: equal times never reach them

    def schedule(self, group: Group, when: float) -> None:
        if group.scheduled is None or when < group.scheduled:
            group.scheduled = when
            heapq.heappush(self._heap, (when, next(self._tiebreak), group))

    def due(self, now: float) -> Iterator[Group]:
        """Groups whose entries are due by `now`, popped lazily: a look may schedule more."""
        while self._heap and self._heap[0][0] <= now:
            group = heapq.heappop(self._heap)[2]
            group.scheduled = None
            yield group

    def next(self) -> float | None:
        return self._heap[0][0] if self._heap else None
