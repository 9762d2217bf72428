"""Consumer groups in the simulation: members join, leave, crash and are cut off on a lossy
network, against the real coordinator.

`GroupRun(seed).run()` builds, from the seed, a coordinator (kera.coordinator.server on the
simulated shell, as in tests/sim/cluster.py) with 1-2 streams of 2-6 streamlets, and 2-4
members of one consumer group. Each member drives the consumer's own membership task
(kera.consumer.membership.Membership) through a TaskRunner, the way the consumer's request
thread does (kera/consumer/fetcher.py), and commits where it has "read" to (a position that
grows while it holds a streamlet). Faults from the seed: message loss and loss bursts,
partitions between a member and the coordinator (one way or both), member crashes and
restarts, graceful leaves and rejoins, and a coordinator crash and restart.

Checked throughout (GroupChecker): no streamlet is held by two members at once, and the
group's committed position of a streamlet never goes back (a zombie's late commit accepted
over its successor's would). After healing: within a bounded time every streamlet is held by
exactly one live member.
"""

from __future__ import annotations

import random

from kera.consumer.membership import Membership
from kera.consumer.tasks import TaskRunner
from kera.codec.position import Position

from tests.sim.checker import InvariantBroken
from tests.sim.clients import Client
from tests.sim.daemons import MemoryStore, SimClock, SimCoordinator, sim_env
from tests.sim.network import Network
from tests.sim.scheduler import Scheduler
from tests.sim.shell import SimFailure

COORDINATOR = "coordinator:7000"
GROUP = "g"
ACTIVE_S = 12.0               # faults happen in this window
SETTLE_S_MAX = 30.0           # after healing: every streamlet owned again within this
REQUEST_TIMEOUT_S = 1.0       # the members' coordinator requests
READ_STEP_S = 0.05            # a held streamlet's position grows one step per this
STEPS_MAX = 3_000_000         # a run that never ends is a bug of its own


class GroupChecker:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.owner: dict[tuple, str] = {}
        self.committed: dict[tuple, int] = {}
        self.handovers = 0

    def acquire(self, member: str, parts) -> None:
        for part in parts:
            other = self.owner.get(part)
            if other is not None and other != member:
                raise InvariantBroken(f"streamlet {part} granted to {member} while {other} still "
                                      f"holds it (t={self.sched.now:.3f})")
            self.handovers += other is None
            self.owner[part] = member

    def release(self, member: str, parts) -> None:
        for part in parts:
            if self.owner.get(part) == member:
                del self.owner[part]

    def observe_commits(self, groups) -> None:
        group = groups.groups.get(GROUP)
        if group is None:
            return
        for part, pos in group.committed.items():
            value = max(g for g, _off, _ep in pos)
            if value < self.committed.get(part, -1):
                raise InvariantBroken(f"the committed position of {part} went back from "
                                      f"{self.committed[part]} to {value} (a stale commit "
                                      f"accepted) at t={self.sched.now:.3f}")
            self.committed[part] = value


class SimGroupMember(Client):
    """A consumer in the group: Membership + TaskRunner, reading nothing but moving positions."""

    def __init__(self, net: Network, address: str, rng: random.Random, checker: GroupChecker,
                 *, name: str, streams: list[str], session_timeout_ms: int):
        super().__init__(net, address, name, rng, None, COORDINATOR)
        self.groups_checker = checker
        self.streams, self.session_timeout_ms = streams, session_timeout_ms
        self.read: dict[tuple, int] = {}       # held part -> position ("group" number)
        self.membership: Membership | None = None
        self.runner = TaskRunner(REQUEST_TIMEOUT_S)

    # -------------------------------------------------------------- the Assignable interface
    def assign(self, parts, positions=None) -> None:
        start = {(p.stream, p.streamlet): p.group for p in positions or ()}
        self.groups_checker.acquire(self.name, parts)
        for part in parts:
            self.read[part] = start.get(part, 0)

    def unassign(self, parts) -> list[Position]:
        held = self.positions(parts)
        for part in parts:
            self.read.pop(part, None)
        self.groups_checker.release(self.name, parts)
        return held

    def assignment(self) -> list[tuple[str, int]]:
        return sorted(self.read)

    def positions(self, parts=None) -> list[Position]:
        wanted = self.read if parts is None else [p for p in parts if p in self.read]
        return [Position(s, sl, self.read[(s, sl)], 0, 0) for s, sl in sorted(wanted)]

    # -------------------------------------------------------------- the request thread
    def start(self) -> None:
        now = self.sched.now
        self.membership = Membership(self, COORDINATOR, GROUP, self.streams, now,
                                     session_timeout_ms=self.session_timeout_ms,
                                     auto_commit_interval_ms=500)
        self.runner.add(self.membership)
        self.every(READ_STEP_S, self._read_on)
        self.loop()

    def _read_on(self) -> None:
        for part in self.read:
            self.read[part] += 1

    def loop(self) -> None:
        now = self.sched.now
        self.runner.expire(now)
        for task, address, op, fields in self.runner.requests(now):
            self.runner.sent(task, address, self.send_request(address, op, fields), now)
        self.wake_at(self.runner.next_wake(now))

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        self.runner.on_reply(src, header, frames, self.sched.now)
        self.loop()

    def crash(self) -> None:
        """kill -9: it reads nothing more, so it holds nothing."""
        self.groups_checker.release(self.name, list(self.read))
        self.read = {}
        super().crash()

    def leave(self) -> None:
        """Consumer.close: commit what it read, then the leave heartbeat; the process ends."""
        m = self.membership
        if m is not None and m.member_id:
            self.send_request(COORDINATOR, "group_commit",
                              m.ids() | {"positions": [[s, sl, [[g, 0, 0]]]
                                                       for (s, sl), g in sorted(self.read.items())]})
            op, fields = m.leave_request()
            self.send_request(COORDINATOR, op, fields)
        self.crash()


class GroupRun:
    def __init__(self, seed: int):
        self.seed = seed
        rng = random.Random(f"{seed}/groups")
        self.rng = random.Random(f"{seed}/groups/faults")
        self.sched = Scheduler()
        self.net = Network(self.sched, random.Random(f"{seed}/groups/net"))
        self.base_loss = self.net.loss = rng.choice([0.0, 0.01, 0.05])
        self.healed = False
        self.checker = GroupChecker(self.sched)
        self.env = sim_env(self.sched, MemoryStore(), SimClock(self.sched))
        self.coordinator = SimCoordinator(self.net, "coordinator", 7000,
                                          random.Random(f"{seed}/coordinator"), self.env,
                                          heartbeat_interval_s=0.1, heartbeat_missed_max=20)
        self.streams = {f"s{i}": rng.randint(2, 6) for i in range(rng.randint(1, 2))}
        self.session_ms = rng.choice([1000, 2000, 3000])
        self.members: dict[str, SimGroupMember] = {}
        self.member_names = [f"member{i}" for i in range(rng.randint(2, 4))]
        self.faults = 0
        self.fault_log: list[str] = []   # what was done when, for a failure's message

    def run(self) -> dict:
        try:
            self._run()
        except SimFailure as exc:
            raise SimFailure(f"group seed {self.seed} (rerun: KERA_SIM_GROUP_SEED={self.seed}), "
                             f"step {self.sched.steps}, t={self.sched.now:.4f}s: {exc}; faults: "
                             f"{'; '.join(self.fault_log[-6:])}") from None
        return {"faults": self.faults, "handovers": self.checker.handovers}

    def _run(self) -> None:
        self.coordinator.start()
        core = self.coordinator.core
        # Placement needs a broker; the group protocol only needs the streams' shapes.
        core.handle("register", {"kind": "broker", "address": "broker0:9000", "node": "n0"}, 0.0)
        for name, streamlets in self.streams.items():
            core.handle("create_stream", {"name": name, "streamlets": streamlets}, 0.0)
        for name in self.member_names:
            self._start(name)
        self.sched.at(0.5, self._fault)
        self._until(ACTIVE_S)
        self._heal()
        self._until(self.sched.now + SETTLE_S_MAX, stop=self._settled)
        if not self._settled():
            raise InvariantBroken(f"{SETTLE_S_MAX} s after healing the group has not settled: "
                                  f"held {sorted(self.checker.owner.items())}")

    def _start(self, name: str) -> None:
        m = self.members[name] = SimGroupMember(
            self.net, f"{name}:1", random.Random(f"{self.seed}/{name}"), self.checker,
            name=name, streams=sorted(self.streams), session_timeout_ms=self.session_ms)
        m.start()

    def _until(self, t: float, stop=None) -> None:
        while self.sched.next_time() is not None and self.sched.next_time() <= t:
            self.sched.step()
            if self.coordinator.up:
                self.checker.observe_commits(self.coordinator.core.groups)
            if self.sched.steps > STEPS_MAX:
                raise SimFailure(f"more than {STEPS_MAX} events")
            if stop is not None and stop():
                return
        self.sched.now = max(self.sched.now, t)

    # -------------------------------------------------------------- faults
    def _fault(self) -> None:
        if self.sched.now >= ACTIVE_S - 1.0:
            return
        self.faults += 1
        kind = self.rng.choice(["crash", "leave", "cut", "cut_one_way", "burst", "coordinator"])
        name = self.rng.choice(self.member_names)
        self.fault_log.append(f"{self.sched.now:.3f} {kind} {name}")
        member = self.members.get(name)
        if kind in ("crash", "leave") and member is not None and member.up:
            member.crash() if kind == "crash" else member.leave()
            self.sched.after(self.rng.uniform(0.1, 3.0), self._restart, name)
        elif kind.startswith("cut") and member is not None:
            self.net.cut(member.address, COORDINATOR, self.sched.now + self.rng.uniform(0.2, 4.0),
                         both=(kind == "cut"))
        elif kind == "burst":
            self.net.loss = 0.5
            self.sched.after(self.rng.uniform(0.2, 2.0), self._burst_over)
        elif kind == "coordinator" and self.coordinator.up:
            self.coordinator.crash()
            self.sched.after(self.rng.uniform(0.1, 2.0), self._restart_coordinator)
        self.sched.after(self.rng.uniform(0.2, 1.5), self._fault)

    def _burst_over(self) -> None:
        self.net.loss = 0.0 if self.healed else self.base_loss

    def _restart(self, name: str) -> None:
        if not self.members[name].up:
            self._start(name)

    def _restart_coordinator(self) -> None:
        if not self.coordinator.up:
            self.coordinator.start()

    def _heal(self) -> None:
        self.healed = True
        self.net.healthy()
        if not self.coordinator.up:
            self.coordinator.start()
        for name, member in self.members.items():
            if not member.up:
                self._start(name)

    def _settled(self) -> bool:
        parts = {(s, sl) for s, n in self.streams.items() for sl in range(n)}
        live = {n for n, m in self.members.items() if m.up}
        return set(self.checker.owner) == parts and set(self.checker.owner.values()) <= live

