"""A consumer's membership in a consumer group: heartbeats, assignment, commits. Sans-IO.

`Membership` is a task the consumer's request thread drives (kera.consumer.tasks): it joins
the group through the coordinator, heartbeats at the interval the coordinator asks for, and
applies each reply's assignment to the consumer through a narrow interface (`Assignable`):
revoked parts are unassigned first, their exact positions committed, and only then does the
next heartbeat stop listing them (the acknowledgement that lets the coordinator grant them to
another member, which starts from that commit: no duplicate, no gap). Granted parts are
assigned from the group's committed positions, else from the consumer's `start`.

Commits: `commit(positions)` queues one (a Future resolves with the outcome); auto-commit
queues the positions of what the application has been handed every `auto_commit_interval_ms`.
Fenced (UnknownMember: the member missed its session timeout) it drops every part without
committing (their new owners resume from the last commit) and joins again. It also fences
itself: when no heartbeat sent in the last SELF_FENCE_FRACTION of its session timeout has been
answered (the coordinator is unreachable, or replies are lost), the coordinator may be about
to expire it and grant its parts to others, so it drops them first. The coordinator's session
clock starts at a heartbeat's arrival, never before its sending, so a member that drops its
parts within that fraction of the timeout after sending its last answered heartbeat has let
them go before anyone else can be granted them: a part never has two owners, even across a
partition.

Subscription (confluent-kafka's subscribe / unsubscribe): `subscribe(streams, pattern)` changes
what the next heartbeat asks the group for, and the group rebalances (parts of streams dropped
are revoked as above). A pattern is fixed at join, so a changed pattern (or streams dropped to
none beside it) leaves the group and joins again. `unsubscribe()` revokes every part, commits
their positions and leaves: the member holds nothing and sends nothing until subscribed again.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from typing import Callable, NamedTuple, Protocol

from kera.codec.name_pattern import PATTERN_CHARS_MAX
from kera.net.coordinators import CoordinatorList
from kera.errors import (BadRequest, KeraError, NotAuthorized, StaleMemberEpoch, Timeout,
                         UnknownMember)
from kera.codec.position import Position

log = logging.getLogger(__name__)

# After a failed heartbeat (coordinator unreachable or restarting), the next try: soon enough
# to stay well inside a session timeout, slow enough not to spin.
RETRY_BACKOFF_S = 0.2
LEAVE_EPOCH, STATIC_LEAVE_EPOCH = -1, -2
# Of the session timeout, how long after sending its last answered heartbeat a member keeps its
# parts: the rest is margin for the two clocks' rates and the loop's lateness.
SELF_FENCE_FRACTION = 0.8
# A commit failed by a retriable error (a coordinator leader change: not_leader, a timeout) is
# retried every RETRY_BACKOFF_S for at most this fraction of the session timeout from its first
# failure. Heartbeats wait meanwhile (commits go before heartbeats, so a revocation's commit
# lands before the revocation is acknowledged); the fraction leaves the session time to be
# renewed afterwards, before the self-fence.
COMMIT_RETRY_FRACTION = 0.4
# Heartbeat refusals that retrying cannot cure: the principal lacks the group's ACL, or the
# request itself is refused (a pattern the coordinator cannot match).
FATAL_HEARTBEAT_ERRORS = (NotAuthorized, BadRequest)


class PendingCommit(NamedTuple):
    wire: list                      # positions_to_wire
    future: Future | None           # None: an auto or revocation commit nobody waits on
    retry_until_s: float | None = None   # set at its first failure


class GroupMetadata(NamedTuple):
    """A member's identity in its group (Kafka's ConsumerGroupMetadata): what a transactional
    producer sends with the positions it joins, so that a member fenced by a rebalance cannot
    commit them (KIP-447). `member_id` is "" before the first join."""
    group: str
    member_id: str
    member_epoch: int


class Assignable(Protocol):
    def assign(self, parts, positions=None) -> None: ...

    def unassign(self, parts) -> list[Position]: ...

    def assignment(self) -> list[tuple[str, int]]: ...

    def positions(self, parts=None) -> list[Position]: ...


def subscription(streams) -> tuple[list[str], str | None]:
    """(stream names, pattern) of a confluent-kafka subscription: a name or a list; entries
    starting with "^" are regular expressions (librdkafka's convention), joined into one."""
    entries = [streams] if isinstance(streams, str) else list(streams)
    bad = [e for e in entries if not isinstance(e, str) or not e]
    if bad:
        raise BadRequest(f"subscribe() takes stream names, not {bad[0]!r}")
    names = list(dict.fromkeys(e for e in entries if not e.startswith("^")))
    regexes = [e for e in entries if e.startswith("^")]
    if not regexes:
        return names, None
    pattern = regexes[0] if len(regexes) == 1 else "|".join(f"(?:{r})" for r in regexes)
    if len(pattern) > PATTERN_CHARS_MAX:
        raise BadRequest(f"the patterns {regexes} make one of {len(pattern)} characters, more "
                         f"than {PATTERN_CHARS_MAX}: subscribe to one shorter pattern")
    return names, pattern


def positions_to_wire(positions: list[Position]) -> list[list]:
    """Positions (any parts, several groups each) as group_commit's [stream, sl, [[g, off, ep]]]."""
    by_part: dict[tuple[str, int], list[list]] = {}
    for p in positions:
        by_part.setdefault((p.stream, p.streamlet), []).append([p.group, p.offset, p.epoch])
    return [[s, sl, groups] for (s, sl), groups in sorted(by_part.items())]


def positions_from_wire(entries) -> list[Position]:
    return [Position(s, sl, g, off, ep) for s, sl, groups in entries for g, off, ep in groups]


class Membership:
    def __init__(self, consumer: Assignable, coordinator: str | CoordinatorList, group: str,
                 streams, now: float,
                 *, instance_id: str | None = None, pattern: str | None = None,
                 session_timeout_ms: int = 10_000,
                 auto_commit_interval_ms: int | None = 5_000,
                 on_fatal: Callable[[KeraError], None] | None = None):
        self.consumer, self.group = consumer, group
        # Called once with an error retrying cannot cure (no ACL for the group, a pattern the
        # coordinator refuses): the consumer raises it from poll, as confluent-kafka surfaces
        # GROUP_AUTHORIZATION_FAILED, instead of retrying forever.
        self.on_fatal = on_fatal
        self.failed: KeraError | None = None
        # The leader of these (kera.net.coordinators): a standby's `not_leader` moves on to the next.
        self.coordinators = CoordinatorList(coordinator) if isinstance(coordinator, str) else coordinator
        self.asked = ""   # the coordinator the request in flight went to
        self.streams = list(streams)
        self.instance_id, self.session_timeout_ms = instance_id, session_timeout_ms
        self.pattern = pattern   # the coordinator adds every stream whose name matches
        self.auto_commit_s = None if auto_commit_interval_ms is None else auto_commit_interval_ms / 1000
        self.member_id, self.member_epoch = "", 0
        self.next_beat_s = now
        self.next_auto_commit_s = now + (self.auto_commit_s or 0)
        self.commits: list[PendingCommit] = []   # queued, oldest first
        self.commit_retry_at_s = now              # a failed commit's next try, not before
        self.inflight: tuple[str, PendingCommit | None] | None = None
        self.last_auto_commit: list | None = None
        self.joined = Future()   # resolves once the first assignment is applied
        self.beat_sent_s = now   # when the heartbeat in flight was sent
        self.answered_s = now    # when the last answered heartbeat was sent
        # Leaving the group (unsubscribe, or a new pattern): revoke, commit, then a leave
        # heartbeat; joins again afterwards if subscribed (module doc).
        self.leaving = False
        if not self.subscribed():
            self.next_beat_s = math.inf   # nothing to ask for until subscribe()

    # ------------------------------------------------------------------ the task protocol
    def check(self, now: float) -> None:
        """Fence itself once its session may have ended at the coordinator (module doc)."""
        if self.member_id and now >= self._fence_at():
            self._fenced(UnknownMember(f"no heartbeat answered for "
                                       f"{now - self.answered_s:.1f} s of a "
                                       f"{self.session_timeout_ms} ms session"), now)

    def check_wake(self, now: float) -> float | None:
        return self._fence_at() if self.member_id else None

    def next_request(self, now: float):
        self.check(now)
        if self.member_id and self.auto_commit_s is not None and now >= self.next_auto_commit_s:
            self.next_auto_commit_s = now + self.auto_commit_s
            held = positions_to_wire(self.consumer.positions())
            if held and held != self.last_auto_commit:   # nothing consumed since: no write
                self.last_auto_commit = held
                self.commits.append(PendingCommit(held, None))
        if self.member_id and self.commits:
            if now < self.commit_retry_at_s:
                return None   # heartbeats wait for the commit (COMMIT_RETRY_FRACTION)
            pending = self.commits.pop(0)
            self.inflight = ("commit", pending)
            self.asked = self.coordinators.current
            return self.asked, ("group_commit", self.ids() | {"positions": pending.wire})
        if self.leaving:
            return self._leave_request(now) if now >= self.next_beat_s else None
        if now >= self.next_beat_s and self.failed is None:
            self.inflight = ("heartbeat", None)
            self.beat_sent_s = now
            self.asked = self.coordinators.current
            return self.asked, ("group_heartbeat", self._heartbeat())
        return None

    def on_reply(self, reply, now: float) -> None:
        kind, pending = self.inflight
        self.inflight = None
        if kind == "leave":
            self._left(now)
        elif kind == "heartbeat":
            if now >= self.beat_sent_s + self._fence_span_s():
                # Answered too late to act on: the session it renewed may be over already.
                self.on_error(Timeout("heartbeat answered after the member fenced itself"), now)
                return
            self.answered_s = self.beat_sent_s
            self._apply(reply[0], now)
        elif pending.future is not None:
            pending.future.set_result(None)

    def on_error(self, err: KeraError, now: float) -> None:
        kind, pending = self.inflight or ("heartbeat", None)
        self.inflight = None
        self.coordinators.failed(self.asked, err)
        if kind == "leave":
            self._leave_failed(err, now)
            return
        if isinstance(err, UnknownMember):
            self._fenced(err, now)
        if kind == "commit":
            if self._retry_commit(pending, err, now):
                return
            if pending.future is not None:
                pending.future.set_exception(err)
            elif isinstance(err, StaleMemberEpoch):
                self.next_beat_s = now   # catch up with the assignment, then commit again
            return
        if isinstance(err, FATAL_HEARTBEAT_ERRORS) and not err.retriable:
            self._fail(err)
        elif not isinstance(err, UnknownMember):
            log.warning("group '%s': heartbeat failed (%s); retrying", self.group, err)
            self.next_beat_s = now + RETRY_BACKOFF_S

    def _fail(self, err: KeraError) -> None:
        """Stop heartbeating for good: `err` will not pass by retrying."""
        log.error("group '%s': %s; the consumer stops joining the group", self.group, err)
        self.failed, self.next_beat_s = err, math.inf
        if not self.joined.done():
            self.joined.set_exception(err)
        if self.on_fatal is not None:
            self.on_fatal(err)

    def _retry_commit(self, pending: PendingCommit, err: KeraError, now: float) -> bool:
        """Queue `pending` again, first, when `err` may pass (COMMIT_RETRY_FRACTION)."""
        if not err.retriable or isinstance(err, (StaleMemberEpoch, UnknownMember)) or \
                not self.member_id:
            return False
        until = pending.retry_until_s
        if until is None:
            until = now + COMMIT_RETRY_FRACTION * self.session_timeout_ms / 1000
        if now + RETRY_BACKOFF_S > until:
            return False
        self.commits.insert(0, pending._replace(retry_until_s=until))
        self.commit_retry_at_s = now + RETRY_BACKOFF_S
        log.info("group '%s': commit failed (%s); retrying", self.group, err)
        return True

    def next_wake(self, now: float) -> float | None:
        if self.failed is not None:
            return None
        wakes = [self.next_beat_s]
        if self.member_id and self.commits:   # first the commit; heartbeats wait for it
            wakes = [max(now, self.commit_retry_at_s)]
        if self.member_id:
            wakes.append(self._fence_at())
        if self.member_id and self.auto_commit_s is not None:
            wakes.append(self.next_auto_commit_s)
        return min((w for w in wakes if w != math.inf), default=None)

    # ------------------------------------------------------------------ client side
    def commit(self, positions: list[Position]) -> Future:
        future: Future = Future()
        self.commits.append(PendingCommit(positions_to_wire(positions), future))
        return future

    def subscribe(self, streams, pattern: str | None, now: float) -> None:
        """Ask the group for `streams` (and `pattern`) from now on (module doc)."""
        rejoin = pattern != self.pattern or (not streams and self.streams)
        self.streams, self.pattern = list(streams), pattern
        if not self.subscribed():
            self.unsubscribe(now)
        elif rejoin and (self.member_id or self.inflight is not None):
            self._leave(now)   # joined, or joining, with the old pattern
        elif not self.leaving:
            self.next_beat_s = now   # the next heartbeat carries the new subscription

    def unsubscribe(self, now: float) -> None:
        """Hold nothing and leave the group (module doc)."""
        self.streams, self.pattern = [], None
        self._leave(now)

    def subscribed(self) -> bool:
        return bool(self.streams) or self.pattern is not None

    def leave_request(self) -> tuple[str, dict] | None:
        """The leave heartbeat to send when the consumer closes (None: never joined)."""
        if not self.member_id:
            return None
        epoch = STATIC_LEAVE_EPOCH if self.instance_id else LEAVE_EPOCH
        return "group_heartbeat", {"group": self.group, "member_id": self.member_id,
                                   "member_epoch": epoch}

    def held_until(self) -> float | None:
        """Until when (the `now` clock) this member's parts are surely its alone: past it the
        coordinator may have granted them to another member. None: not a member now."""
        return self._fence_at() if self.member_id else None

    # ------------------------------------------------------------------ internals
    def ids(self) -> dict:
        return {"group": self.group, "member_id": self.member_id,
                "member_epoch": self.member_epoch}

    def _heartbeat(self) -> dict:
        fields = self.ids() | {"streams": self.streams,
                                "owned": [list(p) for p in self.consumer.assignment()],
                                "session_timeout_ms": self.session_timeout_ms}
        if self.instance_id:
            fields["instance_id"] = self.instance_id
        if self.pattern is not None:
            fields["pattern"] = self.pattern
        return fields

    def _leave(self, now: float) -> None:
        """Revoke every part (their positions committed first), then leave (_leave_request)."""
        held = self.consumer.unassign(self.consumer.assignment())
        if held and self.member_id:
            self.commits.append(PendingCommit(positions_to_wire(held), None))
        self.leaving, self.next_beat_s = True, now

    def _leave_request(self, now: float):
        if not self.member_id:   # never joined (or fenced meanwhile): nothing to leave
            self._left(now)
            return None
        self.inflight = ("leave", None)
        self.asked = self.coordinators.current
        return self.asked, ("group_heartbeat", self.ids() | {"member_epoch": LEAVE_EPOCH})

    def _leave_failed(self, err: KeraError, now: float) -> None:
        """A leave not answered: try again (another coordinator) while the session lasts; past
        that the coordinator drops the member on its own."""
        if err.retriable and not isinstance(err, UnknownMember) and \
                now + RETRY_BACKOFF_S < self._fence_at():
            self.next_beat_s = now + RETRY_BACKOFF_S
            return
        if not isinstance(err, UnknownMember):
            log.warning("group '%s': leaving failed (%s): the coordinator drops this member "
                        "after its session timeout", self.group, err)
        self._left(now)

    def _left(self, now: float) -> None:
        self.member_id, self.member_epoch, self.leaving = "", 0, False
        self.next_beat_s = now if self.subscribed() else math.inf
        if self.subscribed():
            log.info("group '%s': left; joining again for %s", self.group,
                     self.streams if self.pattern is None else f"{self.streams} + {self.pattern!r}")

    def _fence_span_s(self) -> float:
        return SELF_FENCE_FRACTION * self.session_timeout_ms / 1000

    def _fence_at(self) -> float:
        return self.answered_s + self._fence_span_s()

    def _apply(self, header: dict, now: float) -> None:
        self.member_id, self.member_epoch = header["member_id"], header["member_epoch"]
        if self.leaving:
            return   # an answer sent before the leave: hold none of what it grants
        self.next_beat_s = now + header["heartbeat_interval_ms"] / 1000
        granted = {(s, sl) for s, sl in header["assignment"]}
        current = set(self.consumer.assignment())
        revoked = sorted(current - granted)
        if revoked:
            # Commit where they stand before the next heartbeat acknowledges the revocation
            # (commits go out before heartbeats), so their next owner resumes exactly there.
            held = self.consumer.unassign(revoked)
            if held:
                self.commits.append(PendingCommit(positions_to_wire(held), None))
            self.next_beat_s = now
            log.info("group '%s': %d streamlets revoked", self.group, len(revoked))
        added = sorted(granted - current)
        if added:
            self.consumer.assign(added, positions_from_wire(header.get("positions", [])))
            log.info("group '%s': %d streamlets assigned (member %s, epoch %d)", self.group,
                     len(added), self.member_id, self.member_epoch)
        if not self.joined.done():
            self.joined.set_result(sorted(granted))

    def _fenced(self, err: KeraError, now: float) -> None:
        log.warning("group '%s': %s; dropping %d streamlets and rejoining", self.group, err,
                    len(self.consumer.assignment()))
        self.consumer.unassign(self.consumer.assignment())
        for pending in self.commits:    # they were of parts this member no longer holds
            if pending.future is not None:
                pending.future.set_exception(err)
        self.commits = []
        self.member_id, self.member_epoch, self.next_beat_s = "", 0, now
