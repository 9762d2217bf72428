"""A real etcd for tests: 1 or 3 members on free 127.0.0.1 ports, private data dirs.

    cluster = EtcdCluster(tmp_dir, members=3).start()   # waits until every member is healthy
    cluster.url                      # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
    cluster.kill(0)                  # SIGKILL one member
    cluster.stop()                   # kills them all and removes their data

`etcd_binary()` installs Debian's `etcd-server` when no `etcd` is on the PATH (the tests run as
root); it returns None when that fails, and the fixture skips with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from kera.cli.local import free_port
from tests.debian import install_if_missing

HOST = "127.0.0.1"
HEALTHY_TIMEOUT_S = 30.0     # members started -> every one answers /health with a leader
POLL_INTERVAL_S = 0.1
HTTP_TIMEOUT_S = 1.0         # one /health probe
STOP_TIMEOUT_S = 10.0
# etcd's own knobs for tests: quick elections on loopback, and a history compacted as it goes
# (a coordinator commits every loop turn).
HEARTBEAT_INTERVAL_MS = 50
ELECTION_TIMEOUT_MS = 500
COMPACTION_RETENTION_REVISIONS = 10_000


def etcd_binary() -> tuple[str | None, str]:
    """(path of `etcd`, "") or (None, why it cannot be had)."""
    return install_if_missing("etcd-server", lambda: shutil.which("etcd"))


class EtcdCluster:
    def __init__(self, data_dir: str | os.PathLike, members: int = 1, binary: str = "etcd",
                 hosts: list[tuple[str, list[str]]] | None = None):
        """`hosts`: member i runs on hosts[i] = (its address, a command prefix such as
        `ip netns exec NAME`; tests/hosts), else all on 127.0.0.1."""
        self.dir = Path(data_dir)
        self.binary = binary
        self.hosts = hosts or [(HOST, [])] * members
        taken: set[int] = set()
        self.ports: list[tuple[int, int]] = []   # (client, peer) per member
        for _ in range(members):
            client = free_port(HOST, taken)
            taken.add(client)
            peer = free_port(HOST, taken)
            taken.add(peer)
            self.ports.append((client, peer))
        self.procs: list[subprocess.Popen | None] = [None] * members

    @property
    def url(self) -> str:
        return self.url_from(0)

    def url_from(self, first: int) -> str:
        """The members' etcd:// URL listing member `first` first (a client asks it first)."""
        order = list(range(first, len(self.ports))) + list(range(first))
        return "etcd://" + ",".join(f"{self.hosts[i][0]}:{self.ports[i][0]}" for i in order)

    def leader(self) -> int:
        """The index of the member the raft leader is (asked of a running member)."""
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                continue
            request = urllib.request.Request(self.client_url(i) + "/v3/maintenance/status",
                                             data=b"{}", method="POST")
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                status = json.loads(reply.read())
            return self._member_ids().index(status["leader"])
        raise RuntimeError("no etcd member running")

    def _member_ids(self) -> list[str]:
        """Each member's raft id, in index order (from /v3/cluster/member/list)."""
        request = urllib.request.Request(self.client_url(self._running()) +
                                         "/v3/cluster/member/list", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
            members = json.loads(reply.read())["members"]
        by_name = {m["name"]: m["ID"] for m in members}
        return [by_name[f"m{i}"] for i in range(len(self.ports))]

    def _running(self) -> int:
        return next(i for i, p in enumerate(self.procs) if p is not None and p.poll() is None)

    def client_url(self, i: int) -> str:
        return f"http://{self.hosts[i][0]}:{self.ports[i][0]}"

    def _args(self, i: int) -> list[str]:
        client, peer = self.ports[i]
        initial = ",".join(f"m{j}=http://{self.hosts[j][0]}:{p}" for j, (_, p) in enumerate(self.ports))
        return [self.binary, "--name", f"m{i}", "--data-dir", str(self.dir / f"m{i}"),
                "--listen-client-urls", self.client_url(i),
                "--advertise-client-urls", self.client_url(i),
                "--listen-peer-urls", f"http://{self.hosts[i][0]}:{peer}",
                "--initial-advertise-peer-urls", f"http://{self.hosts[i][0]}:{peer}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"kera-test-{os.getpid()}",
                "--heartbeat-interval", str(HEARTBEAT_INTERVAL_MS),
                "--election-timeout", str(ELECTION_TIMEOUT_MS),
                "--auto-compaction-mode", "revision",
                "--auto-compaction-retention", str(COMPACTION_RETENTION_REVISIONS)]

    def start(self) -> "EtcdCluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.ports)):
            self.start_member(i)
        self.wait_healthy()
        return self

    def start_member(self, i: int) -> None:
        with open(self.dir / f"m{i}.log", "ab") as logf:
            self.procs[i] = subprocess.Popen([*self.hosts[i][1], *self._args(i)], stdin=subprocess.DEVNULL,
                                             stdout=logf, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.client_url(i) + "/health",
                                        timeout=HTTP_TIMEOUT_S) as reply:
                return b'"health":"true"' in reply.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]
            if running and all(self.healthy(i) for i in running):
                return
            time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"etcd members not healthy after {timeout_s} s: see {self.dir}/m*.log")

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)
        self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)
