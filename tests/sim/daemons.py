"""The coordinator, brokers and backups: their real server classes, on simulated I/O.

Each process is built by its server module's own constructor (kera.coordinator.server.
CoordinatorServer, kera.broker.server.BrokerDaemon, kera.backup.server.BackupDaemon plus
BackupDaemon.connect_coordinator, as `run()` wires them), so the cores are driven by
exactly the code that drives them in production, and a handler or hook added there is in the
simulation too. What differs is only what comes in through the front door, the daemon's
kera.daemon.env.DaemonEnv (`sim_env`): the shell is tests/sim/shell.SimServer, the clock the
simulated one, the backup's disk and worker threads tests/sim/disk.py (a broker's compaction
thread too: `SimBroker._worker`), the coordinator's
metadata store a dict, tokens numbered per run. No module global is patched.

Checks hook in at the wire: a broker's produce and fetch replies, a backup's replicate replies,
and the writes a backup's store accepted (tests/sim/checker.py).

Each `Sim*` class here is a restartable slot: `start()` runs a new process (a new incarnation
at the same address, with the same --id, as kera.cli.local restarts daemons), `crash()` is kill -9.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

from kera import config

from kera.codec import chunk
from kera.backup.server import BackupDaemon
from kera.backup.store import StoreConfig
from kera.broker.core import BrokerConfig
from kera.broker.server import BrokerDaemon
from kera.coordinator import store as coordinator_store
from kera.coordinator.server import CoordinatorServer
from kera.daemon.env import DaemonEnv
from kera.errors import CorruptChunk
from kera.daemon.identity import Identity

from tests.sim.checker import Checker
from tests.sim.disk import DiskFunctions, SimDisk, SimWorker
from tests.sim.network import Network
from tests.sim.scheduler import Scheduler
from tests.sim.shell import SimHost, SimServer

# Simulated seconds a broker worker's job (a compaction pass) takes, unless the run says.
WORK_S = (0.001, 0.01)


class MemoryStore:
    """kera.coordinator.store on a dict: what `save` wrote, `load` reads back (as JSON)."""

    def __init__(self):
        self.files: dict[str, str] = {}

    def MetadataStore(self, data_dir) -> "_MemoryMetadata":   # noqa: N802 (the module's class)
        return _MemoryMetadata(self, str(data_dir))

    def save(self, data_dir, state: dict) -> None:
        self.files[str(data_dir)] = json.dumps(state, separators=(",", ":"), sort_keys=True)

    def load(self, data_dir) -> dict | None:
        raw = self.files.get(str(data_dir))
        return None if raw is None else json.loads(raw)


class _MemoryMetadata:
    """kera.coordinator.store.MetadataStore on a MemoryStore: a commit's changes are applied
    (by the real replay code) to the saved state at once, as a load would replay them."""

    def __init__(self, files: MemoryStore, key: str):
        self.files, self.key = files, key
        self._base: dict | None = None
        self.log_bytes = 0    # nothing is appended: every commit rewrites the saved state

    def load(self) -> dict | None:
        return self.files.load(self.key)

    def snapshot(self, state: dict) -> None:
        self.files.save(self.key, state)
        self._base = coordinator_store.split(state)

    def commit(self, base: dict | None, replica_changes: list) -> int:
        changes = list(replica_changes)
        if base is not None:
            new = coordinator_store.split(base)
            changes = coordinator_store.diff(self._base, new) + changes
            self._base = new
        if not changes:
            return 0
        replay = coordinator_store.Replay(self.files.load(self.key))
        for change in json.loads(json.dumps(changes)):
            replay.apply(change)
        self.files.save(self.key, replay.state())
        return len(changes)

    def wants_snapshot(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _tokens(sched: Scheduler):
    """Incarnation tokens and cluster ids numbered per run, so a seed replays its run."""
    def token() -> str:
        sched.tokens_issued = getattr(sched, "tokens_issued", 0) + 1
        return f"{sched.tokens_issued:032x}"
    return token


def _no_dirs(path) -> None:
    """The coordinator's data dir is the MemoryStore's key: nothing to create."""


class _BrokerShell(SimServer):
    """The broker's shell (its DaemonEnv's `server`): produce and fetch replies pass the
    checker on the way out."""

    checker: Checker | None = None
    daemon = None

    def reply(self, req, fields=None, frames=()) -> None:
        if req.op == "produce" and req.ctx is not None:
            self.checker.produce_answered(self, req.ctx, fields["results"])
        elif req.op == "fetch":
            self.checker.fetch_served(self, frames)
        super().reply(req, fields, frames)

    @property
    def core(self):
        return self.daemon.core


class SimClock:
    """The `time` module as the daemons' code sees it in a run: the simulated clock (and a wall
    clock that starts at a fixed date), so nothing depends on when the run happens."""

    EPOCH_S = 1.7e9

    def __init__(self, sched: Scheduler):
        self._sched = sched
        # Seconds the wall clock was stepped (an operator's or NTP's jump): the wall clock moves,
        # the monotonic clock does not.
        self.wall_step_s = 0.0

    def monotonic(self) -> float:
        return self._sched.now

    # Timers of work done (stats only): the simulated clock too, so that nothing a daemon
    # computes depends on the machine running the simulation.
    perf_counter = thread_time = process_time = monotonic

    def time(self) -> float:
        return self.EPOCH_S + self._sched.now + self.wall_step_s

    def time_ns(self) -> int:
        return int(self.time() * 1e9)

    def sleep(self, seconds: float) -> None:
        raise AssertionError("a daemon slept inside the simulation")

    def __getattr__(self, name: str):
        return getattr(time, name)   # formatting and constants: the real module's


def sim_env(sched: Scheduler, store: MemoryStore, clock: SimClock | None = None) -> DaemonEnv:
    """The DaemonEnv of every daemon of a run: the simulated shell and clock (`clock`, so the run
    can step its wall clock), the backup's disk and threads (the disk is the SimDisk passed as
    its data dir), the coordinator's metadata in `store`, tokens numbered per run."""
    return DaemonEnv(clock=clock or SimClock(sched), server=SimServer, backup_disk=DiskFunctions(),
                     metadata_store=store, makedirs=_no_dirs, worker=SimWorker,
                     new_token=_tokens(sched))


class _Slot:
    """A restartable process at a fixed address."""
    server: SimServer | None = None

    @property
    def up(self) -> bool:
        return self.server is not None and self.server.up

    @property
    def incarnation(self) -> int:
        return self.server.incarnation if self.server is not None else 0

    def crash(self) -> None:
        if self.server is not None:
            self.server.crash()


# ====================================================================== coordinator

class SimCoordinator(_Slot):
    def __init__(self, net: Network, name: str, port: int, rng: random.Random, env: DaemonEnv, *,
                 heartbeat_interval_s: float, heartbeat_missed_max: int):
        self.host = SimHost(net, rng, name)
        self.port = port
        self.address = f"{name}:{port}"
        self.env = env
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_missed_max = heartbeat_missed_max
        self.daemon: CoordinatorServer | None = None
        # Called with (kind, id) for every daemon the coordinator declares dead, as it does.
        self.on_death = lambda kind, member_id: None

    def start(self) -> None:
        self.daemon = CoordinatorServer(f"sim/{self.address}", self.host, self.port,
                                        heartbeat_interval_s=self.heartbeat_interval_s,
                                        heartbeat_missed_max=self.heartbeat_missed_max,
                                        env=self.env)
        self.server = self.daemon.server
        core, declare = self.daemon.core, self.daemon.core.tick

        def tick(now: float):
            dead = declare(now)
            for member in dead:
                self.on_death(member.kind, member.id)
            return dead

        core.tick = tick   # this instance's: a death is noted even if the coordinator then crashes

    @property
    def core(self):
        return self.daemon.core


# ====================================================================== broker

class SimBroker(_Slot):
    def __init__(self, net: Network, name: str, port: int, rng: random.Random, checker: Checker,
                 env: DaemonEnv, *, coordinator: str, node: str, broker_id: int, cfg: BrokerConfig,
                 work_rng: random.Random | None = None, work_s: tuple = WORK_S):
        self.host = SimHost(net, rng, name)
        self.port = port
        self.address = f"{name}:{port}"
        self.checker = checker
        # Its worker threads (the compaction thread: kera.broker.compaction_service) come
        # through its DaemonEnv, run on its process's events, each job taking `work_s`.
        self.work_rng = work_rng or random.Random(name)
        self.work_s = work_s
        self.env = dataclasses.replace(env, server=_BrokerShell, worker=self._worker)
        self.coordinator_address = coordinator
        self.node = node
        self.broker_id = broker_id
        self.cfg = cfg
        self.daemon: BrokerDaemon | None = None

    def start(self) -> None:
        self.daemon = d = BrokerDaemon(self.coordinator_address, host=self.host, port=self.port,
                                       node=self.node, broker_id=self.broker_id, cfg=self.cfg,
                                       env=self.env)
        self.server = s = d.server
        s.checker = self.checker
        s.daemon = d
        produce = s.handlers["produce"]

        def on_produce(req, produce=produce):
            # What was asked, for the ack check (the real handler lets go of the frames).
            req.ctx = [_header_or_none(f.buffer) for f in req.frames]
            return produce(req)

        s.handlers["produce"] = on_produce

    def _worker(self, name: str, run_job, max_jobs: int) -> SimWorker:
        """DaemonEnv.worker: a thread of the running incarnation; what it finishes is collected
        by the daemon's after_turn pump, which runs after the worker's event."""
        worker = SimWorker(name, run_job, max_jobs)
        worker.bind(self.server, _nothing, lambda: self.work_rng.uniform(*self.work_s))
        return worker

    @property
    def core(self):
        return self.daemon.core


def _nothing() -> None:
    """A worker's wake-up on the broker: its after_turn pump collects the outcome."""


def _header_or_none(buf):
    try:
        return chunk.read_header(buf)
    except CorruptChunk:
        return None


# ====================================================================== backup

class _BackupShell(SimServer):
    """The backup's shell (its DaemonEnv's `server`): replicate replies pass the checker on
    the way out."""

    checker: Checker | None = None
    backup_id = -1
    daemon: BackupDaemon | None = None

    def reply(self, req, fields=None, frames=()) -> None:
        if req.op == "replicate":
            key, durability = req.ctx
            d = self.daemon
            self.checker.backup_replied(self.backup_id, self.incarnation, key, fields["length"],
                                        durability, d.store, d.root)
        super().reply(req, fields, frames)

    def watch_replicate(self) -> None:
        """Wrap the daemon's `replicate` handler: what it accepted goes to the checker."""
        replicate = self.handlers["replicate"]

        def on_replicate(req):
            result = replicate(req)
            f = req.fields
            key = (f.int("broker_id"), f.int("vlog"), f.int("vseg"))
            if f.bool("reset", False):
                self.checker.backup_reset(self.backup_id, self.incarnation, key)
            req.ctx = (key, f.str("durability", config.DEFAULT_DURABILITY))
            self.checker.backup_accepted(self.backup_id, self.incarnation, key, f.int("offset"),
                                         [frame.buffer for frame in req.frames])
            return result

        self.handlers["replicate"] = on_replicate


class SimBackup(_Slot):
    def __init__(self, net: Network, name: str, port: int, rng: random.Random, checker: Checker,
                 env: DaemonEnv, *, coordinator: str, node: str, backup_id: int, disk: SimDisk,
                 store_config: StoreConfig):
        self.host = SimHost(net, rng, name)
        self.port = port
        self.address = f"{name}:{port}"
        self.checker = checker
        self.env = dataclasses.replace(env, server=_BackupShell)
        self.coordinator_address = coordinator
        self.node = node
        self.backup_id = backup_id
        self.disk = disk
        self.store_config = store_config
        self.daemon: BackupDaemon | None = None

    def start(self) -> None:
        """kera.backup.server.run: the daemon on its data dir, then its coordinator link."""
        self.daemon = d = BackupDaemon(self.disk, self.store_config, self.host, self.port,
                                       env=self.env)
        self.server = s = d.server
        s.checker = self.checker
        s.backup_id = self.backup_id
        s.daemon = d
        s.watch_replicate()
        d.flusher.bind(s, d.collect, self.disk.flush_delay)
        d.reader.bind(s, d.collect, self.disk.read_delay)
        d.connect_coordinator(self.coordinator_address, s.address, self.node, self.backup_id,
                              Identity())   # as kera.backup.server.run does

    @property
    def store(self):
        return self.daemon.store
