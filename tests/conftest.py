"""Shared fixtures: real local clusters (coordinator, brokers, backups as subprocesses).

    def test_something(local_cluster):           # module-scoped factory
        cluster = local_cluster(brokers=2, backups=1)
        admin = cluster.admin()

    def test_faults(fresh_cluster):              # function-scoped factory: stopped after the test
        cluster = fresh_cluster(brokers=2, backups=2, heartbeat_interval_ms=50)
        cluster.kill_broker(0)

Both factories take LocalCluster's keyword arguments (virtual_logs, log_level,
extra_broker_args, ...). A module marked `pytestmark = pytest.mark.security_modes` runs each
of its tests twice: against plaintext clusters and against CURVE ones (`secure=True`), the
latter with $KERA_KEY_FILE set to the cluster's admin key so every client in the test
authenticates (the same suite, parametrised, not copied). Each cluster gets its own temporary data dir; daemon logs are in
`cluster.log_dir`, and their tails are printed when a test using a function-scoped cluster fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # make `bench` importable under any rootdir
    sys.path.insert(0, str(REPO_ROOT))


SECURITY_MODES = ("plaintext", "curve")


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("security_modes") is None:
        return
    if {"local_cluster", "fresh_cluster"} & set(metafunc.fixturenames):
        metafunc.parametrize("security_mode", SECURITY_MODES, indirect=True, scope="module")


@pytest.fixture(scope="module")
def security_mode(request):
    """'plaintext' (the default) or 'curve' (modules marked security_modes)."""
    return getattr(request, "param", "plaintext")


def _factory(tmp_path_factory, clusters: list, security_mode: str = "plaintext"):
    from kera.net.keys import KEY_FILE_ENV
    from kera.cli.local import LocalCluster

    def make(brokers: int = 1, backups: int = 0, **kw) -> LocalCluster:
        data_dir = tmp_path_factory.mktemp("kera-cluster")
        kw.setdefault("secure", security_mode == "curve")
        cluster = LocalCluster(data_dir, brokers=brokers, backups=backups, **kw)
        clusters.append(cluster)
        if cluster.key_file is not None:
            os.environ[KEY_FILE_ENV] = cluster.key_file   # the test's clients: admin
        return cluster

    return make


def _stop_all(clusters: list) -> None:
    from kera.net.keys import KEY_FILE_ENV
    for cluster in clusters:
        cluster.stop()
        if cluster.key_file is not None and os.environ.get(KEY_FILE_ENV) == cluster.key_file:
            del os.environ[KEY_FILE_ENV]


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory, security_mode):
    """Factory `make(brokers=1, backups=0, **kw) -> LocalCluster`; clusters stop at module end."""
    clusters: list = []
    yield _factory(tmp_path_factory, clusters, security_mode)
    _stop_all(clusters)


@pytest.fixture
def fresh_cluster(tmp_path_factory, request, security_mode):
    """Like `local_cluster`, but the clusters stop when the test ends."""
    clusters: list = []
    yield _factory(tmp_path_factory, clusters, security_mode)
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for cluster in clusters:
            sys.stderr.write(f"\n==== daemon logs of the cluster at {cluster.bootstrap}\n"
                             f"{cluster._tails()}\n")
    _stop_all(clusters)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Keep each phase's report on the item so fixtures can tell whether the test failed.
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


class FakeDaemon:
    """A stand-in broker or backup: registers with a coordinator over the wire and heartbeats
    from a thread, reporting as applied the metadata version the coordinator last announced
    (an ideal daemon). `applied_version=N` pins what it reports instead."""

    def __init__(self, bootstrap: str, kind: str = "broker", address: str = "127.0.0.1:1",
                 node: str = "fake-node", daemon_id: int | None = None,
                 interval_s: float = 0.05, applied_version: int | None = None):
        import threading
        from kera.net import rpc

        self.kind, self.address, self.node = kind, address, node
        self.interval_s = interval_s
        self.applied_version = applied_version
        self.heartbeats = 0
        self.errors: list = []
        self._conn = rpc.Connection(bootstrap, timeout_s=5.0)
        fields = {"kind": kind, "address": address, "node": node}
        if daemon_id is not None:
            fields["daemon_id"] = daemon_id
        self._fields = fields
        reply = self._conn.call("register", fields)[0]
        self.id, self.token = reply["daemon_id"], reply["token"]
        self._known_version = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kera.errors import KeraError
        while not self._stop.wait(self.interval_s):
            applied = self._known_version if self.applied_version is None else self.applied_version
            try:
                header, _ = self._conn.call("heartbeat", {"kind": self.kind, "daemon_id": self.id,
                                                          "token": self.token,
                                                          "metadata_version": applied})
                self._known_version = header["metadata_version"]
                self.heartbeats += 1
            except KeraError as err:
                self.errors.append(err)
                if err.code == "not_ready":   # as a real daemon: register again, same identity
                    self._register_again()

    def _register_again(self) -> None:
        from kera.errors import KeraError
        fields = {**self._fields, "daemon_id": self.id, "token": self.token}
        try:
            self.token = self._conn.call("register", fields)[0]["token"]
        except KeraError as err:
            self.errors.append(err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._conn.close()


@pytest.fixture
def fake_daemons():
    """Factory `make(bootstrap, kind="broker", **kw) -> FakeDaemon`; all stop after the test."""
    made: list[FakeDaemon] = []

    def make(bootstrap: str, kind: str = "broker", **kw) -> FakeDaemon:
        daemon = FakeDaemon(bootstrap, kind, **kw)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.stop()


@pytest.fixture
def etcd_cluster(tmp_path_factory):
    """Factory `make(members=1) -> tests.etcd_cluster.EtcdCluster`, started and healthy; every
    member is killed and its data removed after the test. Installs Debian's etcd-server when no
    `etcd` is on the PATH; skips (saying why) only when that fails."""
    from tests.etcd_cluster import EtcdCluster, etcd_binary

    binary, why = etcd_binary()
    if binary is None:
        pytest.skip(f"no etcd to test against: {why}")
    made: list = []

    def make(members: int = 1):
        cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), members=members, binary=binary)
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.stop()


@pytest.fixture(scope="module")
def postgres():
    """A started tests.postgres_cluster.PostgresServer (private port and data dir), stopped and
    removed at module end. Installs Debian's postgresql when no initdb is found; skips (saying
    why) only when that fails."""
    from tests.postgres_cluster import PostgresServer, postgres_bin_dir

    bin_dir, why = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip(f"no PostgreSQL to test against: {why}")
    server = PostgresServer(bin_dir).start()
    yield server
    server.stop()
