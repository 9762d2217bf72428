"""Rebalancing on a real cluster: a broker that was down while a stream was created comes back
empty; `kera cluster rebalance` (or the coordinator's automatic policy) moves streamlets onto
it while a producer keeps sending, and every acknowledged record is read back exactly once.

Values are `b"<n>"`: every record read names which one it is, so the test counts exactly.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time

import pytest

from kera import Consumer, Producer

from kera.net import rpc
from kera.coordinator import rebalance

pytestmark = pytest.mark.timeout(300)

STREAMLETS = 6
HEARTBEAT_MS = 50             # a dead window of 1 s
SETTLE_TIMEOUT_S = 60.0


def until(condition, what: str, timeout_s: float = SETTLE_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def alive(cluster, broker: int) -> bool:
    brokers = rpc.call(cluster.bootstrap, "cluster")[0]["brokers"]
    return any(b["id"] == broker and b["alive"] for b in brokers)


class Sending:
    """A producer sending numbered keyed records until stopped; keeps the acknowledged."""

    def __init__(self, cluster, stream: str):
        self.acked: list[int] = []
        self.errors: list = []
        self._stop = threading.Event()
        self._producer = Producer(cluster.bootstrap, linger_ms=2, metadata_max_age_ms=500)
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: str) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            self._producer.send(stream, str(i).encode(), key=str(i).encode(),
                                on_delivery=lambda err, md, i=i: (self.errors if err else
                                                                  self.acked).append(i))
            if i % 20 == 19:
                time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._producer.flush(60)
        self._producer.close()


def read_all(cluster, stream: str, count: int) -> list[int]:
    values = []
    with Consumer(cluster.bootstrap, stream) as c:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while len(values) < count and time.monotonic() < deadline:
            r = c.poll(timeout_s=0.2)
            if r is not None:
                values.append(int(r.value))
        time.sleep(0.5)   # a duplicate would arrive after the count: give it the chance
        while (r := c.poll(timeout_s=0.2)) is not None:
            values.append(int(r.value))
    return values


def kera(cluster, *args):
    env = {**os.environ, "KERA_BOOTSTRAP": cluster.bootstrap}
    return subprocess.run([sys.executable, "-m", "kera", *args], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.mark.parametrize("how", ["command", "automatic"])
def test_a_restarted_broker_gets_streamlets_back_and_nothing_is_lost(fresh_cluster, how):
    extra = ["--no-auto-rebalance"] if how == "command" else []
    cluster = fresh_cluster(brokers=3, backups=2, heartbeat_interval_ms=HEARTBEAT_MS,
                            log_level="INFO", extra_coordinator_args=extra)
    cluster.kill_broker(2)
    until(lambda: not alive(cluster, 2), "broker 2 declared dead")
    with cluster.admin() as admin:
        admin.create_stream("r", streamlets=STREAMLETS, replication=2)
        assert 2 not in admin.describe_stream("r")["placement"]
    sending = Sending(cluster, "r")
    try:
        until(lambda: len(sending.acked) >= 100, "records acknowledged before the restart")
        cluster.restart_broker(2)
        if how == "command":
            plan = kera(cluster, "cluster", "rebalance", "--dry-run")
            assert plan.returncode == 0, plan.stderr
            assert "next step" in plan.stdout, plan.stdout
            began = time.monotonic()
            done = kera(cluster, "cluster", "rebalance")
            assert done.returncode == 0, done.stderr + done.stdout
            print(f"kera cluster rebalance: {time.monotonic() - began:.2f} s "
                  f"(process start included)\n{done.stdout}")
            assert "step: broker" in done.stdout and "balanced after" in done.stdout, done.stdout
        with cluster.admin() as admin:
            def spread_out():
                d = admin.describe_stream("r")
                counts = [d["placement"].count(b) for b in range(3)]
                return max(counts) - min(counts) <= 1 and \
                    d["states"] == ["serving"] * STREAMLETS

            until(spread_out, "streamlets spread over the three brokers, serving",
                  SETTLE_TIMEOUT_S + rebalance.AUTO_STEADY_S)
            placement = admin.describe_stream("r")["placement"]
        moved = len(sending.acked)
        until(lambda: len(sending.acked) >= moved + 100,
              "records acknowledged on the new placement")
    finally:
        sending.stop()
    assert 2 in placement, placement
    assert not sending.errors, f"{len(sending.errors)} records failed"
    values = read_all(cluster, "r", len(sending.acked))
    assert len(values) == len(set(values)), "a record was read twice"
    assert set(sending.acked) <= set(values), "an acknowledged record was lost"
