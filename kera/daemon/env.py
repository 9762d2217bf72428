"""What a daemon process takes from the outside world, named in one place: `DaemonEnv`.

The coordinator, broker and backup are built from their sans-IO cores and one shell
(kera.net.server.Server) that they hold. Everything they would otherwise reach for on their own —
the clock, the transport, the disk, worker threads, random tokens — comes in through a
DaemonEnv, so a test or the simulation (tests/sim) hands a daemon its own world through the
constructor instead of patching module globals. `DaemonEnv.real()` is production's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Protocol


class Clock(Protocol):
    """The part of the `time` module a daemon reads: `monotonic()` for every deadline and age,
    `time()` for wall-clock stamps (retention), `perf_counter()`/`thread_time()` for the
    durations it reports in its stats, `sleep()` for its shutdown drain only."""

    def monotonic(self) -> float: ...
    def time(self) -> float: ...
    def perf_counter(self) -> float: ...
    def thread_time(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class DaemonEnv:
    """The outside world of one daemon process.

    clock: see Clock.
    server: `server(name, host, port, security)` -> the shell (kera.net.server.Server or one like
        it) the daemon holds; it binds, sends and receives (CURVE when `security` is given).
    backup_disk: the backup's replica files, as the functions of kera.backup.disk
        (`scan(root)`, `run(root, job)`, `read_chunks(root, read)`).
    metadata_store: the coordinator's persistence, as kera.coordinator.store
        (`MetadataStore(data_dir)`); a coordinator given a store of its own (on etcd:
        kera.coordinator.etcd_store) uses that instead.
    makedirs: `makedirs(path)`: creates a data directory (and its parents) if missing.
    worker: `worker(name, run_job, max_jobs)` -> a kera.backup.worker.Worker (a thread).
    new_token: a fresh random token (incarnation tokens, the cluster id).
    """

    clock: Clock
    server: Callable
    backup_disk: object
    metadata_store: object
    makedirs: Callable[[str], None]
    worker: Callable
    new_token: Callable[[], str]

    @classmethod
    def real(cls) -> "DaemonEnv":
        """The production environment: the `time` module, zmq, files and threads."""
        # Imported here: the daemon modules import this one, and each of these imports zmq,
        # numpy or the disk code, which a caller building a test environment does not need.
        from kera.net import server
        from kera.backup import disk
        from kera.backup.worker import Worker
        from kera.coordinator import store
        from kera.coordinator.core import new_token
        return cls(clock=time, server=server.Server, backup_disk=disk, metadata_store=store,
                   makedirs=_makedirs, worker=Worker, new_token=new_token)


def _makedirs(path: str) -> None:
    os.makedirs(path, exist_ok=True)


def real_if_none(env: DaemonEnv | None) -> DaemonEnv:
    """`env`, or the production environment when none was given."""
    return DaemonEnv.real() if env is None else env

