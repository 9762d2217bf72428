"""The coordinator, brokers and backups: their real server classes, on simulated I/O.

Each process is built by its server module's own constructor (kera.coordinator.server.
CoordinatorServer, kera.broker.server.BrokerDaemon, kera.backup.server.BackupServer plus
kera.backup.registration.Registration, as `run()` wires them), so the cores are driven by
exactly the code that drives them in production, and a handler or hook added there is in the
simulation too. While a run lasts, `sim_environment` points those modules at the simulation:
their zmq shell (`Server`, `_LoopServer`) at tests/sim/shell.SimServer, `time` at the simulated
clock, the backup's `disk` and `Worker` threads at tests/sim/disk.py, the coordinator's
metadata `store` at a dict.

Checks hook in at the wire: a broker's produce and fetch replies, a backup's replicate replies,
and the writes a backup's store accepted (tests/sim/checker.py).

Each `Sim*` class here is a restartable slot: `start()` runs a new process (a new incarnation
at the same address, with the same --id, as kera.local restarts daemons), `crash()` is kill -9.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import random
import sys
import time

from kera import chunk, config
from kera.backup import server as backup_server
from kera.backup.registration import Registration
from kera.backup.server import BackupServer
from kera.backup.store import StoreConfig
from kera.broker import server as broker_server
from kera.broker.core import BrokerConfig
from kera.broker.server import BrokerDaemon
from kera.coordinator import core as coordinator_core, server as coordinator_server
from kera.coordinator import store as coordinator_store
from kera.coordinator.server import CoordinatorServer
from kera.errors import CorruptChunk

from tests.sim.checker import Checker
from tests.sim.disk import DiskFunctions, SimDisk, SimWorker
from tests.sim.network import Network
from tests.sim.scheduler import Scheduler
from tests.sim.shell import SimHost, SimServer

# The broker's loop wakes at least every 50 ms (kera.server run_once) and checks its heartbeat
# clock on a timer (TIMER_S, 50 ms since bench/idle_cpu.py; once 10 ms); one 50 ms timer does
# both here, with far fewer events.
BROKER_TIMER_S = 0.05


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


class _NoDirs:
    """`os` for the coordinator server: the data dir is the MemoryStore's, never created."""

    @staticmethod
    def makedirs(*args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(os, name)


class _BrokerShell(SimServer):
    """The broker's shell (its `_LoopServer`): produce and fetch replies pass the checker on
    the way out."""

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


@contextlib.contextmanager
def sim_environment(sched: Scheduler, store: MemoryStore, clock: SimClock | None = None):
    """Point the server modules at the simulation while the block runs: every kera module's
    `time` (at `clock`, so the run can step its wall clock), the zmq shells, the backup's disk
    and threads, the coordinator's metadata file."""
    clock = clock or SimClock(sched)
    patches = [(m, "time", clock) for name, m in sorted(sys.modules.items())
               if name.startswith("kera.") and getattr(m, "time", None) is time]
    patches += [
        (broker_server, "_LoopServer", _BrokerShell), (broker_server, "TIMER_S", BROKER_TIMER_S),
        (coordinator_server, "Server", SimServer), (coordinator_server, "store", store),
        (coordinator_server, "os", _NoDirs()), (coordinator_core, "new_token", _tokens(sched)),
        (backup_server, "Worker", SimWorker), (backup_server, "disk", DiskFunctions()),
    ]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    try:
        for m, name, value in patches:
            setattr(m, name, value)
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


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
    def __init__(self, net: Network, name: str, port: int, rng: random.Random, *,
                 heartbeat_interval_s: float, heartbeat_missed_max: int):
        self.host = SimHost(net, rng, name)
        self.port = port
        self.address = f"{name}:{port}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_missed_max = heartbeat_missed_max
        self.daemon: CoordinatorServer | None = None

    def start(self) -> None:
        self.daemon = CoordinatorServer(f"sim/{self.address}", self.host, self.port,
                                        heartbeat_interval_s=self.heartbeat_interval_s,
                                        heartbeat_missed_max=self.heartbeat_missed_max)
        self.server = self.daemon.server

    @property
    def core(self):
        return self.daemon.core


# ====================================================================== broker

class SimBroker(_Slot):
    def __init__(self, net: Network, name: str, port: int, rng: random.Random, checker: Checker, *,
                 coordinator: str, node: str, broker_id: int, cfg: BrokerConfig):
        self.host = SimHost(net, rng, name)
        self.port = port
        self.address = f"{name}:{port}"
        self.checker = checker
        self.coordinator_address = coordinator
        self.node = node
        self.broker_id = broker_id
        self.cfg = cfg
        self.daemon: BrokerDaemon | None = None

    def start(self) -> None:
        self.daemon = d = BrokerDaemon(self.coordinator_address, host=self.host, port=self.port,
                                       node=self.node, broker_id=self.broker_id, cfg=self.cfg)
        self.server = s = d.server
        s.checker = self.checker
        s.daemon = d
        produce = s.handlers["produce"]

        def on_produce(req, produce=produce):
            # What was asked, for the ack check (the real handler lets go of the frames).
            req.ctx = [_header_or_none(f.buffer) for f in req.frames]
            return produce(req)

        s.handlers["produce"] = on_produce

    @property
    def core(self):
        return self.daemon.core


def _header_or_none(buf):
    try:
        return chunk.read_header(buf)
    except CorruptChunk:
        return None


# ====================================================================== backup

class _BackupServer(BackupServer, SimServer):
    """BackupServer on the simulated shell (the MRO puts SimServer where Server was)."""

    checker: Checker | None = None
    backup_id = -1

    def handle_replicate(self, req):
        result = BackupServer.handle_replicate(self, req)
        f = req.fields
        key = (f.int("broker_id"), f.int("vlog"), f.int("vseg"))
        if f.bool("reset", False):
            self.checker.backup_reset(self.backup_id, self.incarnation, key)
        req.ctx = (key, f.str("durability", config.DEFAULT_DURABILITY))
        self.checker.backup_accepted(self.backup_id, self.incarnation, key, f.int("offset"),
                                     [frame.buffer for frame in req.frames])
        return result

    def reply(self, req, fields=None, frames=()) -> None:
        if req.op == "replicate":
            key, durability = req.ctx
            self.checker.backup_replied(self.backup_id, self.incarnation, key, fields["length"],
                                        durability, self.store, self.root)
        super().reply(req, fields, frames)


class SimBackup(_Slot):
    def __init__(self, net: Network, name: str, port: int, rng: random.Random, checker: Checker, *,
                 coordinator: str, node: str, backup_id: int, disk: SimDisk,
                 store_config: StoreConfig):
        self.host = SimHost(net, rng, name)
        self.port = port
        self.address = f"{name}:{port}"
        self.checker = checker
        self.coordinator_address = coordinator
        self.node = node
        self.backup_id = backup_id
        self.disk = disk
        self.store_config = store_config

    def start(self) -> None:
        """kera.backup.server.run: the server on its data dir, then its Registration."""
        s = _BackupServer(self.disk, self.store_config, self.host, self.port)
        s.checker = self.checker
        s.backup_id = self.backup_id
        s.flusher.bind(s, self.disk.flush_delay)
        s.reader.bind(s, self.disk.read_delay)
        # As kera.backup.server.run wires it (the optional hooks as far as this version has them).
        hooks = {"fields": "heartbeat_fields", "on_heartbeat": "heartbeat_reply"}
        params = inspect.signature(Registration).parameters
        extra = {k: getattr(s, attr) for k, attr in hooks.items() if k in params and hasattr(s, attr)}
        s.registration = Registration(s, self.coordinator_address, "backup", s.address, self.node,
                                      self.backup_id, stats=s.heartbeat_stats, **extra)
        self.server = s

    @property
    def store(self):
        return self.server.store
