"""The test-host harness itself: hosts are separate network stacks reachable through the
bridge, a partition cuts one host off and healing brings it back, a process started inside a
host is the process itself (signals reach it), and nothing is left behind (nor after a crash)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import netns

CONNECT_TIMEOUT_S = 1.0
CHILD_TIMEOUT_S = 20.0
# A TCP server inside a host: prints its pid once listening, answers each connection "ok".
SERVER = """
import os, socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7999)); s.listen()
print(os.getpid(), flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""
# A client inside a host: exit 0 if the server at argv[1] answers within a second.
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 7999), timeout=1.0) as c:
    sys.exit(0 if c.recv(2) == b"ok" else 1)
"""


def answers(address: str) -> bool:
    try:
        with socket.create_connection((address, 7999), timeout=CONNECT_TIMEOUT_S) as c:
            return c.recv(2) == b"ok"
    except OSError:
        return False


def answers_from(hosts, i: int, address: str) -> bool:
    done = subprocess.run([*hosts.prefix(i), sys.executable, "-c", CLIENT, address],
                          capture_output=True, timeout=CHILD_TIMEOUT_S)
    return done.returncode == 0


def leftovers(tag: str) -> list[str]:
    names = [line.split()[0] for line in netns.ip("netns", "list").splitlines() if line.split()]
    names += netns._root_links()
    return [n for n in names if f"-{tag}-" in n or n.startswith(f"kr{tag}")]


@pytest.fixture
def server(test_hosts):
    hosts = test_hosts(3)
    proc = subprocess.Popen([*hosts.prefix(1), sys.executable, "-c", SERVER, hosts.address(1)],
                            stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        yield hosts, proc, pid
    finally:
        proc.kill()
        proc.wait(CHILD_TIMEOUT_S)


def test_hosts_reach_each_other_and_a_partition_cuts_one_off(server):
    hosts, proc, pid = server
    assert pid == proc.pid                 # `ip netns exec` execs: signals reach the daemon
    assert answers(hosts.address(1)) and answers_from(hosts, 2, hosts.address(1))
    assert not answers("127.0.0.1")        # the server is on host 1's stack, not this one's
    hosts.partition(1)
    assert not answers(hosts.address(1)) and not answers_from(hosts, 2, hosts.address(1))
    hosts.heal(1)
    netns.wait_until(lambda: answers(hosts.address(1)), "host 1 to answer again", 10.0)
    assert answers_from(hosts, 2, hosts.address(1))


def test_destroy_leaves_nothing_and_a_crashed_run_is_cleaned_at_start(tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    seed = f"{tmp_path}:crash"
    crashed = netns.TestHosts(2, seed=seed).create()
    tag = crashed.tag
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    (netns.OWNERS_DIR / f"{tag}.pid").write_text(dead.stdout.strip())   # its owner died
    crashed._created = False               # ... without cleaning up
    assert leftovers(tag)
    again = netns.TestHosts(2, seed=seed).create()
    try:
        assert again.tag == tag            # same names: created over the crashed run's remains
    finally:
        again.destroy()
    assert leftovers(tag) == [] and not (netns.OWNERS_DIR / f"{tag}.pid").exists()


def test_a_live_runs_tag_is_not_taken(test_hosts, tmp_path):
    seed = f"{tmp_path}:live"
    first = netns.TestHosts(1, seed=seed).create()
    try:
        second = netns.TestHosts(1, seed=seed).create()
        try:
            assert second.tag != first.tag and second.subnet != first.subnet
        finally:
            second.destroy()
    finally:
        first.destroy()
