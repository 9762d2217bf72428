"""Rebalancing: streamlets moved back to restarted or added brokers. Sans-IO.

A *step* hands one broker's replicated streamlets over as if that broker had restarted. Its
next heartbeat is answered `not_ready` ("register again"); it drops its R >= 2 streams
(kera.broker.recovery.reset_incarnation) and registers as a new incarnation; the coordinator
fails the old incarnation over (kera.coordinator.recovery), counting the new one as holding
only its R=1 streamlets, so the streamlets spread least loaded first over every live broker,
the one handing over included, and each new owner recovers its share from the replicas.
Safety is failover's: the old incarnation's replicas are fenced before anything is read from
them, so nothing acknowledged is lost and nothing is acknowledged behind the recovery's back.
The cost: each moved streamlet answers `not_ready` (clients retry) while its new owner reads
it back from the backups, and the handing-over broker's own share is read back too. R=1
streamlets never move (no replica holds them).

A step waits until every live backup has heartbeated lately and every backup holding the
handing-over broker's replicas is alive: like a broker restart (or a Kafka rolling restart),
a step leaves R-1 copies of that broker's data, on the backups, until the new owners have
re-replicated it, so it is not taken while a backup may be down.

A *plan* picks the live broker whose handover leaves the smallest *spread* (the most minus
the least streamlets on a live broker, counting every streamlet), fewer moves breaking ties;
none if no handover makes the spread smaller. One step at a time: a step is *in progress*
while its broker has not registered again or any streamlet is recovering.

The automatic policy (on unless turned off with the coordinator's `--no-auto-rebalance`) takes
a step once brokers have been steady (none registered, died or handed over) for AUTO_STEADY_S
and the spread is at least AUTO_SPREAD_MIN: a restarted or added broker gets streamlets back
without an operator, and a cluster that is restarting is left alone until it settles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kera.errors import NotReady

if TYPE_CHECKING:
    from kera.coordinator.core import Coordinator

log = logging.getLogger(__name__)

# Brokers and backups must have been steady this long before the automatic policy moves
# anything: a broker restart takes a dead window (2 s by default) plus its recovery, a rolling
# restart or an operator's fault drill should finish before streamlets are moved around it,
# and a step briefly leaves R-1 copies of what it moves (a second failure then would count
# twice). Half a minute is soon enough for a broker that came back to get work again.
AUTO_STEADY_S = 30.0
# The automatic policy acts on a spread of at least this many streamlets (1 is as even as
# streamlet counts that do not divide evenly get).
AUTO_SPREAD_MIN = 2
# How often the automatic policy computes a plan (it walks every stream's placement).
AUTO_CHECK_INTERVAL_S = 1.0
# A step waits while a live backup has been silent for more than this many heartbeat
# intervals: it may have crashed, and the step would leave its replicas as the only copies.
BACKUP_SILENT_INTERVALS_MAX = 3


@dataclass(frozen=True, slots=True)
class Plan:
    loads: dict[int, int]          # live broker id -> streamlets it owns now
    broker: int | None             # who hands over next (None: as balanced as steps get it)
    moves: int                     # its replicated streamlets that move
    after: dict[int, int]          # the loads once that step is done

    def to_reply(self) -> dict:
        return {"loads": _keyed(self.loads), "broker": self.broker, "moves": self.moves,
                "after": _keyed(self.after), "spread": spread(self.loads),
                "spread_after": spread(self.after)}


def plan(coord: "Coordinator") -> Plan:
    """The next step: the handover leaving the smallest spread, if it is smaller than now."""
    live = coord.failover.live_brokers(coord)
    loads = coord.failover.loads(coord, live)
    movable = dict.fromkeys(loads, 0)
    for stream in coord.streams.values():
        if stream.spec.replication > 1:
            for owner in stream.placement:
                if owner in movable:
                    movable[owner] += 1
    best = None
    for broker, moves in sorted(movable.items()):
        if moves:
            after = handed_over(loads, broker, moves)
            key = (spread(after), moves, broker)
            if best is None or key < best[0]:
                best = (key, Plan(loads, broker, moves, after))
    if best is None or best[0][0] >= spread(loads):
        return Plan(loads, None, 0, dict(loads))
    return best[1]


class Rebalancer:
    def __init__(self, auto: bool = True):
        self.auto = auto
        self.pending: int | None = None       # broker asked to hand over, not registered again
        self._pending_epoch: int | None = None
        self.steps = 0
        self.last_step: dict = {}
        self._incarnations: tuple = ()        # live (broker, epoch) pairs at the last look
        self._backups: tuple = ()             # live (backup, registered version) pairs
        self._steady_since_s: float | None = None
        self._checked_s = float("-inf")

    def busy(self, coord: "Coordinator", now: float) -> str | None:
        """Why a step cannot start now (None: it can). A step is as risky as a restart of the
        broker handing over (its memory goes; its data is read back from the backups), so
        every backup must be heard from and every one holding its replicas alive."""
        if self.pending is not None:
            return f"broker {self.pending} is handing its streamlets over"
        recovering = sum(len(per) for per in coord.failover.recovering.values())
        if recovering:
            return f"{recovering} streamlets are recovering"
        late = coord.heartbeat_interval_s * BACKUP_SILENT_INTERVALS_MAX
        for member in coord.live("backup"):
            if member.last_heartbeat_s is None or now - member.last_heartbeat_s > late:
                return f"backup {member.id} has not heartbeated for {late:.1f} s"
        return None

    @staticmethod
    def _replicas_unsafe(coord: "Coordinator", broker: int) -> str | None:
        """Why `broker` may not hand over: a backup its replica map names is dead."""
        backups = coord.members["backup"]
        for (vlog, vseg), held_by in coord.replica_map.tables.get(broker, {}).items():
            dead = [b for b in held_by if b not in backups or not backups[b].alive]
            if dead:
                return (f"broker {broker}'s virtual segment {vlog}/{vseg} has a replica on dead "
                        f"backup {dead[0]}")
        return None

    # ------------------------------------------------------------------ steps
    def request(self, coord: "Coordinator", now: float, dry_run: bool) -> dict:
        """The `rebalance` op: the plan, and unless `dry_run` its step started."""
        self._follow(coord, now)
        step = plan(coord)
        busy = self.busy(coord, now)
        if busy is None and step.broker is not None:
            busy = self._replicas_unsafe(coord, step.broker)
        reply = {**step.to_reply(), "busy": busy, "started": False,
                 "steps": self.steps, "auto": self.auto}
        if dry_run or step.broker is None:
            return reply
        if reply["busy"]:
            raise NotReady(f"a rebalance step is in progress ({reply['busy']}): try again "
                           f"once it is done")
        self.start(coord, step, now, "requested")
        reply["started"] = True
        return reply

    def start(self, coord: "Coordinator", step: Plan, now: float, why: str) -> None:
        """Start `step` (checked by the caller): its broker's next heartbeat is refused."""
        self.pending = step.broker
        self._pending_epoch = coord.failover.epochs.get(step.broker)
        self.steps += 1
        self._steady_since_s = now
        self.last_step = {"broker": step.broker, "moves": step.moves, "at_s": now, "why": why,
                          "loads": _keyed(step.loads), "after": _keyed(step.after)}
        log.warning("rebalance (%s): broker %d hands its %d replicated streamlets over "
                    "(streamlets per broker %s -> %s)", why, step.broker, step.moves,
                    _keyed(step.loads), _keyed(step.after))

    def check_heartbeat(self, kind: str, member_id: int) -> None:
        """Answer the handing-over broker's heartbeat: register again (a new incarnation)."""
        if kind == "broker" and member_id == self.pending:
            raise NotReady(f"broker {member_id} hands its streamlets over (rebalance): "
                           f"register again")

    def _follow(self, coord: "Coordinator", now: float) -> None:
        """Notice brokers registering or dying: the clock of steadiness restarts, and a
        pending handover is over once its broker registered again (or died)."""
        live = coord.failover.live_brokers(coord)
        incarnations = tuple(sorted((m.id, coord.failover.epochs.get(m.id)) for m in live))
        backups = tuple(sorted((m.id, m.registered_version) for m in coord.live("backup")))
        if (incarnations, backups) != (self._incarnations, self._backups) or \
                self._steady_since_s is None:
            # The handing-over broker's own new incarnation is the step, not a disturbance:
            # the next step may follow as soon as this one's recovery is done.
            ours = self.pending is not None and backups == self._backups and {
                b for b, _ in incarnations} == {b for b, _ in self._incarnations}
            self._incarnations, self._backups = incarnations, backups
            if not ours:
                self._steady_since_s = now
        if self.pending is not None and (self.pending, self._pending_epoch) not in incarnations:
            log.info("rebalance: broker %d registered again; its streamlets recover on their "
                     "new owners", self.pending)
            self.pending = None

    def tick(self, coord: "Coordinator", now: float) -> None:
        self._follow(coord, now)
        if not self.auto or now - self._checked_s < AUTO_CHECK_INTERVAL_S:
            return
        self._checked_s = now
        if now - self._steady_since_s < AUTO_STEADY_S or self.busy(coord, now):
            return
        step = plan(coord)
        if step.broker is not None and spread(step.loads) >= AUTO_SPREAD_MIN and \
                self._replicas_unsafe(coord, step.broker) is None:
            self.start(coord, step, now, "automatic")

    def status(self, coord: "Coordinator", now: float) -> dict:
        return {"auto": self.auto, "pending": self.pending, "steps": self.steps,
                "busy": self.busy(coord, now), "last_step": self.last_step}


def spread(loads: dict[int, int]) -> int:
    return max(loads.values()) - min(loads.values()) if loads else 0


def handed_over(loads: dict[int, int], broker: int, moves: int) -> dict[int, int]:
    """The loads after `broker` hands `moves` streamlets over: each goes to the least loaded
    live broker, lowest id first (as kera.coordinator.recovery places a failover)."""
    after = dict(loads)
    after[broker] -= moves
    for _ in range(moves):
        target = min(after, key=lambda b: (after[b], b))
        after[target] += 1
    return after


def _keyed(loads: dict[int, int]) -> dict[str, int]:
    return {str(b): n for b, n in sorted(loads.items())}
