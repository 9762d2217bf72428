"""Consumer-group members as separate processes on a 12-streamlet stream under continuous
production (issue 11's test): one owner per streamlet at every moment, graceful joins and
leaves without a single duplicate, and a kill -9 whose streamlets move to the survivors within
the session timeout, resuming from the last commit (only records the dead member read may come
again; none is lost). Prints the rebalance time after the kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from kera import Producer
from tests.faults.group_member import SESSION_TIMEOUT_MS

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = pytest.mark.security_modes

STREAMLETS = 12
PRODUCE_EVERY_S = 0.002      # ~500 records/s: continuous, yet light on two cores
SETTLE_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0        # a graceful close: final commit + leave, each within a request timeout
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Member:
    def __init__(self, name: str, cluster, stream: str, group: str):
        self.name, self.events, self.lock = name, [], threading.Lock()
        self.killed_at: float | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.group_member", cluster.bootstrap, stream, group],
            stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.lock:
                self.events.append(json.loads(line))

    def owned(self) -> set:
        parts: set = set()
        with self.lock:
            for e in self.events:
                if e["ev"] == "assigned":
                    parts |= {tuple(p) for p in e["parts"]}
                elif e["ev"] == "revoked":
                    parts -= {tuple(p) for p in e["parts"]}
        return parts

    def values(self) -> list[int]:
        with self.lock:
            return [e["v"] for e in self.events if e["ev"] == "rec"]

    def stop(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()    # never leave a member behind; the test fails on its records
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self.reader.join(timeout=STOP_TIMEOUT_S)


class Production:
    def __init__(self, cluster, stream: str):
        self.next = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(cluster, stream), daemon=True)
        self.thread.start()

    def _run(self, cluster, stream) -> None:
        with Producer(cluster.bootstrap) as p:
            while not self.stopping.is_set():
                p.send(stream, str(self.next).encode(), key=str(self.next).encode())
                self.next += 1
                time.sleep(PRODUCE_EVERY_S)
            p.flush()

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join(timeout=60)
        return self.next


def until(condition, what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def balanced(members, each: int):
    return lambda: all(len(m.owned()) == each for m in members)


def ownership_intervals(members) -> dict:
    """{part: [(start, end, member)]} from the assigned/revoked events."""
    out: dict = {}
    for m in members:
        start: dict = {}
        with m.lock:
            events = list(m.events)
        # A graceful close holds its parts until the application stops reading ("closing");
        # the group may grant them elsewhere before "closed" is written.
        closing = [e["t"] for e in events if e["ev"] == "closing"]
        end_of_life = closing[0] if closing else (events[-1]["t"] if events else 0.0)
        for e in events:
            for p in map(tuple, e.get("parts", [])):
                if e["ev"] == "assigned":
                    start[p] = e["t"]
                elif e["ev"] == "revoked" and p in start:
                    out.setdefault(p, []).append((start.pop(p), e["t"], m.name))
        for p, t in start.items():   # held to the end (or to a kill -9)
            out.setdefault(p, []).append((t, max(end_of_life, m.killed_at or 0), m.name))
    return out


def assert_one_owner_at_a_time(members) -> None:
    for part, spans in ownership_intervals(members).items():
        spans.sort()
        for (s1, e1, m1), (s2, e2, m2) in zip(spans, spans[1:]):
            assert s2 >= e1, f"{part}: {m1} held it until {e1:.3f}, {m2} from {s2:.3f}"


def drain(members, produced: int, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    def missing():
        return sorted(set(range(produced)) - {v for m in members for v in m.values()})
    try:
        until(lambda: not missing(), f"all {produced} records read", timeout_s)
    except AssertionError:
        gone = missing()
        with open("/tmp/grp_events.json", "w") as f:
            json.dump({m.name: m.events for m in members}, f)
        raise AssertionError(f"{len(gone)} of {produced} records never read, e.g. {gone[:20]}; "
                             f"owned now: {[(m.name, sorted(m.owned())) for m in members]}")


def test_members_share_hand_over_and_survive_a_kill(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING")
    with cluster.admin() as admin:
        admin.create_stream("orders", streamlets=STREAMLETS)
    production = Production(cluster, "orders")
    members = []
    try:
        a = Member("a", cluster, "orders", "billing")
        b = Member("b", cluster, "orders", "billing")
        members = [a, b]
        until(balanced([a, b], 6), "two members with 6 streamlets each")
        c = Member("c", cluster, "orders", "billing")           # graceful join
        members.append(c)
        until(balanced([a, b, c], 4), "three members with 4 streamlets each")
        b.stop(signal.SIGTERM)                                   # graceful leave
        until(balanced([a, c], 6), "b's streamlets move to a and c")
        d = Member("d", cluster, "orders", "billing")
        members.append(d)
        until(balanced([a, c, d], 4), "d joins")
        # Up to here every change was graceful: not a single record twice.
        graceful = Counter(v for m in members for v in m.values())
        assert [v for v, n in graceful.items() if n > 1] == []
        lost_parts = d.owned()
        before = {m.name: len(m.events) for m in (a, c)}
        killed_at = time.monotonic()
        d.proc.kill()
        d.proc.wait(timeout=30)
        d.killed_at = killed_at
        until(balanced([a, c], 6), "d's streamlets move to the survivors",
              timeout_s=SESSION_TIMEOUT_MS / 1000 + 20)

        def resumed():
            return [e["t"] for m in (a, c) for e in m.events[before[m.name]:]
                    if e["ev"] == "rec" and ("orders", e["sl"]) in lost_parts]
        until(lambda: resumed(), "a record of d's streamlets read again")
        rebalance_s = min(resumed()) - killed_at
        print(f"\nrebalance after kill -9: {rebalance_s:.2f} s (session timeout "
              f"{SESSION_TIMEOUT_MS / 1000:.1f} s)")
        produced = production.stop()
        drain(members, produced)
    finally:
        production.stop()
        for m in members:
            if m.proc.poll() is None:
                m.stop()
    assert_one_owner_at_a_time(members)
    counts = Counter(v for m in members for v in m.values())
    assert set(counts) == set(range(produced)), "no record lost"
    again = {v for v, n in counts.items() if n > 1}
    assert again <= set(d.values()), "only records the killed member read may come twice"
    assert rebalance_s < SESSION_TIMEOUT_MS / 1000 + 5
