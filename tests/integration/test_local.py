"""LocalCluster and `kera local`: real daemons as subprocesses, started, faulted, stopped."""

import importlib
import os
import signal
import subprocess
import sys
import time

import pytest

from kera.net import rpc
from kera.client.admin import Admin
from kera.errors import Timeout
from kera.cli.local import ClusterError, LocalCluster


def wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def answers(address: str) -> bool:
    try:
        rpc.call(address, "cluster", timeout_s=0.3)
        return True
    except Timeout:
        return False


def has_daemon(module: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), "run")
    except ImportError:
        return False


def test_backups_register_die_and_come_back(tmp_path):
    with LocalCluster(tmp_path, brokers=0, backups=2, heartbeat_interval_ms=50,
                      log_level="WARNING") as cluster, Admin(cluster.bootstrap) as admin:
        backups = admin.cluster()["backups"]
        assert [(b["id"], b["node"], b["alive"]) for b in backups] == [
            (0, "local-backup-0", True), (1, "local-backup-1", True)]
        assert [b["address"] for b in backups] == [d.address for d in cluster.backups]

        cluster.kill_backup(1)
        assert not cluster.backups[1].running()
        wait_for(lambda: not admin.cluster()["backups"][1]["alive"], 5, "backup 1 declared dead")
        cluster.restart_backup(1)
        backups = admin.cluster()["backups"]
        assert len(backups) == 2 and all(b["alive"] for b in backups)  # same identity, not a third

        cluster.kill_coordinator()
        cluster.restart_coordinator()
        assert [b["alive"] for b in admin.cluster()["backups"]] == [True, True]
        daemons = list(cluster.daemons)
    assert not any(d.running() for d in daemons)
    assert not answers(cluster.bootstrap)
    assert (tmp_path / "logs" / "backup-1.log").read_text().count("==== start") == 2


def test_a_daemon_that_cannot_start_is_reported_with_its_log(tmp_path):
    with pytest.raises(ClusterError, match="coordinator exited with code 2") as info:
        LocalCluster(tmp_path, brokers=0, extra_coordinator_args=["--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in str(info.value)


def test_kera_local_command(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kera", "local", "--dir", str(tmp_path),
                             "--port", "0", "--brokers", "0", "--backups", "1",
                             "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        bootstrap = proc.stdout.readline().strip()
        summary = proc.stdout.readline()
        assert bootstrap.startswith("127.0.0.1:") and "1 backups" in summary
        with Admin(bootstrap) as admin:
            assert [b["alive"] for b in admin.cluster()["backups"]] == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not answers(bootstrap)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_daemons_stop_when_their_parent_is_killed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kera", "local", "--dir", str(tmp_path),
                             "--port", "0", "--brokers", "0", "--backups", "1",
                             "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    bootstrap = proc.stdout.readline().strip()
    with Admin(bootstrap) as admin:
        backup_address = admin.cluster()["backups"][0]["address"]
    proc.kill()
    proc.wait(10)
    wait_for(lambda: not answers(bootstrap), 15, "the orphaned coordinator to stop")

    def backup_gone():
        try:
            rpc.call(backup_address, "stats", timeout_s=0.3)
            return False
        except Timeout:
            return True
    wait_for(backup_gone, 15, "the orphaned backup to stop")


@pytest.mark.skipif(not has_daemon("kera.broker.server"), reason="broker daemon not built yet")
def test_two_brokers_serve_a_new_stream(tmp_path):
    with LocalCluster(tmp_path, brokers=2, backups=1, log_level="WARNING") as cluster, \
            Admin(cluster.bootstrap) as admin:
        brokers = admin.cluster()["brokers"]
        assert [(b["id"], b["alive"]) for b in brokers] == [(0, True), (1, True)]
        stream = admin.create_stream("s", streamlets=4, replication=2)
        assert stream["ready"] is True
        assert sorted(stream["placement"]) == [0, 0, 1, 1]
        assert stream["brokers"] == {"0": cluster.brokers[0].address,
                                     "1": cluster.brokers[1].address}
        stats = admin.stats()
        assert sorted(stats["brokers"]) == [0, 1] and "error" not in stats["brokers"][0]
        cluster.kill_broker(0)
        cluster.restart_broker(0)
        wait_for(lambda: admin.describe_stream("s")["ready"], 10, "stream ready after restart")


@pytest.mark.parametrize("taken", ["coordinator", "kafka"])
def test_a_port_in_use_is_refused_before_anything_starts(tmp_path, taken):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        kwargs = {"port": port} if taken == "coordinator" else {"kafka_port": port}
        with pytest.raises(ClusterError, match=f"port {port} .* is in use"):
            LocalCluster(tmp_path, brokers=1, **kwargs)
    assert not (tmp_path / "logs").exists()   # no daemon was started


def test_daemons_start_from_the_installed_package_whatever_folder_is_named_kera(
        tmp_path, monkeypatch):
    # What `git clone .../kera` leaves in the directory users run commands from: a folder
    # named kera that Python would import as a namespace package ahead of the installed one.
    (tmp_path / "kera" / "kera").mkdir(parents=True)
    (tmp_path / "kera" / "README.md").write_text("a clone\n")
    monkeypatch.chdir(tmp_path)
    cluster = LocalCluster(tmp_path / "data", brokers=1, backups=1)
    try:
        with Admin(cluster.bootstrap) as admin:
            summary = admin.cluster()
        assert [b["alive"] for b in summary["backups"]] == [True]
        assert len(summary["brokers"]) == 1
    finally:
        cluster.stop()


def test_stream_list_says_not_ready_while_a_dead_r1_owner_is_offline(tmp_path, capsys):
    from kera.cli.main import main as kera_main

    def ready_column() -> str:
        capsys.readouterr()
        assert kera_main(["stream", "list", "--bootstrap", cluster.bootstrap]) == 0
        row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("r1 ")]
        return row[0].split()[6] if row else ""

    with LocalCluster(tmp_path, brokers=2, backups=0, log_level="WARNING",
                      heartbeat_interval_ms=100) as cluster, Admin(cluster.bootstrap) as admin:
        admin.create_stream("r1", streamlets=2, replication=1)
        assert ready_column() == "yes"
        cluster.kill_broker(1)
        wait_for(lambda: ready_column() == "no", 30, "READY to say no with broker 1 dead")
        capsys.readouterr()
        kera_main(["stream", "list", "--bootstrap", cluster.bootstrap])
        assert "no (1 offline)" in capsys.readouterr().out


def test_a_daemon_started_for_one_cluster_is_refused_by_anothers_coordinator(tmp_path):
    with LocalCluster(tmp_path / "a", brokers=1, log_level="WARNING") as cluster:
        assert "--cluster-id" in cluster.brokers[0].args   # LocalCluster binds its daemons
        proc = subprocess.run([sys.executable, "-m", "kera", "broker", "--coordinator",
                               cluster.bootstrap, "--port", "0", "--cluster-id", "not-this-one"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, proc.stderr
        assert "was started for cluster not-this-one" in proc.stderr
        with Admin(cluster.bootstrap) as admin:
            assert len(admin.cluster()["brokers"]) == 1   # nothing of it was registered


def _pid_of(marker: str) -> int | None:
    """The pid of the process whose command line holds `marker` (a daemon's --dir)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        return int(entry)
            except OSError:
                continue
    return None


def test_kera_local_restarts_a_daemon_killed_under_it(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kera", "local", "--dir", str(tmp_path),
                             "--port", "0", "--brokers", "1", "--backups", "0",
                             "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        bootstrap = proc.stdout.readline().strip()
        broker_dir = str(tmp_path / "broker-0")
        first = _pid_of(broker_dir)
        assert first is not None
        with Admin(bootstrap) as admin:
            version = admin.cluster()["brokers"][0]["registered_version"]
            os.kill(first, signal.SIGKILL)

            def back() -> bool:
                b = admin.cluster()["brokers"][0]
                return b["alive"] and b["registered_version"] > version
            wait_for(back, 30, "the killed broker to be restarted and registered again")
        assert _pid_of(broker_dir) not in (None, first)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "broker-0 exited with code -9" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
