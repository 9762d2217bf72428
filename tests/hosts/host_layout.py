"""A kera cluster across test hosts: which daemon runs on which host, and pausing a daemon.

    hosts = TestHosts(HOSTS).create()
    cluster = LocalCluster(tmp_path, where=placement(hosts), brokers=2, backups=3)
    cluster.kill_broker(0); cluster.restart_broker(0)
    with paused(cluster.backups[1]): ...           # SIGSTOP, SIGCONT on leaving
    hosts.partition(host_of(cluster.brokers[1]))

The layout: the coordinator on host 1, brokers on hosts 2-3, backups on hosts 4-6; clients
(this process) on the root namespace's host (netns.BRIDGE_HOST). Each daemon's `--node` is its
host's name, so placement sees six machines; the daemons are the real `python -m kera`
processes of LocalCluster, started through `ip netns exec`, logs in the cluster's data dir.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from kera.cli.local import Daemon, Where
from netns import TestHosts, wait_until

COORDINATOR_HOST = 1
BROKER_HOSTS = (2, 3)
BACKUP_HOSTS = (4, 5, 6)
HOSTS = 6
PAUSE_MAX_S = 120.0      # a paused daemon resumes by itself after this: a failed test leaves none
SIGNAL_TIMEOUT_S = 5.0   # a stopped/continued process shows its new state within this


def layout(name: str) -> int:
    """The host of daemon `name` (`coordinator`, `broker-I`, `backup-I`)."""
    if name == "coordinator":
        return COORDINATOR_HOST
    kind, _, index = name.partition("-")
    hosts = BROKER_HOSTS if kind == "broker" else BACKUP_HOSTS
    return hosts[int(index) % len(hosts)]


def paired_backups(name: str) -> int:
    """`layout`, but backups two to a host in id order (backups 0 and 1 on host 4, ...): ids
    next to each other share a host, so a choice blind to hosts would pair them."""
    kind, _, index = name.partition("-")
    return BACKUP_HOSTS[int(index) // 2 % len(BACKUP_HOSTS)] if kind == "backup" else layout(name)


def placement(hosts: TestHosts, layout_of=layout):
    """LocalCluster's `where` for `layout_of` (daemon name -> host number) on `hosts`."""
    def where(name: str) -> Where:
        i = layout_of(name)
        return Where(hosts.address(i), hosts.name(i), hosts.prefix(i))
    return where


def host_of(daemon: Daemon) -> int:
    return layout(daemon.name)


def _state(pid: int) -> str:
    """The process state letter of /proc/PID/stat ("T": stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@contextlib.contextmanager
def paused(daemon: Daemon, max_s: float = PAUSE_MAX_S):
    """SIGSTOP `daemon` for the block (it keeps its sockets; peers see it hang, not die), then
    SIGCONT; a timer sends SIGCONT after `max_s` if the block has not ended by then."""
    pid = daemon.pid
    daemon.signal(signal.SIGSTOP)
    wait_until(lambda: _state(pid) == "T", f"{daemon.name} to stop", SIGNAL_TIMEOUT_S)
    timer = threading.Timer(max_s, daemon.signal, args=(signal.SIGCONT,))
    timer.daemon = True
    timer.start()
    try:
        yield daemon
    finally:
        timer.cancel()
        daemon.signal(signal.SIGCONT)
        wait_until(lambda: _state(pid) != "T", f"{daemon.name} to continue", SIGNAL_TIMEOUT_S)
