"""A whole cluster from one seed: build it, break it for a while, heal it, check it.

`Cluster(seed).run()` draws everything from the seed — how many brokers (1-2), backups (2-3),
producers and streams, their parameters, and a schedule of faults — runs the active phase with
faults, then heals (network and disks healthy, every crashed process restarted) and runs until
the cluster settles: every producer has every chunk answered, every consumer has read every
acknowledged record, no streamlet is recovering, every broker has every virtual segment fully
replicated. The checker runs throughout (tests/sim/checker.py); the final checks run once
settled. Any failure is raised as SimFailure naming the seed, the step and the simulated time.

Control-plane faults (issue 10), drawn from their own generator so that adding them left every
seed's other draws as they were (`draw_control_faults`): a wall-clock step (the wall clock jumps
forward by days, the monotonic clock does not; the streams then carry a retention bound far
longer than the run, so no acknowledged record may be deleted) and a duplicate-id daemon (a
second broker process starts with the id of a live one for a while: the coordinator must never
give it that id, and the live broker keeps everything, R=1 streamlets included).

Compaction and transactions (issues 38, 39), each in one seed in 4 from a generator of its own
(tests/sim/compaction.py, tests/sim/transactions.py): a compacted stream with keyed updates and
deletes whose brokers' compactor runs under the faults, and transactional producers (one may
be killed inside a transaction) with read_committed readers; their clients are left out of
the partitions' picks, so such a seed keeps its fault schedule.

Faults: message loss (a base rate and bursts), slow messages (past the timeouts), partitions
(one or both directions, between any two processes), backup crashes and restarts (before and
after the coordinator's dead-detection window), coordinator crashes and restarts, flush errors,
silently flipped bytes and slow flushes on a backup's disk, and in one seed in five a broker
crash (`_crash_broker`): what it acknowledged must be in the backups' stores at that moment,
the coordinator fails its streamlets over and their new owner recovers them from the backups,
and the broker comes back later as a new, empty incarnation.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

from kera import config

from kera.codec import chunk
from kera.backup.store import StoreConfig
from kera.broker.core import BrokerConfig
from kera.coordinator.rebalance import Plan

from tests.sim.checker import Checker, DataLost, InvariantBroken, chunk_id
from tests.sim.clients import SimAdmin, SimConsumer, SimKeyedConsumer, SimKeyedProducer, SimProducer
from tests.sim.transactions import ONGOING_STATES, TXN_CLIENT_BASE, GROUP_PREFIX, TxnLedger, draw_transactions
from tests.sim.txn_producer import SimTxnConsumer, SimTxnProducer
from tests.sim.compaction import KEYED_BATCH_MAX, KEYED_CLIENT, SHORT_DELETE_RETENTION_MS, Ledger, draw_compaction
from tests.sim.probes import SimAuditor, SimFuzzer
from tests.sim.daemons import WORK_S, MemoryStore, SimBackup, SimBroker, SimClock, SimCoordinator, sim_env
from tests.sim.disk import SimDisk
from tests.sim.network import Network
from tests.sim.scheduler import Scheduler
from tests.sim.shell import SimFailure

COORDINATOR = "coordinator:7000"
HEARTBEAT_INTERVAL_S = config.HEARTBEAT_INTERVAL_S
HEARTBEAT_MISSED_MAX = config.HEARTBEAT_MISSED_MAX
SETTLE_CHECK_S = 0.25
# Simulated seconds the healed cluster gets to settle: healthy seeds take up to ~12 s (a lost
# produce request waits out the producer's 10 s request timeout, then its retry backs off).
HEAL_LIMIT_S = 30.0
DEAD_AFTER_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSED_MAX   # the coordinator's dead window
# A cut between the coordinator and a daemon this long may get the daemon declared dead.
RISKY_CUT_S = DEAD_AFTER_S / 2
FAILURE_CHECK_S = 0.25
# After healing, a daemon that stopped itself (exit 1: say a broker refused `id_in_use` while a
# crashed second process still held its id, seed 775 with 8 requests in flight) is started
# again this long after, as a supervisor restarting it on failure would (systemd's RestartSec).
SUPERVISOR_RESTART_S = 1.0
# Control-plane faults: each drawn in one seed in CONTROL_FAULT_ONE_IN (a seed may get both).
CONTROL_FAULT_ONE_IN = 8
WALL_STEP_DAYS_MIN, WALL_STEP_DAYS_MAX = 1.0, 30.0
# The retention bound of every stream in a seed with a wall-clock step: an hour, far beyond a
# run's simulated time (< 1 min), so retention may delete no acknowledged record.
RETENTION_BOUND_MS = 3_600_000
# How long a duplicate-id daemon runs (it is then killed, before the healing).
DUPLICATE_UP_S_MIN, DUPLICATE_UP_S_MAX = 0.5, 2.0


@dataclass
class Failure:
    """A data-losing failure (`real`: a crash, a restart, a declared death, a damaged disk) or
    a hazard that may turn into one (a long cut between a daemon and the coordinator). It
    heals once the cluster holds R copies of everything again (`Cluster._redundant`), not
    before `ready_at` (the process is back, the disk healthy, the link restored)."""
    kind: str
    target: str
    start: float
    ready_at: float
    real: bool = True
    healed_at: float | None = None


@dataclass
class Profile:
    """Everything about a run that the seed decides before it starts."""
    duration_s: float
    brokers: int
    backups: int
    producers: int
    streams: list[dict]
    virtual_logs: int
    virtual_segment_bytes: int
    store: dict
    loss: float
    slow: float
    faults: list = field(default_factory=list)    # (time, kind)
    broker_crash_at: float | None = None
    control_faults: list = field(default_factory=list)   # (time, kind, arg): draw_control_faults
    compaction: dict | None = None    # a compacted stream and its keyed producer: draw_compaction
    transactions: dict | None = None  # transactional streams and producers: draw_transactions

    @classmethod
    def draw(cls, rng: random.Random, duration_s: float | None = None) -> "Profile":
        duration_s = duration_s if duration_s is not None else rng.uniform(3.0, 7.0)
        brokers = rng.choice([1, 1, 2])
        backups = rng.choice([2, 3, 3])
        streams = []
        for i in range(rng.choice([1, 2, 2])):
            streams.append({
                "name": f"s{i}", "streamlets": rng.randint(1, 3), "active_groups": rng.randint(1, 2),
                "replication": rng.choice([1, 2, 2, 3, 3]),   # 3 needs both of 2 backups
                "group_segments": rng.randint(1, 3),
                "segment_size_bytes": rng.choice([4096, 8192, 16384]),
                "durability": rng.choice(["memory", "memory", "disk"]),
                "replication_capacity": rng.choice([0, 0, 1]),
            })
        store = {"max_unflushed_bytes": rng.choice([16 * 1024, 64 * 1024, 256 * config.MiB]),
                 "flush_job_max_bytes": rng.choice([4096, 16 * config.MiB])}
        store["max_memory_bytes"] = store["max_unflushed_bytes"] * rng.choice([1, 2, 8])
        # Group commit of "memory" writes (the daemon's default window) in the profiles with
        # small flush jobs: no draw of its own, so every seed keeps the profile it had.
        store["flush_delay_s"] = 0.05 if store["flush_job_max_bytes"] == 4096 else 0.0
        faults = []
        rate = rng.choice([0.0, 1.0, 2.0, 4.0])       # fault events per simulated second
        t = 0.5
        broker_crash_at = rng.uniform(1.0, duration_s) if rng.random() < 0.2 else None
        kinds = ["loss", "slow", "partition", "partition", "disk_errors", "disk_slow",
                 "coordinator_crash"]
        if broker_crash_at is None:
            # A second fault that destroys copies (a backup's memory, a disk byte) on top of a
            # broker crash may lose acknowledged data legitimately (guarantee 5 is about one
            # process): those seeds crash the broker only.
            kinds += ["backup_crash", "backup_crash", "disk_flips", "handover"]
        while rate:
            t += rng.expovariate(rate)
            if t >= duration_s:
                break
            faults.append((t, rng.choice(kinds)))
        return cls(duration_s=duration_s, brokers=brokers, backups=backups,
                   producers=rng.randint(1, 3), streams=streams,
                   virtual_logs=rng.randint(1, 3),
                   virtual_segment_bytes=rng.choice([2048, 8192, 65536]), store=store,
                   loss=rng.choice([0.0, 0.0, 0.001, 0.01]), slow=rng.choice([0.0, 0.001, 0.01]),
                   faults=faults, broker_crash_at=broker_crash_at)


def draw_control_faults(seed: int, profile: Profile) -> list[tuple[float, str, float]]:
    """The seed's control-plane faults, (time, kind, arg), from a generator of their own:
    a wall-clock step (arg: its size in seconds) and a duplicate-id daemon (arg: how long it runs;
    the broker whose id it takes is drawn when it starts)."""
    rng = random.Random(f"{seed}/control")
    out = []
    latest = max(0.6, profile.duration_s - DUPLICATE_UP_S_MAX)
    if rng.randrange(CONTROL_FAULT_ONE_IN) == 0:
        out.append((rng.uniform(0.5, profile.duration_s), "wall_clock_step",
                    rng.uniform(WALL_STEP_DAYS_MIN, WALL_STEP_DAYS_MAX) * 86400.0))
    if rng.randrange(CONTROL_FAULT_ONE_IN) == 0:
        out.append((rng.uniform(0.5, latest), "duplicate_id",
                    rng.uniform(DUPLICATE_UP_S_MIN, DUPLICATE_UP_S_MAX)))
    return out


def control_fault_kinds(seed: int) -> set[str]:
    """The kinds of control-plane fault a seed draws (for tests that mark expected failures)."""
    profile = Profile.draw(random.Random(f"{seed}/profile"))
    return {kind for _, kind, _ in draw_control_faults(seed, profile)}


@dataclass
class Report:
    seed: int
    steps: int
    sim_time_s: float
    settled_at_s: float
    counts: dict
    digest: int = 0      # CRC32 of every delivery: equal for equal runs
    # Set when acknowledged data was lost while more data-losing failures overlapped than R-1
    # copies cover (beyond DESIGN.md guarantee 5): the run is classified, not failed.
    beyond_guarantee: str = ""

    def line(self) -> str:
        c = self.counts
        return (f"seed {self.seed}: {self.steps} steps, {self.sim_time_s:.1f} s simulated "
                f"(settled {self.settled_at_s:.1f} s), {c.get('records_acked', 0)} records acked, "
                f"{c.get('records_read', 0)} read, {c.get('faults', 0)} faults, "
                f"digest {self.digest:08x}"
                + (f"; BEYOND GUARANTEE: {self.beyond_guarantee}" if self.beyond_guarantee else ""))


class Cluster:
    def __init__(self, seed: int, *, duration_s: float | None = None, trace: bool = False,
                 logs: bool = False, profile: Profile | None = None):
        self.seed = seed
        rng = random.Random(seed)
        self.rng = random.Random(f"{seed}/faults")
        if profile is None:
            profile = Profile.draw(random.Random(f"{seed}/profile"), duration_s)
            profile.control_faults = draw_control_faults(seed, profile)
            profile.compaction = draw_compaction(seed)
            profile.transactions = draw_transactions(seed, profile.duration_s)
        self.profile = p = profile
        if any(kind == "wall_clock_step" for _, kind, _ in p.control_faults):
            for spec in p.streams:
                spec.setdefault("retention_ms", RETENTION_BOUND_MS)
        self.sched = Scheduler()
        self.clock = SimClock(self.sched)    # the daemons' `time`: its wall clock can step
        # Broker address -> the incarnation running when the wall clock stepped: that process
        # must delete nothing (ages follow its monotonic clock). One started after the step has
        # only the wall clock to go by (kera.broker.retention: bounded deletions, logged).
        self._stepped_incarnations: dict[str, int] = {}
        self.trace: list | None = [] if trace else None
        self.logs = logs          # leave the cores' logging alone (else: only CRITICAL)
        self.net = Network(self.sched, random.Random(f"{seed}/net"), self.trace)
        self.net.loss, self.net.slow = p.loss, p.slow
        self.checker = Checker()
        self.store = MemoryStore()
        env = sim_env(self.sched, self.store, self.clock)   # every daemon's outside world
        self.counts: dict[str, int] = {"faults": 0}
        self.lost_streamlets: set = self.checker.lossy   # (sid, sl) that may lose data legitimately
        self.epochs: dict[int, set] = {}      # broker id -> incarnation epochs seen
        self.crashed_brokers: list = []
        self.settled_at = None
        self.healed = False
        # Data-losing failures and hazards (Failure): the schedule injects no data-losing fault
        # while one is unhealed, so the run tests the single-failure guarantee.
        self.failures: list[Failure] = []
        self.max_overlap = 0          # most real failures unhealed at once
        node_rng = lambda name: random.Random(f"{seed}/{name}")   # noqa: E731

        self.coordinator = SimCoordinator(self.net, "coordinator", 7000, node_rng("coordinator"), env,
                                          heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                                          heartbeat_missed_max=HEARTBEAT_MISSED_MAX)
        self.coordinator.on_death = self._declared_dead
        cfg = BrokerConfig(virtual_logs=p.virtual_logs, virtual_segment_bytes=p.virtual_segment_bytes)
        work_s = p.compaction["pass_s"] if p.compaction else WORK_S
        self.brokers = [SimBroker(self.net, f"broker{i}", 9000, node_rng(f"broker{i}"), self.checker,
                                  env, coordinator=COORDINATOR, node=f"n{i}", broker_id=i, cfg=cfg,
                                  work_rng=node_rng(f"broker{i}/worker"), work_s=work_s)
                        for i in range(p.brokers)]
        self.broker_by_id = {b.broker_id: b for b in self.brokers}
        store_config = StoreConfig(**p.store)
        self.backups = [SimBackup(self.net, f"backup{i}", 8000, node_rng(f"backup{i}"), self.checker,
                                  env, coordinator=COORDINATOR, node=rng.choice(["n0", "n1", "n2", "n3"]),
                                  backup_id=i, disk=SimDisk(random.Random(f"{seed}/disk{i}")),
                                  store_config=store_config)
                        for i in range(p.backups)]
        self._build_clients(rng)
        self._build_compaction()
        self._build_transactions()
        self.auditor = SimAuditor(self.net, "auditor:1", node_rng("auditor"), self.checker, COORDINATOR, self)
        self.fuzzer = SimFuzzer(self.net, "fuzzer:1", node_rng("fuzzer"), self.checker, COORDINATOR, self)
        # Second processes claiming a live broker's id (control fault "duplicate_id"), by fault.
        self.duplicates = self._duplicate_daemons(env, cfg)
        self._duplicate_until: dict[int, float] = {}   # broker id -> end of its duplicate's watch
        self._duplicate_admitted: list[float] = []     # when a register reply gave it the id
        self._supervising: set[str] = set()   # addresses of stopped daemons due a restart
        self.daemons = [self.coordinator, *self.brokers, *self.backups]
        # (Partitions pick among these: the keyed clients are left out, so that a seed that
        # draws compaction keeps the fault schedule it had.)
        self.processes = [*self.daemons, self.admin, *self.producers, *self.consumers, self.auditor]

    def _duplicate_daemons(self, env, cfg: BrokerConfig) -> dict:
        return {i: SimBroker(self.net, f"duplicate{i}", 9000, self._node_rng(f"duplicate{i}"),
                             self.checker, env, coordinator=COORDINATOR, node=f"dup{i}",
                             broker_id=0, cfg=cfg)
                for i, (t, kind, _) in enumerate(self.profile.control_faults) if kind == "duplicate_id"}

    def _build_clients(self, rng: random.Random) -> None:
        """The admin creating every stream, and the plain producers and consumers (their ids,
        intervals and fetch sizes drawn from the seed's `rng`, in this order)."""
        p, comp, txn = self.profile, self.profile.compaction, self.profile.transactions
        specs = p.streams + ([comp["stream"]] if comp else []) + (txn["streams"] if txn else [])
        self.admin = SimAdmin(self.net, "admin:1", self._node_rng("admin"), self.checker, COORDINATOR, specs)
        names = [s["name"] for s in p.streams]
        self.producers = [SimProducer(self.net, f"producer{i}:1", self._node_rng(f"producer{i}"), self.checker,
                                      COORDINATOR, client=i, producer_id=rng.randrange(1 << 64),
                                      streams=names, request_timeout_s=config.DEFAULT_REQUEST_TIMEOUT_S,
                                      interval_s=rng.choice([0.005, 0.02, 0.05]), records_max=4000)
                          for i in range(p.producers)]
        self.consumers = [SimConsumer(self.net, f"consumer{i}:1", self._node_rng(f"consumer{i}"), self.checker,
                                      COORDINATOR, name=f"consumer {i} ({name})", stream=name,
                                      request_timeout_s=config.DEFAULT_REQUEST_TIMEOUT_S,
                                      idle_wait_s=0.05, fetch_max_bytes=rng.choice([512, 8192, 1 << 20]))
                          for i, name in enumerate(names)]

    def _build_compaction(self) -> None:
        """The compacted stream's keyed producer and its consumer (tests/sim/compaction.py)."""
        p, comp = self.profile, self.profile.compaction
        self.ledger = Ledger(self.checker.lossy, tombstones_expire=bool(comp) and (
            comp["stream"]["delete_retention_ms"] <= SHORT_DELETE_RETENTION_MS
            or any(kind == "wall_clock_step" for _, kind, _ in p.control_faults)))
        self.checker.moving = self.ledger.stream_ids
        self.keyed_producers: list[SimKeyedProducer] = []
        self.keyed_consumers: list[SimKeyedConsumer] = []
        if not comp:
            return
        name = comp["stream"]["name"]
        self.keyed_producers.append(SimKeyedProducer(
            self.net, "kproducer0:1", self._node_rng("kproducer0"), self.checker, COORDINATOR,
            client=KEYED_CLIENT, producer_id=comp["producer_id"], streams=[name],
            request_timeout_s=config.DEFAULT_REQUEST_TIMEOUT_S, interval_s=comp["interval_s"],
            records_max=comp["records_max"], batch_max=KEYED_BATCH_MAX, ledger=self.ledger,
            keys=comp["keys"], tombstone_rate=comp["tombstone_rate"]))
        self.keyed_consumers.append(SimKeyedConsumer(
            self.net, "kconsumer0:1", self._node_rng("kconsumer0"), self.checker, COORDINATOR,
            name=f"consumer c ({name})", stream=name,
            request_timeout_s=config.DEFAULT_REQUEST_TIMEOUT_S, idle_wait_s=0.05,
            fetch_max_bytes=comp["fetch_max_bytes"], ledger=self.ledger))

    def _build_transactions(self) -> None:
        """Transactional producers and their streams' read_committed consumers
        (tests/sim/transactions.py); a producer killed is replaced in its slot."""
        txn = self.profile.transactions
        self.txn_ledger = TxnLedger(lambda: self.sched.now)
        self.txn_producers: list[SimTxnProducer] = [
            self._txn_producer(i, 0) for i in range(txn["producers"] if txn else 0)]
        self.txn_consumers = [SimTxnConsumer(
            self.net, f"tconsumer{i}:1", self._node_rng(f"tconsumer{i}"), self.checker,
            COORDINATOR, name=f"consumer t ({spec['name']})", stream=spec["name"],
            request_timeout_s=config.DEFAULT_REQUEST_TIMEOUT_S, idle_wait_s=0.05,
            fetch_max_bytes=8192, ledger=self.txn_ledger)
            for i, spec in enumerate(txn["streams"] if txn else [])]

    def _node_rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}/{name}")

    # ================================================================== running
    def run(self) -> Report:
        level = logging.getLogger("kera").level
        if not self.logs:
            logging.getLogger("kera").setLevel(logging.CRITICAL)   # faults make the cores chatty
        beyond = ""
        try:
            try:
                self._run()
            except DataLost as exc:
                beyond = self._beyond_guarantee(exc)
                if not beyond:
                    raise
        except SimFailure as exc:
            raise SimFailure(f"{self._where()}: {exc}") from exc
        except Exception as exc:
            raise SimFailure(f"{self._where()}: the harness raised {exc.__class__.__name__}: {exc}") from exc
        finally:
            logging.getLogger("kera").setLevel(level)
        counts = dict(self.counts)
        counts.update(self.checker.counts)
        counts.update(self.ledger.counts)
        counts.update(self.txn_ledger.counts)
        if self.ledger.stream_ids:
            counts["compaction_passes"] = sum(b.daemon.compaction.compactor.passes
                                              for b in self.brokers if b.up)
        counts["messages"] = self.net.sent
        counts["messages_lost"] = self.net.lost
        counts["corruptions_detected"] = self.auditor.detected
        counts["replica_reads"] = self.auditor.reads
        counts["bad_inputs"] = self.fuzzer.sent
        counts["max_overlapping_failures"] = self.max_overlap
        counts["failures"] = sum(f.real for f in self.failures)
        return Report(self.seed, self.sched.steps, self.sched.now, self.settled_at or 0.0, counts,
                      self.net.digest, beyond)

    NO_BROKER_DISK = " on a broker without a data dir"

    def _beyond_guarantee(self, exc: DataLost) -> str:
        """Acknowledged data of a stream with R copies is lost: excused (the reason) only if at
        least R data-losing failures were unhealed at once; "" (a bug) otherwise."""
        replication = exc.replication
        if replication is None:
            stream = self.coordinator.core.streams.get(exc.stream_id) if self.coordinator.up else None
            replication = stream.spec.replication if stream is not None else 1
        if self.max_overlap < max(replication, 1):
            return ""
        # R=1 on a simulated broker: it runs without a data dir (SimBroker), so a crash loses its
        # disk too, which is beyond guarantee 5. With a data dir the chunks would be kept
        # (tier_files `.live`, tests/faults/test_r1_kill.py); the simulation does not model it.
        overlap = ", ".join(f"{f.kind} {f.target} at {f.start:.2f}s" for f in self.failures if f.real)
        return (f"{exc} -- after {self.max_overlap} overlapping data-losing failures with "
                f"R={replication}{self.NO_BROKER_DISK if replication == 1 else ''} ({overlap})")

    def _where(self) -> str:
        return (f"seed {self.seed} (rerun: KERA_SIM_SEED={self.seed}), step {self.sched.steps}, "
                f"t={self.sched.now:.4f}s")

    def _run(self) -> None:
        p = self.profile
        s = self.sched
        s.at(0.0, self.coordinator.start)
        for d in [*self.brokers, *self.backups]:
            s.at(self.rng.uniform(0.0, 0.1), d.start)
        s.at(0.1, self.admin.start)
        for c in [*self.producers, *self.consumers]:
            s.at(self.rng.uniform(0.2, 0.5), c.start)
        for c in self.keyed_producers:
            s.at(0.3, c.start)
        for c in self.keyed_consumers:
            s.at(p.compaction["consumer_start_s"], c.start)
        for c in [*self.txn_producers, *self.txn_consumers]:
            s.at(0.3, c.start)
        if p.transactions and p.transactions["kill"] is not None:
            s.at(p.transactions["kill"][1], self._kill_txn_producer)
        s.at(0.5, self.auditor.start)
        s.at(0.5, self.fuzzer.start)
        for t, kind in p.faults:
            s.at(t, self._fault, kind)
        if p.broker_crash_at is not None:
            s.at(p.broker_crash_at, self._crash_broker)
        for i, (t, kind, arg) in enumerate(p.control_faults):
            s.at(t, self._control_fault, kind, arg, self.duplicates.get(i))
        s.at(p.duration_s, self._heal)
        s.at(0.0, self._observe)
        s.at(0.0, self._check_failures)
        limit = p.duration_s + HEAL_LIMIT_S
        while self.settled_at is None:
            if not s.step():
                raise InvariantBroken("the simulation ran out of events")
            if s.now > limit:
                # Data lost says more than "still waiting": check what owners hold first.
                self.checker.check_brokers_hold(self.owners())
                self.ledger.check_owners(self.owners(), self.lost_streamlets)
                if self.txn_producers and not self._txn_unsettled().startswith("txn producer"):
                    self.txn_ledger.check(self._txn_positions())
                raise InvariantBroken(f"the healed cluster did not settle within {HEAL_LIMIT_S} s: "
                                      f"{self._unsettled()}")
        self._final_checks()

    # ================================================================== faults
    def _note(self, text: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.sched.now:.6f} ** {text}")

    # ------------------------------------------------------------ data-losing failures
    def _unhealed(self, real_only: bool = False) -> list[Failure]:
        return [f for f in self.failures if f.healed_at is None and (f.real or not real_only)]

    def _fail(self, kind: str, target: str, ready_at: float, real: bool = True) -> Failure:
        f = Failure(kind, target, self.sched.now, ready_at, real)
        self.failures.append(f)
        self.max_overlap = max(self.max_overlap, len(self._unhealed(real_only=True)))
        self._note(f"failure: {kind} {target}{'' if real else ' (hazard)'}")
        return f

    def _skip(self, kind: str) -> None:
        """A data-losing fault not injected: another failure is unhealed."""
        self.counts["faults_held_back"] = self.counts.get("faults_held_back", 0) + 1
        self._note(f"fault held back: {kind} (a failure is unhealed)")

    def _check_failures(self) -> None:
        """Heal failures once the cluster is redundant again."""
        now = self.sched.now
        pending = [f for f in self._unhealed() if f.ready_at <= now]
        if pending and self._redundant():
            for f in pending:
                f.healed_at = now
                self._note(f"healed: {f.kind} {f.target}")
        self.sched.after(FAILURE_CHECK_S, self._check_failures)

    def _declared_dead(self, kind: str, member_id: int) -> None:
        """The coordinator declared a daemon dead (SimCoordinator.on_death): a real failure,
        its in-memory copies are unreachable for good."""
        target = f"{kind}{member_id}"
        for f in self._unhealed():
            if f.target == target and f.kind in ("backup_crash", "broker_crash"):
                return             # the crash we injected: counted already
        for f in self._unhealed():
            if f.target == target and not f.real:
                f.real = True      # the hazard came true
                f.kind = "declared_dead (cut)"
                self.max_overlap = max(self.max_overlap, len(self._unhealed(real_only=True)))
                return
        self._fail("declared_dead", target, self.sched.now)

    def _redundant(self) -> bool:
        """Every process up and alive to the coordinator, no handover pending, nothing
        recovering, every virtual segment on all its replicas, every acknowledged chunk on R-1
        intact backup copies."""
        if not self.coordinator.up or not all(d.up for d in self.daemons):
            return False
        core = self.coordinator.core
        for kind in ("broker", "backup"):
            if not all(m.alive for m in core.members.get(kind, {}).values()):
                return False
        if core.rebalancer.pending is not None:
            # A handover started but its broker has not dropped its streams yet (its next
            # heartbeat does): its recovery is still to come, and a second failure before it
            # is done loses what only the broker and one backup held.
            return False
        for stream in core.streams.values():
            if core.descriptor(stream).get("recovering"):
                return False
        for b in self.brokers:
            for vlog in b.core.vlog_list:
                for vs in vlog.vsegs:
                    if not all(r is not None and r.acked_idx == len(vs.idxs) for r in vs.replicas):
                        return False
        held = self.backup_holdings()
        for cid, (_, _, replication) in self.checker.acked_chunks.items():
            if replication >= 2 and cid[:2] not in self.lost_streamlets and \
                    cid[0] not in self.checker.moving and \
                    sum(held.get(cid, {}).values()) < replication - 1:
                return False
        return True

    def _fault(self, kind: str) -> None:
        rng = self.rng
        now = self.sched.now
        if kind in ("backup_crash", "disk_flips", "handover") and self._unhealed():
            self._skip(kind)
            return
        self.counts["faults"] += 1
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self._note(f"fault: {kind}")
        if kind == "loss":
            self.net.loss = rng.uniform(0.01, 0.2)
            self.sched.after(rng.uniform(0.1, 1.5), self._restore_net)
        elif kind == "slow":
            self.net.slow = rng.uniform(0.02, 0.2)
            self.sched.after(rng.uniform(0.1, 1.5), self._restore_net)
        elif kind == "partition":
            a, b = rng.sample([x.address for x in self.processes], 2)
            until, both = now + rng.uniform(0.05, 3.5), rng.random() < 0.7
            daemon = self._daemon_cut_from_coordinator(a, b)
            if daemon is not None and until - now >= RISKY_CUT_S:
                # Long enough to get the daemon declared dead: a data-losing failure.
                if self._unhealed():
                    self._skip(kind)
                    return
                self._fail("cut", daemon, until + DEAD_AFTER_S, real=False)
            self.net.cut(a, b, until, both=both)
            self._note(f"link {a} {'<' if both else ''}-> {b} cut until {until:.3f}")
        elif kind == "backup_crash":
            up = [b for b in self.backups if b.up]
            if len(up) == len(self.backups):          # one backup down at a time
                victim = rng.choice(up)
                victim.crash()
                self._note(f"{victim.address} crashed")
                down_s = rng.choice([rng.uniform(0.01, 0.5), rng.uniform(1.0, 4.0)])
                self.sched.after(down_s, self._restart, victim)
                # Ready no sooner than the restart (or the healing, which restarts it too).
                self._fail("backup_crash", f"backup{victim.backup_id}",
                           min(now + down_s, self.profile.duration_s))
        elif kind == "handover":
            self._handover()
        elif kind == "coordinator_crash":
            if self.coordinator.up:
                self.coordinator.crash()
                self.sched.after(rng.uniform(0.05, 3.0), self._restart, self.coordinator)
        elif kind.startswith("disk_"):
            target = rng.choice(self.backups)
            disk = target.disk
            self._note(f"{kind} on {target.address}")
            if kind == "disk_errors":
                disk.error_rate = rng.uniform(0.2, 1.0)
            elif kind == "disk_flips":
                disk.flip_rate = rng.uniform(0.05, 0.5)
                self._flips = self._fail("disk_flips", f"backup{target.backup_id}", math.inf)
            else:
                disk.slow_rate = rng.uniform(0.2, 1.0)
            self.sched.after(rng.uniform(0.1, 2.0), self._disk_healthy, disk,
                             self._flips if kind == "disk_flips" else None)

    def _handover(self) -> None:
        """An operator's rebalance step (kera.coordinator.rebalance) forced on a random live
        broker, whatever the plan: it drops its replicated streams and registers again, its
        process kept, and they are recovered from the backups. As risky as its restart."""
        if not self.coordinator.up:
            return
        core, now = self.coordinator.core, self.coordinator.daemon.clock.monotonic()
        live = [b for b in self.brokers if b.up and b.broker_id is not None and
                core.members["broker"].get(b.broker_id) is not None and
                core.members["broker"][b.broker_id].alive]
        if not live or core.rebalancer.busy(core, now):
            self._note("handover not started: no live broker or a step is in progress")
            return
        victim = self.rng.choice(live)
        core.rebalancer.start(core, Plan({}, victim.broker_id, 0, {}), now, "simulated operator")
        self._fail("handover", f"broker{victim.broker_id}", self.sched.now)

    # ------------------------------------------------------------ control-plane faults
    def _control_fault(self, kind: str, arg: float, dup: SimBroker | None) -> None:
        self.counts["faults"] += 1
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "wall_clock_step":
            self.clock.wall_step_s += arg
            self._stepped_incarnations = {b.address: b.incarnation for b in self.brokers if b.up}
            self._note(f"fault: the wall clock steps {arg / 86400:.1f} days forward")
            return
        if not self.coordinator.up or not all(b.up for b in self.brokers):
            # Claiming an id needs a coordinator to claim it from, and a live owner to take it
            # from: wait for both (within the active phase).
            if self.sched.now + FAILURE_CHECK_S < self.profile.duration_s:
                self.counts[kind] -= 1
                self.counts["faults"] -= 1
                self.sched.after(FAILURE_CHECK_S, self._control_fault, kind, arg, dup)
            return
        victim = self.rng.choice(self.brokers)
        dup.broker_id = victim.broker_id
        self._note(f"fault: {dup.address} starts with the id of broker {victim.broker_id}")
        dup.start()
        self._watch_registration(dup)
        self.sched.after(arg, dup.crash)
        # Watched until its registration, if any, would have expired.
        self._duplicate_until[victim.broker_id] = self.sched.now + arg + DEAD_AFTER_S
        self._check_duplicate(dup)

    def _watch_registration(self, dup: SimBroker) -> None:
        """Note every `register` reply that gives the duplicate the id it asked for: the
        coordinator's table may flip back (the live broker registers again) between checks."""
        peer = dup.server.peer(dup.daemon.link.address)
        live = self.brokers[dup.broker_id].address

        def on_reply(header, frames, real=peer.on_reply):
            if header.get("ok") is True and header.get("daemon_id") == dup.broker_id:
                # The id is free once the coordinator heard nothing from its holder for the dead
                # window (a partition or lost messages made it look stopped): not a violation.
                heard = self.net.delivered_at.get((live, self.coordinator.address), 0.0)
                if self.sched.now - heard < DEAD_AFTER_S:
                    self._duplicate_admitted.append(self.sched.now)
                else:
                    self._note(f"{dup.address} took broker id {dup.broker_id}: its holder was "
                               f"silent for {self.sched.now - heard:.2f} s")
                    self._duplicate_until[dup.broker_id] = self.sched.now   # watched no more
            real(header, frames)

        peer.on_reply = on_reply

    def _check_duplicate(self, dup: SimBroker) -> None:
        """The coordinator must never give a live broker's id to a second process (issue 10
        item 1: incarnation tokens; the duplicate is refused with a clear error)."""
        if not self._duplicate_watched(dup.broker_id):
            return   # its registration expired, or the id was free when it took it
        if self._duplicate_admitted:
            raise InvariantBroken(
                f"a second process at {dup.address} registered as broker {dup.broker_id} at "
                f"{self._duplicate_admitted[0]:.3f}s while broker{dup.broker_id} was live (issue "
                f"10 item 1: a duplicate id must be refused)")
        if self.coordinator.up:
            member = self.coordinator.core.members["broker"].get(dup.broker_id)
            if member is not None and member.address == dup.address:
                raise InvariantBroken(
                    f"broker id {dup.broker_id} was taken over by a second process at "
                    f"{dup.address} while broker{dup.broker_id} was live (issue 10 item 1: a "
                    f"duplicate id must be refused)")
        if self.sched.now < self._duplicate_until[dup.broker_id]:
            self.sched.after(FAILURE_CHECK_S, self._check_duplicate, dup)

    def _duplicate_watched(self, broker_id: int) -> bool:
        return self.sched.now < self._duplicate_until.get(broker_id, -1.0)

    def _check_retention_bound(self) -> None:
        """In a seed with a wall-clock step every stream keeps records RETENTION_BOUND_MS, far
        longer than the run: a group deleted by retention, by a broker process that was running
        when the clock stepped, was acknowledged data lost (issue 10 item 7: retention ages a
        wall-clock step cannot collapse within a process)."""
        if self.clock.wall_step_s == 0.0:
            return
        for b in self.brokers:
            if not b.up or self._stepped_incarnations.get(b.address) != b.incarnation:
                continue
            deleted = b.core.counters.get("groups_deleted", 0)
            if deleted:
                raise InvariantBroken(
                    f"broker {b.address} deleted {deleted} groups by retention within the "
                    f"retention bound ({RETENTION_BOUND_MS} ms; the run is {self.sched.now:.1f} s "
                    f"old) after the wall clock stepped {self.clock.wall_step_s / 86400:.1f} days")

    def _disk_healthy(self, disk: SimDisk, flips: Failure | None) -> None:
        disk.healthy()     # (healthy for good once healed)
        if flips is not None:
            flips.ready_at = self.sched.now

    def _observe(self) -> None:
        """Note broker incarnations (the coordinator's epochs). A broker failed over (crashed,
        or declared dead while slow) comes back as a new incarnation: its R=1 streamlets lose
        their data by design (nothing replicates them), so they leave the end checks."""
        if self.coordinator.up:
            failover = getattr(self.coordinator.core, "failover", None)
            for broker_id, epoch in getattr(failover, "epochs", {}).items():
                seen = self.epochs.setdefault(broker_id, set())
                if epoch not in seen:
                    seen.add(epoch)
                    # A failover a duplicate-id daemon caused excuses nothing: the live broker
                    # must keep everything, its R=1 streamlets included. One its own crash
                    # caused does, even if first seen while a duplicate is watched.
                    crashed = any(f.real and f.kind == "broker_crash" and f.target == f"broker{broker_id}"
                                  for f in self.failures)
                    if len(seen) > 1 and (crashed or not self._duplicate_watched(broker_id)):
                        self._lose_r1_streamlets()
        self._check_retention_bound()
        self.sched.after(0.1, self._observe)

    def _lose_r1_streamlets(self) -> None:
        for stream in self.coordinator.core.streams.values():
            if stream.spec.replication == 1:
                self.lost_streamlets.update((stream.id, sl) for sl in range(stream.spec.streamlets))

    def _daemon_cut_from_coordinator(self, a: str, b: str) -> str | None:
        """The daemon ("broker0", "backup1") a cut between a and b separates from the
        coordinator, if it does."""
        ends = {a, b}
        if self.coordinator.address not in ends:
            return None
        other = (ends - {self.coordinator.address}).pop()
        for d in self.brokers:
            if d.address == other:
                return f"broker{d.broker_id}"
        for d in self.backups:
            if d.address == other:
                return f"backup{d.backup_id}"
        return None

    def _restore_net(self) -> None:
        if not self.healed:
            self.net.loss, self.net.slow = self.profile.loss, self.profile.slow

    def _restart(self, daemon) -> None:
        if not daemon.up and self.settled_at is None:
            self._note(f"{daemon.address} restarts")
            daemon.start()

    def _supervisor_restart(self, daemon) -> None:
        self._supervising.discard(daemon.address)
        if not daemon.up and self.settled_at is None:
            self._note(f"{daemon.address} stopped itself after healing: its supervisor starts it")
            self._restart(daemon)

    def _crash_broker(self) -> None:
        """kill -9 a broker: everything it acknowledged must be on the backups right now; the
        coordinator fails its streamlets over to a live broker, which recovers them from the
        backups; the broker comes back later (or at healing) as a new, empty incarnation."""
        up = [b for b in self.brokers if b.up]
        if not up:
            return
        if self._unhealed():
            # Held back until the failure before it healed (within the active phase).
            if self.sched.now + 0.5 < self.profile.duration_s:
                self.sched.after(0.5, self._crash_broker)
            else:
                self._skip("broker_crash")
            return
        victim = self.rng.choice(up)
        self.counts["broker_crash"] = 1
        self.check_recoverable(victim)
        victim.crash()
        self._note(f"{victim.address} crashed")
        self.crashed_brokers.append(victim)
        down_s = self.rng.uniform(0.05, 4.0)
        self.sched.after(down_s, self._restart, victim)
        self._fail("broker_crash", f"broker{victim.broker_id}",
                   min(self.sched.now + down_s, self.profile.duration_s))

    def _heal(self) -> None:
        self._note("healing: network and disks healthy, every process up")
        self.healed = True
        self.net.healthy()
        for b in self.backups:
            b.disk.healthy()
        for f in self._unhealed():
            f.ready_at = min(f.ready_at, self.sched.now)
        for d in self.daemons:
            if not d.up:
                self._restart(d)
        for p in [*self.producers, *self.keyed_producers]:
            p.producing = False
        for i, tp in enumerate(self.txn_producers):
            if not tp.up:
                self._restart_txn_producer(i)
            self.txn_producers[i].finish()
        self.sched.after(SETTLE_CHECK_S, self._check_settled)

    # ------------------------------------------------------------ transactions
    def _txn_producer(self, i: int, first_k: int) -> SimTxnProducer:
        return SimTxnProducer(self.net, f"tproducer{i}:1", self._node_rng(f"tproducer{i}/{first_k}"),
                              self.checker, COORDINATOR, client=TXN_CLIENT_BASE + i,
                              spec=self.profile.transactions, ledger=self.txn_ledger,
                              request_timeout_s=config.DEFAULT_REQUEST_TIMEOUT_S, first_k=first_k)

    def _kill_txn_producer(self) -> None:
        """kill -9 of a transactional producer, most likely inside a transaction: what it left
        open must be aborted by its next instance's fence or by the transaction timeout."""
        i, _, down_s = self.profile.transactions["kill"]
        victim = self.txn_producers[i]
        if self.healed or not victim.up:
            return
        victim.crash()
        self.txn_ledger.killed(victim.client)
        self.counts["txn_producer_killed"] = 1
        self._note(f"{victim.address} killed in phase {victim.phase}")
        self.sched.after(down_s, self._restart_txn_producer, i)

    def _restart_txn_producer(self, i: int) -> None:
        old = self.txn_producers[i]
        if old.up:
            return
        new = self.txn_producers[i] = self._txn_producer(i, old.k + 1)
        if self.healed:
            new.finish()
        self._note(f"{new.address} starts again")
        new.start()

    def _txn_unsettled(self) -> str:
        for tp in self.txn_producers:
            if not tp.idle():
                return f"{tp.name} is running transaction {tp.k} ({tp.phase})"
        txns = self.coordinator.core.transactions
        if txns.prepared or any(t.state in ONGOING_STATES for t in txns.txns.values()):
            return f"the coordinator holds transactions open: {sorted(txns.prepared)[:3]}"
        for c in self.txn_consumers:
            if c.state is None:
                return f"{c.name} has not found its stream"
            if c.errors:
                return f"{c.name} saw errors {c.errors[:3]}"
        n = self.txn_ledger.unread()
        return f"{n} records of committed transactions left to read" if n else ""

    def _txn_positions(self) -> dict:
        """Producer -> the offset its group holds for the first transactional stream's
        streamlet 0 (None: none committed)."""
        out = {}
        stream = self.profile.transactions["streams"][0]["name"]
        for tp in self.txn_producers:
            group = self.coordinator.core.groups.groups.get(f"{GROUP_PREFIX}{tp.client}")
            held = None if group is None else group.committed.get((stream, 0))
            out[tp.client] = None if held is None else held[0][1]
        return out

    # ================================================================== settling
    def _check_settled(self) -> None:
        for d in self.daemons:
            if not d.up and d.address not in self._supervising:
                self._supervising.add(d.address)
                self.sched.after(SUPERVISOR_RESTART_S, self._supervisor_restart, d)
        if not self._unsettled():
            self.settled_at = self.sched.now
            return
        self.sched.after(SETTLE_CHECK_S, self._check_settled)

    def _unsettled(self) -> str:
        """What the healed cluster still waits for ("" once settled)."""
        lost = self.lost_streamlets
        if not self.admin.done():
            return "streams not created"
        for p in [*self.producers, *self.keyed_producers]:
            if not p.idle(lost):
                return f"{p.name} has {sum(p.outstanding.values())} records unanswered"
        for c in self.consumers:
            if c.state is None:
                return f"{c.name} has not found its stream"
            if all((c.stream_id, sl) in lost for _, sl in c.state.cursors):
                continue    # an R=1 stream whose broker failed over: its data may be gone
            n = self.checker.unread(c.name, c.stream_id, lost)
            if n:
                return f"{c.name} has {n} acknowledged records left to read"
            if c.errors:
                return f"{c.name} saw errors {c.errors[:3]}"
        why = self._txn_unsettled()
        if why:
            return why
        for c in self.keyed_consumers:
            if c.state is None:
                return f"{c.name} has not found its stream"
            if all((c.stream_id, sl) in lost for _, sl in c.state.cursors):
                continue    # an R=1 stream whose broker failed over: its data may be gone
            if c.errors:
                return f"{c.name} saw errors {c.errors[:3]}"
        core = self.coordinator.core
        for stream in core.streams.values():
            recovering = core.descriptor(stream).get("recovering")
            if recovering:
                return f"stream {stream.spec.name} has streamlets recovering: {recovering}"
        # A backup restarted while the coordinator was down registers only once its register
        # request times out and is sent again (seed 1718): until then no broker can know its
        # in-memory replicas are gone.
        for b in self.backups:
            if b.up and not b.daemon.link.session.registered:
                return f"backup {b.address} has not registered since it started"
        registered = {m.id: m.registered_version
                      for m in self.coordinator.core.members["backup"].values() if m.alive}
        for b in self.brokers:
            if not b.up:
                continue
            core = b.core
            # A broker that has not yet heard of a backup's restart still counts its lost
            # replicas as held: it re-replicates them once it refreshes the backup list.
            for bid, version in registered.items():
                known = core.pool.backups.get(bid)
                if known is None or known.registered_version != version:
                    return f"broker {b.address} has not seen backup {bid}'s registration {version}"
            if core._pending_count:
                return f"broker {b.address} has {core._pending_count} produce requests pending"
            for vlog in core.vlog_list:
                for vs in vlog.vsegs:
                    if not all(r is not None and r.acked_idx == len(vs.idxs) for r in vs.replicas):
                        return (f"broker {b.address} vlog {vlog.id} vseg {vs.number} is not on all "
                                f"its replicas: {[None if r is None else (r.backup_id, r.acked_idx) for r in vs.replicas]} "
                                f"of {len(vs.idxs)} chunks")
        for c in self.keyed_consumers:
            # Owners read only when the consumer lags: a key gone by its tombstone is excused.
            keys = self.ledger.unread(c.name, None, lost) and \
                self.ledger.unread(c.name, self.ledger.owner_view(self.owners()), lost)
            if keys:
                return f"{c.name} has not read the latest record of {len(keys)} keys ({keys[0]}, ...)"
        return ""

    # ================================================================== final checks
    def _final_checks(self) -> None:
        c = self.checker
        c.check_read_all([(x.name, x.stream_id) for x in self.consumers], self.lost_streamlets)
        c.check_brokers_hold(self.owners())
        c.check_stored_once(self.brokers)
        self.check_redundancy()
        self.ledger.check_owners(self.owners(), self.lost_streamlets)
        if self.ledger.stream_ids:
            self.ledger.check_backed(self.owners(), self.backup_holdings())
        if self.txn_producers:
            self.txn_ledger.check(self._txn_positions())

    def owners(self) -> dict:
        """(stream id, streamlet) -> the live broker the coordinator places it on."""
        out = {}
        for stream in self.coordinator.core.streams.values():
            for sl, owner in enumerate(stream.placement):
                b = self.broker_by_id.get(owner)
                if b is not None and b.up and (stream.id, sl) not in self.lost_streamlets:
                    out[(stream.id, sl)] = b
        return out

    def backup_holdings(self) -> dict[tuple, dict[int, bool]]:
        """chunk id -> {backup id: intact?} over what every live backup's store holds now:
        replicas in memory, and what left memory as its disk holds it."""
        held: dict[tuple, dict[int, bool]] = {}
        for b in self.backups:
            if not b.up:
                continue
            disk = b.disk
            for key, r in b.store.replicas.items():
                on_disk = bytes(disk.files.get(key, b""))[:r.memory_from]
                flips = disk.flips.get(key, {})
                if flips:   # frame the file by its intended bytes; damaged chunks count as such
                    fixed = bytearray(on_disk)
                    for pos, original in flips.items():
                        if pos < len(fixed):
                            fixed[pos] = original
                    on_disk = bytes(fixed)
                at = 0
                while at < len(on_disk):
                    h = chunk.read_header(memoryview(on_disk)[at:])
                    intact = not disk.damaged(key, at, at + h.size)
                    held.setdefault(chunk_id(h), {})[b.backup_id] = intact
                    at += h.size
                for view in r.chunks:
                    held.setdefault(chunk_id(chunk.read_header(view)), {})[b.backup_id] = True
        return held

    def check_recoverable(self, broker: SimBroker) -> None:
        """At a broker's death: every acknowledged chunk with R >= 2 is in some live backup's
        store, unless every backup that acknowledged it lost it to a fault of its own since (a
        crash with the chunk only in memory, a damaged disk)."""
        held = self.backup_holdings()
        backups = {b.backup_id: b for b in self.backups}
        for cid, (_, _, replication) in self.checker.acked_chunks.items():
            if replication < 2 or any(held.get(cid, {}).values()) or cid[0] in self.checker.moving:
                continue
            acked_by = self.checker.held.get(cid, {})
            # Excused only beyond the guarantee: with this crash, R or more failures unhealed.
            if len(self._unhealed(real_only=True)) + 1 >= replication and all(not backups[bid].up or backups[bid].incarnation != binc or
                   held.get(cid, {}).get(bid) is False for bid, binc in acked_by.items()):
                self.counts["unrecoverable_after_second_fault"] = \
                    self.counts.get("unrecoverable_after_second_fault", 0) + 1
                continue
            raise DataLost(cid[0], replication, f"broker {broker.address} died while acknowledged chunk {cid} "
                                  f"(R={replication}) is on no live backup; backups "
                                  f"{sorted(acked_by)} acknowledged it and have not crashed since")

    def check_redundancy(self) -> None:
        """After healing: every acknowledged chunk is back on R-1 live backups (damaged disk
        copies excused, counted)."""
        held = self.backup_holdings()
        for cid, (_, _, replication) in sorted(self.checker.acked_chunks.items()):
            if replication < 2 or cid[0] in self.checker.moving:
                continue
            copies = held.get(cid, {})
            if len(copies) >= replication - 1:
                if not all(copies.values()):
                    self.counts["damaged_copies"] = self.counts.get("damaged_copies", 0) + 1
                continue
            raise DataLost(cid[0], replication, f"after healing, acknowledged chunk {cid} (R={replication}) is "
                                  f"on backups {sorted(copies)} only: redundancy was not restored")
