"""The coordinator's change log under kill -9 at random points: a real coordinator process
takes replica reports (heartbeats) from fake brokers and stream creations from an admin
client, all at once, and is killed with SIGKILL; after each restart its state holds every
change it acknowledged and nothing that was never sent. One round also tears the log's last
record (a crash mid-write): the coordinator ignores it with a warning and starts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from faultkit import seeded, wait_for

from kera.net import rpc
from kera.client.admin import Admin
from kera.coordinator import store
from kera.errors import KeraError
from kera.cli.local import free_port

pytestmark = pytest.mark.timeout(300)

ROUNDS = 4
BROKERS = 2
CALL_TIMEOUT_S = 2.0


class Coordinator:
    def __init__(self, data_dir: Path, port: int, log_path: Path):
        self.address = f"127.0.0.1:{port}"
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kera", "coordinator", "--port", str(port), "--dir",
             str(data_dir), "--heartbeat-missed-max", "100000"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._answers, "coordinator answering")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, "coordinator exited"
        rpc.call(self.address, "cluster", timeout_s=0.5)
        return True

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


class Workload:
    """Threads sending changes until stopped; each change is `sent` first, `acked` on reply."""

    def __init__(self, address: str, tokens: dict[int, str], state: dict):
        self.address = address
        self.state = state
        self.tokens = tokens
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._heartbeats, args=(b,), daemon=True)
                        for b in tokens]
        self.threads.append(threading.Thread(target=self._creates, daemon=True))
        for t in self.threads:
            t.start()

    def _heartbeats(self, broker_id: int) -> None:
        sent, acked = self.state["sent"][broker_id], self.state["acked"][broker_id]
        with rpc.Connection(self.address, timeout_s=CALL_TIMEOUT_S) as conn:
            while not self.stop.is_set():
                seq = self.state["next"][broker_id]
                self.state["next"][broker_id] += 3
                entries = [[0, seq + k, [k]] for k in range(3)]
                sent.update(seq + k for k in range(3))
                try:
                    conn.call("heartbeat", {"kind": "broker", "daemon_id": broker_id,
                                            "token": self.tokens[broker_id],
                                            "metadata_version": 0, "vsegs": entries})
                except KeraError:
                    continue
                acked.update(seq + k for k in range(3))

    def _creates(self) -> None:
        with rpc.Connection(self.address, timeout_s=CALL_TIMEOUT_S) as conn:
            while not self.stop.is_set():
                name = f"s{self.state['next_stream']}"
                self.state["next_stream"] += 1
                self.state["streams_sent"].add(name)
                try:
                    conn.call("create_stream", {"name": name, "streamlets": 2, "replication": 1})
                except KeraError:
                    time.sleep(0.01)
                    continue
                self.state["streams_acked"].add(name)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(CALL_TIMEOUT_S * 3)


def current_log(data_dir: Path) -> Path:
    generation = json.loads((data_dir / store.STATE_FILE).read_text())["log_generation"]
    return data_dir / store.log_name(generation)


def check(address: str, state: dict, broker_ids: list[int]) -> None:
    with Admin(address, timeout_s=10) as admin:   # follows the list_streams cursor
        streams = {s["name"] for s in admin.list_streams()}
    assert state["streams_acked"] <= streams <= state["streams_sent"]
    for b in broker_ids:
        entries = rpc.call(address, "replicas", {"broker_id": b}, timeout_s=10)[0]["replicas"]
        held = {vseg for _, _, vseg, _ in entries}
        missing = state["acked"][b] - held
        assert not missing, f"broker {b}: {len(missing)} acknowledged entries lost"
        assert held <= state["sent"][b]


def test_coordinator_log_survives_kill9_at_random_points(tmp_path):
    rng = seeded("coordinator log kill -9")
    data_dir, port = tmp_path / "coordinator", free_port()
    log_path = tmp_path / "coordinator.log"
    coord = Coordinator(data_dir, port, log_path)
    replies = [rpc.call(coord.address, "register", {"kind": "broker", "node": f"n{i}",
                                                    "address": f"127.0.0.1:{7100 + i}"})[0]
               for i in range(BROKERS)]
    tokens = {r["daemon_id"]: r["token"] for r in replies}   # heartbeats must present them
    broker_ids = list(tokens)
    state = {"sent": {b: set() for b in broker_ids}, "acked": {b: set() for b in broker_ids},
             "next": {b: 0 for b in broker_ids}, "next_stream": 0,
             "streams_sent": set(), "streams_acked": set()}
    for round_no in range(ROUNDS):
        work = Workload(coord.address, tokens, state)
        time.sleep(rng.uniform(0.3, 1.5))
        coord.kill()                       # while requests are in flight
        work.join()
        if round_no == 1:
            with open(current_log(data_dir), "ab") as f:   # a record the crash cut short
                f.write(b"\x40\x00\x00\x00\x12\x34\x56\x78[[\"rput\",0,0,")
        coord = Coordinator(data_dir, port, log_path)
        check(coord.address, state, broker_ids)
        print(f"round {round_no}: {sum(map(len, state['acked'].values()))} entries and "
              f"{len(state['streams_acked'])} streams acknowledged, all kept")
    coord.kill()
    assert sum(map(len, state["acked"].values())) > 100 and state["streams_acked"]
    assert "torn last record" in log_path.read_text()
