"""kera.daemon.env: a daemon takes its clock, shell, disk, threads and tokens from its DaemonEnv."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from kera.net import server as kera_server
from kera.backup import disk as backup_disk
from kera.backup.server import BackupDaemon
from kera.backup.worker import Worker
from kera.coordinator import store as coordinator_store
from kera.coordinator.server import CoordinatorServer
from kera.daemon.env import DaemonEnv, real_if_none

from tests.sim.daemons import MemoryStore


class FixedClock:
    """A clock that stands still: what a daemon built on it reads is exactly this."""

    MONOTONIC_S = 1234.5
    WALL_S = 1.7e9

    def monotonic(self) -> float:
        return self.MONOTONIC_S

    def time(self) -> float:
        return self.WALL_S

    perf_counter = thread_time = monotonic

    def sleep(self, seconds: float) -> None:
        raise AssertionError("nothing here should sleep")


def test_real_env_is_production():
    env = DaemonEnv.real()
    assert env.clock is time
    assert env.server is kera_server.Server
    assert env.backup_disk is backup_disk and env.metadata_store is coordinator_store
    assert env.worker is Worker
    tokens = {env.new_token() for _ in range(3)}
    assert len(tokens) == 3 and all(re.fullmatch("[0-9a-f]{32}", t) for t in tokens)
    assert real_if_none(None) == env
    assert real_if_none(dataclasses.replace(env, clock=FixedClock())).clock.__class__ is FixedClock


def test_env_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DaemonEnv.real().clock = FixedClock()


def test_coordinator_takes_clock_store_dirs_and_tokens_from_env():
    made: list[str] = []
    store = MemoryStore()
    env = dataclasses.replace(DaemonEnv.real(), clock=FixedClock(), metadata_store=store,
                              makedirs=made.append, new_token=lambda: "ab" * 16)
    coord = CoordinatorServer("/nonexistent/coordinator", "127.0.0.1", 0, env=env)
    try:
        assert made == ["/nonexistent/coordinator"]          # no directory really made
        assert coord.core.started_s == FixedClock.MONOTONIC_S
        assert coord.core.cluster_id == "ab" * 16
        # The first state was persisted through the env's store, under the data dir.
        assert store.load("/nonexistent/coordinator")["cluster_id"] == "ab" * 16
    finally:
        coord.server.close()


def test_backup_takes_shell_and_worker_threads_from_env(tmp_path):
    started: list[str] = []
    shells: list[kera_server.Server] = []

    def worker(name, run_job, max_jobs):
        started.append(name)
        return Worker(name, run_job, max_jobs)

    def server(name, host, port, security=None):
        shells.append(kera_server.Server(name, host, port, security))
        return shells[-1]

    env = dataclasses.replace(DaemonEnv.real(), worker=worker, server=server)
    daemon = BackupDaemon(tmp_path, env=env)
    try:
        assert started == ["backup-flusher", "backup-reader"]
        assert shells == [daemon.server]
        assert daemon.collect in daemon.server.after_turn
    finally:
        daemon.flusher.close()
        daemon.reader.close()
        daemon.server.close()


def test_after_turn_hooks_run_every_turn_and_a_bug_in_one_stops_the_daemon():
    shell = kera_server.Server("test")
    turns: list[int] = []
    try:
        shell.after_turn.append(lambda: turns.append(1))
        shell.run_once(0)
        shell.run_once(0)
        assert len(turns) == 2

        def broken() -> None:
            raise AssertionError("state broken")

        shell.after_turn.append(broken)
        shell.run_once(0)
        assert isinstance(shell.failure, AssertionError) and shell.stopping
        shell.run_once(0)
        assert len(turns) == 3     # nothing runs on state the bug may have broken
    finally:
        shell.close()


class BuggyDisk:
    """kera.backup.disk with a bug in its flush: it raises something no disk raises."""

    scan = staticmethod(backup_disk.scan)
    read_chunks = staticmethod(backup_disk.read_chunks)

    @staticmethod
    def run(root, job) -> None:
        raise AssertionError("flush bookkeeping broken")


def test_a_bug_in_a_worker_thread_stops_the_backup_with_its_stack(tmp_path, caplog):
    """One error policy: an OSError from the disk is reported and retried, but any other
    exception a worker thread's job raises stops the daemon, as one in a handler does."""
    daemon = BackupDaemon(tmp_path, env=dataclasses.replace(DaemonEnv.real(), backup_disk=BuggyDisk()))
    try:
        daemon.flusher.submit("job")
        deadline = time.monotonic() + 5.0
        while daemon.server.failure is None and time.monotonic() < deadline:
            daemon.server.run_once(0.05)
        assert isinstance(daemon.server.failure, AssertionError) and daemon.server.stopping
        # Logged with the stack of the job on the worker thread, down to the line that raised.
        assert 'raise AssertionError("flush bookkeeping broken")' in caplog.text
    finally:
        daemon.flusher.close()
        daemon.reader.close()
        daemon.server.close()
