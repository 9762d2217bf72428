"""Broker failover in the coordinator: incarnations, reassignment and recovery bookkeeping.

Sans-IO, driven by kera.coordinator.core (it calls the hooks below and persists `to_state()`).

*Incarnation.* Every `register` of a broker starts a new incarnation, numbered by its *epoch*:
a counter of its own, issued only here, persisted, only growing, bounded by EPOCH_MAX (an epoch
must fit the high 32 bits of a virtual segment number). A broker names its replicas with
its epoch (`vseg = epoch << 32 | n`, see kera.broker.virtual_log), so the replicas of an
incarnation that died are never confused with those a restarted process writes.

*Failover* of incarnation (b, e) happens when b is declared dead while it owns streamlets of
streams with R >= 2, or when b registers again (a restarted process is empty). Every such
streamlet moves to a live broker (least loaded first, so several brokers share the work) and is
marked *recovering* with its *sources*: the incarnations whose replicas hold its data. A
streamlet that was already recovering keeps its sources and gains (b, e), since b may have
appended to it. R=1 streamlets stay with b (no replica holds them). The new owner answers
`not_ready` for a recovering streamlet while it rebuilds it from the sources' replicas, and
sends `recovered` once the rebuilt data is re-replicated under its own incarnation; the marker
then goes. A failed-over incarnation that heartbeats again (it was cut off, not dead) is told
`not_ready` and must register again, coming back without its R >= 2 streamlets (it keeps its
R=1 ones), unless no other broker took any of its streamlets yet: then it keeps them all
(`_unfail`).

*Replicas.* Backups report in each heartbeat which incarnations they hold replicas of
(`held`), so the coordinator knows who holds what; it answers with `free`, the incarnations
that are dead and named by no recovering streamlet: their replicas are no longer needed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kera.errors import BadRequest, NotReady
from kera.codec.wire import Fields

if TYPE_CHECKING:
    from kera.coordinator.core import Coordinator, Member

log = logging.getLogger(__name__)

HELD_ENTRIES_MAX = 4096   # incarnations one backup may report holding replicas of
RECOVERED_ENTRIES_MAX = 100_000
# After a coordinator restart a broker not heard from within this many heartbeat allowances is
# failed over (it may have died while the coordinator was down, and will never heartbeat).
RESTART_GRACE_ALLOWANCES = 2
U64_MAX = 2**64 - 1
# Epochs name virtual segments in their high 32 bits (EPOCH_SHIFT): one register per epoch,
# 4 billion registers in all; the coordinator refuses registers of brokers beyond.
EPOCH_MAX = 2**32 - 1
FIRST_EPOCH = 1           # 0 is never an epoch


class Failover:
    def __init__(self):
        self.epochs: dict[int, int] = {}      # broker id -> epoch of its current incarnation
        self.next_epoch = FIRST_EPOCH
        self.failed: dict[int, int] = {}      # broker id -> epoch of its last failed-over one
        # stream id -> {streamlet: [[broker, epoch], ...]} (sources, oldest first)
        self.recovering: dict[int, dict[int, list[list[int]]]] = {}
        self.holders: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}  # backup -> held
        self.failovers = 0
        self.streamlets_moved = 0
        self.last_failover: dict = {}

    # ------------------------------------------------------------------ queries
    def live_brokers(self, coord: "Coordinator") -> list["Member"]:
        return [m for m in coord.live("broker") if not self.is_failed(m.id)]

    def is_failed(self, broker_id: int) -> bool:
        e = self.epochs.get(broker_id)
        return e is not None and self.failed.get(broker_id) == e

    def sources_named(self) -> set[tuple[int, int]]:
        return {(b, e) for per in self.recovering.values() for srcs in per.values()
                for b, e in srcs}

    def releasable(self, broker_id: int, epoch: int, named: set) -> bool:
        """Is incarnation (broker_id, epoch) over, with nothing left to recover from it?"""
        current = self.epochs.get(broker_id)
        if current is None or epoch > current:
            return False   # unknown to us: keep (metadata may have been lost)
        over = epoch < current or self.failed.get(broker_id) == epoch
        return over and (broker_id, epoch) not in named

    def sources_of(self, coord: "Coordinator", broker_id: int) -> list[tuple[int, int]]:
        """The failed-over incarnations (broker, epoch) that `broker_id` recovers from: the
        sources of the recovering streamlets placed on it."""
        out: set = set()
        if not self.recovering:
            return []
        by_id = {s.id: s for s in coord.streams.values()}
        for stream_id, per in self.recovering.items():
            stream = by_id.get(stream_id)
            if stream is None:
                continue
            for sl, sources in per.items():
                if sl < len(stream.placement) and stream.placement[sl] == broker_id:
                    out.update((b, e) for b, e in sources)
        return sorted(out)

    def descriptor_field(self, stream_id: int) -> list:
        """`recovering` of a stream descriptor: [[streamlet, [[broker, epoch], ...]], ...]."""
        per = self.recovering.get(stream_id)
        if not per:
            return []
        return [[sl, [list(s) for s in srcs]] for sl, srcs in sorted(per.items())]

    # ------------------------------------------------------------------ hooks from the core
    def registered(self, coord: "Coordinator", member: "Member", now: float) -> None:
        """A broker (re)registered: a new incarnation; the previous one, if any, is over."""
        if member.kind != "broker":
            return
        old = self.epochs.get(member.id)
        self.epochs[member.id] = self.next_epoch
        self.next_epoch += 1
        if old is not None and self.failed.get(member.id) != old:
            if self._owns(coord, member.id):
                self._fail_over(coord, member.id, old, now, "registered again")
            else:
                self.failed[member.id] = old   # nothing to move; its replicas may go
        self.assign_orphans(coord)

    def check_epochs_left(self) -> None:
        if self.next_epoch > EPOCH_MAX:
            raise NotReady(f"all {EPOCH_MAX} broker epochs were issued: no broker may register")

    def check_heartbeat(self, coord: "Coordinator", kind: str, member_id: int, f: Fields,
                        now: float) -> None:
        """Refuse a heartbeat from a broker incarnation that was failed over, unless nothing
        was taken from it yet (then it simply comes back, see `_unfail`)."""
        if kind != "broker":
            return
        epoch = f.int("epoch", None, hi=EPOCH_MAX)
        current = self.epochs.get(member_id)
        if epoch is not None and (current is None or epoch > current):
            raise BadRequest(f"broker {member_id} epoch {epoch} was never issued")
        if epoch is not None and epoch != current:
            raise NotReady(f"broker {member_id} incarnation {epoch} is over: register again")
        if self.is_failed(member_id) and not self._unfail(coord, member_id, current):
            raise NotReady(f"broker {member_id} incarnation was failed over: register again")

    def _unfail(self, coord: "Coordinator", broker_id: int, epoch: int) -> bool:
        """A failed-over incarnation heartbeats again (it was cut off, not dead). If every
        streamlet recovering from it is still placed on it (no live broker could take one, so
        no other broker read or fenced its replicas), it keeps them, memory intact: its
        markers go and it is live again. Otherwise it must come back without them."""
        by_id = {s.id: s for s in coord.streams.values()}
        named = [(sid, sl) for sid, per in self.recovering.items() for sl, srcs in per.items()
                 if [broker_id, epoch] in srcs]
        if not named:
            return False   # taken over and recovered already (or deleted): nothing to keep
        for sid, sl in named:
            stream = by_id.get(sid)
            if stream is None or stream.placement[sl] != broker_id:
                return False
        for sid, sl in named:
            srcs = self.recovering[sid][sl]
            srcs.remove([broker_id, epoch])
            if not srcs:
                del self.recovering[sid][sl]
                if not self.recovering[sid]:
                    del self.recovering[sid]
        del self.failed[broker_id]
        coord.bump()
        log.warning("broker %d (epoch %d) is back and nothing of it was taken over: it keeps "
                    "its %d streamlets", broker_id, epoch, len(named))
        return True

    def backup_heartbeat(self, coord: "Coordinator", member_id: int, f: Fields) -> list:
        """Record what a backup holds; returns `free`: held incarnations no longer needed."""
        held = f.list("held", None, max_len=HELD_ENTRIES_MAX)
        if held is None:
            return []
        table: dict[tuple[int, int], tuple[int, int]] = {}
        for entry in held:
            if not isinstance(entry, list) or len(entry) != 4 or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64_MAX
                    for x in entry):
                raise BadRequest("'held' entries are [broker_id, epoch, replicas, bytes]")
            table[(entry[0], entry[1])] = (entry[2], entry[3])
        self.holders[member_id] = table
        named = self.sources_named()
        return [[b, e] for (b, e) in sorted(table) if self.releasable(b, e, named)]

    def daemons_dead(self, coord: "Coordinator", dead: list["Member"], now: float) -> bool:
        """Fail over every dead broker that owns streamlets; forget dead backups' holdings.
        Returns whether anything changed."""
        changed = False
        for member in dead:
            if member.kind == "backup":
                self.holders.pop(member.id, None)
                continue
            epoch = self.epochs.get(member.id, 0)
            if self.failed.get(member.id) != epoch and self._owns(coord, member.id):
                self._fail_over(coord, member.id, epoch, now, "missed its heartbeats")
                changed = True
        return self.assign_orphans(coord) or changed

    def tick(self, coord: "Coordinator", now: float) -> bool:
        """Brokers silent since this coordinator started (they may have died while it was
        down) are failed over after a grace; streamlets without a live owner are placed."""
        changed = False
        if now - coord.started_s > coord.dead_after_s * RESTART_GRACE_ALLOWANCES:
            for member in coord.members["broker"].values():
                if member.last_heartbeat_s is not None or member.alive:
                    continue
                epoch = self.epochs.get(member.id, 0)
                if self.failed.get(member.id) != epoch and self._owns(coord, member.id):
                    self._fail_over(coord, member.id, epoch, now,
                                    "was not heard from since the coordinator started")
                    changed = True
        return self.assign_orphans(coord) or changed

    def recovered(self, coord: "Coordinator", broker_id: int, epoch: int, streamlets) -> int:
        """The owner finished recovering these [stream id, streamlet]s; returns how many
        markers were cleared (only the current, live owner may clear one)."""
        member = coord.members["broker"].get(broker_id)
        if member is None or not member.alive or self.epochs.get(broker_id) != epoch \
                or self.is_failed(broker_id):
            raise NotReady(f"broker {broker_id} epoch {epoch} is not a live incarnation")
        by_id = {s.id: s for s in coord.streams.values()}
        cleared = 0
        for sid, sl in streamlets:
            per = self.recovering.get(sid)
            stream = by_id.get(sid)
            if per is None or sl not in per or stream is None or sl >= len(stream.placement) \
                    or stream.placement[sl] != broker_id:
                continue
            del per[sl]
            if not per:
                del self.recovering[sid]
            cleared += 1
            log.info("stream '%s' streamlet %d recovered on broker %d", stream.spec.name, sl,
                     broker_id)
        return cleared

    def stream_deleted(self, stream_id: int) -> None:
        self.recovering.pop(stream_id, None)

    # ------------------------------------------------------------------ placement
    def _owns(self, coord: "Coordinator", broker_id: int) -> bool:
        """Does the broker own streamlets that failover would move (R >= 2)?"""
        return any(broker_id in s.placement for s in coord.streams.values()
                   if s.spec.replication > 1)

    def loads(self, coord: "Coordinator", live: list["Member"]) -> dict[int, int]:
        loads = {m.id: 0 for m in live}
        for s in coord.streams.values():
            for owner in s.placement:
                if owner in loads:
                    loads[owner] += 1
        return loads

    def _fail_over(self, coord: "Coordinator", broker_id: int, epoch: int, now: float,
                   why: str) -> None:
        self.failed[broker_id] = epoch
        self.failovers += 1
        coord.bump()
        version = coord.version
        live = [m for m in self.live_brokers(coord) if m.id != broker_id or
                self.epochs.get(broker_id) != epoch]
        loads = self.loads(coord, live)
        if broker_id in loads:   # registered again: it keeps only its R=1 streamlets
            loads[broker_id] = sum(owner == broker_id for s in coord.streams.values()
                                   if s.spec.replication == 1 for owner in s.placement)
        moved = 0
        targets: set[int] = set()
        for _, stream in sorted(coord.streams.items()):
            if stream.spec.replication == 1:
                # No replica to recover from: the streamlet stays with its broker (unavailable
                # until it is back, with whatever its own disk kept; kera.broker.reload).
                continue
            for sl, owner in enumerate(stream.placement):
                if owner != broker_id:
                    continue
                srcs = self.recovering.setdefault(stream.id, {}).setdefault(sl, [])
                if [broker_id, epoch] not in srcs:
                    srcs.append([broker_id, epoch])
                if loads:
                    target = min(loads, key=lambda b: (loads[b], b))
                    loads[target] += 1
                    stream.placement[sl] = target
                    targets.add(target)
                stream.version = version
                moved += 1
        self.streamlets_moved += moved
        self.last_failover = {"broker_id": broker_id, "epoch": epoch, "at_s": now,
                              "streamlets": moved, "version": version}
        log.warning("broker %d (epoch %d) %s: %d streamlets move to brokers %s and recover "
                    "from backups", broker_id, epoch, why, moved, sorted(targets) or "(none live)")

    def assign_orphans(self, coord: "Coordinator") -> bool:
        """Recovering streamlets whose owner's incarnation was failed over go to a live broker.

        An owner merely not heard from yet (a coordinator that restarted knows no broker alive
        until it heartbeats) keeps its streamlets: it may have rebuilt them and appended since,
        and only failing it over (`tick`'s grace, or declared dead) names its incarnation as a
        source. Moving them sooner lost what it appended (simulation seed 1857)."""
        if not self.recovering:
            return False
        live = self.live_brokers(coord)
        if not live:
            return False
        live_ids = {m.id for m in live}
        loads = self.loads(coord, live)
        by_id = {s.id: s for s in coord.streams.values()}
        changes = []
        for sid, per in sorted(self.recovering.items()):
            stream = by_id.get(sid)
            if stream is None:
                continue
            for sl in sorted(per):
                owner = stream.placement[sl] if sl < len(stream.placement) else None
                if owner is not None and owner not in live_ids and self._orphaned(coord, owner):
                    changes.append((stream, sl))
        if not changes:
            return False
        coord.bump()
        for stream, sl in changes:
            target = min(loads, key=lambda b: (loads[b], b))
            loads[target] += 1
            stream.placement[sl] = target
            stream.version = coord.version
            log.info("stream '%s' streamlet %d (recovering) placed on broker %d",
                     stream.spec.name, sl, target)
        return True

    def _orphaned(self, coord: "Coordinator", owner: int) -> bool:
        """Is nothing of `owner` left to keep a streamlet: no such broker, or its current
        incarnation failed over (its epoch then is among the streamlet's sources)?"""
        return owner not in coord.members["broker"] or self.is_failed(owner)

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        return {
            "epochs": [[b, e] for b, e in sorted(self.epochs.items())],
            "failed": [[b, e] for b, e in sorted(self.failed.items())],
            "recovering": [[sid, sl, [list(s) for s in srcs]]
                           for sid, per in sorted(self.recovering.items())
                           for sl, srcs in sorted(per.items())],
            "holders": [[backup, b, e, n, size]
                        for backup, table in sorted(self.holders.items())
                        for (b, e), (n, size) in sorted(table.items())],
            "failovers": self.failovers,
            "streamlets_moved": self.streamlets_moved,
            "last_failover": dict(self.last_failover),
        }

    # ------------------------------------------------------------------ persistence
    def to_state(self) -> dict:
        return {"epochs": [[b, e] for b, e in sorted(self.epochs.items())],
                "next_epoch": self.next_epoch,
                "failed": [[b, e] for b, e in sorted(self.failed.items())],
                "recovering": [[sid, sl, [list(s) for s in srcs]]
                               for sid, per in sorted(self.recovering.items())
                               for sl, srcs in sorted(per.items())]}

    def load(self, state: dict | None) -> None:
        """Raises ValueError on anything malformed (the coordinator refuses to start)."""
        if state is None:
            return
        try:
            for b, e in state["epochs"]:
                self.epochs[_nonneg(b)] = _nonneg(e)
            for b, e in state["failed"]:
                self.failed[_nonneg(b)] = _nonneg(e)
            for sid, sl, srcs in state["recovering"]:
                self.recovering.setdefault(_nonneg(sid), {})[_nonneg(sl)] = [
                    [_nonneg(b), _nonneg(e)] for b, e in srcs]
            # Absent in files written while epochs were metadata versions: above all of those.
            issued = [*self.epochs.values(), *self.failed.values(), FIRST_EPOCH - 1]
            self.next_epoch = max(_nonneg(state.get("next_epoch", 0)), max(issued) + 1)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed recovery state: {exc.__class__.__name__}: {exc}") from None


def parse_streamlets(f: Fields) -> list[tuple[int, int]]:
    value = f.list("streamlets", max_len=RECOVERED_ENTRIES_MAX)
    out = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64_MAX for x in entry):
            raise BadRequest("'streamlets' entries are [stream_id, streamlet]")
        out.append((entry[0], entry[1]))
    return out


def _nonneg(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
