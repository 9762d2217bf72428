"""Test hosts made of Linux network namespaces joined by a bridge: a cluster across hosts on
one machine, and partitions made by taking a host's link down.

    hosts = TestHosts(6).create()       # kera-<tag>-h1 ... -h6 at 10.x.y.1 ... 10.x.y.6
    hosts.prefix(2)                     # ("ip", "netns", "exec", "kera-<tag>-h2"): run inside
    hosts.partition(2); hosts.heal(2)   # host 2 cut off from every other host, then back
    hosts.destroy()                     # also at interpreter exit, and by the next run

Each host is a namespace with `lo` and an `eth0` whose veth peer sits on a bridge in the root
namespace; the bridge has the subnet's address BRIDGE_HOST too, so this process (the root
namespace) is one more host: clients run here. A run's names carry a tag derived from the
checkout and the pytest worker, and its /24 comes from the tag, so runs of other checkouts do
not clash; a run that finds its tag still owned by a live process takes the next tag, and one
that finds it owned by a dead process (a crashed run) removes what that run left first.
Needs root and iproute2: `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

IP_TIMEOUT_S = 10.0         # one `ip` command: milliseconds normally; hung means broken
GONE_TIMEOUT_S = 10.0       # a deleted namespace's veth pair disappears asynchronously
POLL_S = 0.05
PARTITION_MAX_S = 180.0     # a partition heals itself after this: a failed test leaves none
HOSTS_MAX = 250             # host I is 10.x.y.I; BRIDGE_HOST is the root namespace
BRIDGE_HOST = 254
TAG_ATTEMPTS_MAX = 32       # tags tried before giving up (each a live run of ours)
OWNERS_DIR = Path("/run/kera-netns")   # <tag>.pid: the pid of the run that owns the tag
NAME_PREFIX = "kera"


class HostsError(RuntimeError):
    """Building or changing the test hosts failed; the message carries `ip`'s complaint."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS` (bounded by IP_TIMEOUT_S); its stdout. Fails with its stderr if `check`."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise HostsError(f"`ip {' '.join(args)}` hung for {IP_TIMEOUT_S} s") from err
    if check and done.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why network-namespace test hosts cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, a bridge)"
    if shutil.which("ip") is None:
        return "test hosts need iproute2's `ip`"
    probe = f"{NAME_PREFIX}-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except HostsError as err:
        return f"cannot create a network namespace: {err}"
    ip("netns", "del", probe, check=False)
    return None


def default_seed() -> str:
    """What a run's tag derives from: this checkout and the pytest worker (if any)."""
    checkout = Path(__file__).resolve().parents[2]
    return f"{checkout}:{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TestHosts:
    """N test hosts, numbered 1..N (see the module docstring)."""

    __test__ = False   # not a pytest test class, despite the name

    def __init__(self, count: int, seed: str | None = None):
        assert 1 <= count <= HOSTS_MAX, f"1..{HOSTS_MAX} hosts, not {count}"
        self.count = count
        self.seed = seed or default_seed()
        self.tag = ""
        self.subnet = ""             # "10.x.y": host I is f"{subnet}.{I}"
        self._heals: dict[int, threading.Timer] = {}
        self._created = False

    # ------------------------------------------------------------------ names
    def name(self, i: int) -> str:
        """Host i's namespace, also its `--node`."""
        return f"{NAME_PREFIX}-{self.tag}-h{i}"

    def address(self, i: int) -> str:
        """Host i's IPv4 address (BRIDGE_HOST: the root namespace's)."""
        return f"{self.subnet}.{i}"

    def prefix(self, i: int) -> tuple[str, ...]:
        """A command prefix that runs a command inside host i (`ip netns exec` execs it: the
        process started is the command itself, so signals sent to it reach it)."""
        return ("ip", "netns", "exec", self.name(i))

    def _bridge(self) -> str:
        return f"kr{self.tag}br"       # interface names are at most 15 bytes

    def _veth(self, i: int) -> str:
        return f"kr{self.tag}h{i}"     # the root-namespace end of host i's link

    # ------------------------------------------------------------------ lifecycle
    def create(self) -> "TestHosts":
        self._claim()
        atexit.register(self.destroy)
        self._created = True
        try:
            bridge = self._bridge()
            ip("link", "add", bridge, "type", "bridge")
            ip("addr", "add", f"{self.address(BRIDGE_HOST)}/24", "dev", bridge)
            ip("link", "set", bridge, "up")
            for i in range(1, self.count + 1):
                self._add_host(i)
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_host(self, i: int) -> None:
        ns, veth = self.name(i), self._veth(i)
        ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", veth, "master", self._bridge(), "up")
        ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "set", "eth0", "up")

    def destroy(self) -> None:
        """Remove every namespace, link and the bridge of this run (idempotent)."""
        if not self._created:
            return
        for timer in self._heals.values():
            timer.cancel()
        self._heals.clear()
        _remove_run(self.tag)
        (OWNERS_DIR / f"{self.tag}.pid").unlink(missing_ok=True)
        self._created = False
        atexit.unregister(self.destroy)

    def __enter__(self) -> "TestHosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()

    # ------------------------------------------------------------------ tags and subnets
    def _claim(self) -> None:
        """Take the first tag no live run owns whose subnet no interface uses; remove what a
        dead owner of that tag left behind."""
        OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        for attempt in range(TAG_ATTEMPTS_MAX):
            digest = hashlib.sha1(f"{self.seed}:{attempt}".encode()).digest()
            tag, subnet = digest[:2].hex(), f"10.{200 + digest[2] % 50}.{digest[3]}"
            if self._take(tag, subnet):
                self.tag, self.subnet = tag, subnet
                return
        raise HostsError(f"no free tag for test hosts after {TAG_ATTEMPTS_MAX} attempts: "
                         f"remove stale entries of {OWNERS_DIR}")

    def _take(self, tag: str, subnet: str) -> bool:
        owner = OWNERS_DIR / f"{tag}.pid"
        fd = _create_owner(owner)
        if fd is None:
            text = owner.read_text(errors="replace").strip() if owner.exists() else ""
            if text.isdigit() and _pid_alive(int(text)):
                return False
            owner.unlink(missing_ok=True)   # a crashed run's: take it over, once
            fd = _create_owner(owner)
            if fd is None:
                return False                # another run took it meanwhile
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        _remove_run(tag)                    # what a crashed run with this tag left
        if f" {subnet}." in ip("-o", "-4", "addr", "show"):
            owner.unlink()
            return False                    # someone else's subnet
        return True

    # ------------------------------------------------------------------ partitions
    def partition(self, i: int, max_s: float = PARTITION_MAX_S) -> None:
        """Take host i's link down: it can reach no other host and none can reach it. Heals
        by itself after `max_s` if `heal` is not called first."""
        ip("link", "set", self._veth(i), "down")
        timer = threading.Timer(max_s, self.heal, args=(i,))
        timer.daemon = True
        self._heals[i] = timer
        timer.start()

    def heal(self, i: int) -> None:
        """Bring host i's link back up, and wait until its end inside the host has carrier."""
        timer = self._heals.pop(i, None)
        if timer is not None:
            timer.cancel()
        ip("link", "set", self._veth(i), "up")
        wait_until(lambda: "LOWER_UP" in ip("-n", self.name(i), "-o", "link", "show", "eth0"),
                   f"host {i}'s link to come back up", GONE_TIMEOUT_S)


def _create_owner(path: Path) -> int | None:
    """A new owner file opened for writing; None if it exists."""
    try:
        return os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None


def _remove_run(tag: str) -> None:
    """Remove the namespaces, veths and bridge named with `tag`, and wait until they are gone."""
    prefix = f"{NAME_PREFIX}-{tag}-h"
    for line in ip("netns", "list").splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(prefix):
            ip("netns", "del", ns, check=False)
    ip("link", "del", f"kr{tag}br", check=False)

    def gone() -> bool:
        return not any(name.startswith(f"kr{tag}") for name in _root_links())
    if not gone():
        for name in _root_links():
            if name.startswith(f"kr{tag}"):
                ip("link", "del", name, check=False)
    wait_until(gone, f"the links of test hosts {tag} to disappear", GONE_TIMEOUT_S)


def _root_links() -> list[str]:
    """Interface names of the root namespace (without the `@peer` suffix)."""
    return [line.split()[0].split("@")[0] for line in ip("-br", "link").splitlines() if line.split()]


def wait_until(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise HostsError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)
