"""`kera stream list` follows list_streams pages past the first; `kera cluster deregister`
refuses a live daemon or one owning streamlets and forgets a dead one (real coordinator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kera.net import rpc
from kera.coordinator.ops import STREAMS_PAGE_MAX
from kera.cli.local import LocalCluster

pytestmark = pytest.mark.timeout(300)


def kera(*args, bootstrap: str, timeout_s: float = 120):
    env = {**os.environ, "KERA_BOOTSTRAP": bootstrap}
    return subprocess.run([sys.executable, "-m", "kera", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def wait_for(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture
def coordinator(tmp_path):
    with LocalCluster(tmp_path, brokers=0, backups=0, log_level="WARNING",
                      heartbeat_interval_ms=50) as cluster:
        yield cluster


def members(boot: str, kind: str) -> dict[int, dict]:
    return {m["id"]: m for m in rpc.call(boot, "cluster")[0][kind + "s"]}


def test_stream_list_follows_the_cursor(coordinator, fake_daemons):
    boot = coordinator.bootstrap
    fake_daemons(boot, address="127.0.0.1:7301", node="a")
    count = STREAMS_PAGE_MAX + 7
    with rpc.Connection(boot, timeout_s=10) as conn:
        for i in range(count):
            conn.call("create_stream", {"name": f"s{i:05d}", "streamlets": 1, "replication": 1})
        first = conn.call("list_streams", {})[0]
    assert len(first["streams"]) == STREAMS_PAGE_MAX and first["next"] == f"s{STREAMS_PAGE_MAX - 1:05d}"
    listed = kera("stream", "list", "--json", bootstrap=boot)
    assert listed.returncode == 0, listed.stderr
    assert [s["name"] for s in json.loads(listed.stdout)] == [f"s{i:05d}" for i in range(count)]


def test_deregister_refuses_live_or_owning_daemons_and_forgets_dead_ones(coordinator, fake_daemons):
    boot = coordinator.bootstrap
    owner = fake_daemons(boot, address="127.0.0.1:7311", node="a")
    backup = fake_daemons(boot, kind="backup", address="127.0.0.1:7312", node="b")
    made = kera("stream", "create", "kept", "--streamlets", "1", "--replication", "1",
                "--no-wait", bootstrap=boot)
    assert made.returncode == 0, made.stderr

    refused = kera("cluster", "deregister", "--backup", str(backup.id), bootstrap=boot)
    assert refused.returncode != 0 and "alive" in refused.stderr
    assert backup.id in members(boot, "backup")

    owner.stop()
    backup.stop()
    wait_for(lambda: not members(boot, "broker")[owner.id]["alive"]
             and not members(boot, "backup")[backup.id]["alive"], "both declared dead")
    refused = kera("cluster", "deregister", "--broker", str(owner.id), bootstrap=boot)
    assert refused.returncode != 0 and "owns streamlets" in refused.stderr and "kept" in refused.stderr

    done = kera("cluster", "deregister", "--backup", str(backup.id), bootstrap=boot)
    assert done.returncode == 0, done.stderr
    assert backup.id not in members(boot, "backup")
    # Deleting the stream frees the broker; then it goes too, and stays gone after a restart.
    assert kera("stream", "delete", "kept", bootstrap=boot).returncode == 0
    done = kera("cluster", "deregister", "--broker", str(owner.id), bootstrap=boot)
    assert done.returncode == 0, done.stderr
    coordinator.restart_coordinator()
    coordinator.wait_coordinator()
    assert owner.id not in members(boot, "broker") and backup.id not in members(boot, "backup")
    # Options may come before the subcommand too (KERA_BOOTSTRAP points nowhere here).
    missing = kera("cluster", "--bootstrap", boot, "deregister", "--broker", str(owner.id),
                   bootstrap="127.0.0.1:1")
    assert missing.returncode != 0 and f"no broker has id {owner.id}" in missing.stderr


def test_a_broker_applies_every_page_of_its_streams(tmp_path):
    """More streams on one broker than one `broker_streams` page holds: the broker lists them
    page by page and serves the last one (it would answer unknown_stream for a stream of a
    page it never applied)."""
    from kera import Consumer, Producer

    with LocalCluster(tmp_path, brokers=1, backups=0, log_level="WARNING",
                      heartbeat_interval_ms=50) as cluster:
        count = STREAMS_PAGE_MAX + 5
        with rpc.Connection(cluster.bootstrap, timeout_s=10) as conn:
            for i in range(count):
                conn.call("create_stream", {"name": f"s{i:05d}", "streamlets": 1,
                                            "replication": 1})
        last = f"s{count - 1:05d}"
        with Producer(cluster.bootstrap) as producer:
            producer.send(last, b"on the second page")
            producer.flush()
        with Consumer(cluster.bootstrap, last, start="earliest") as consumer:
            record = next(iter(consumer))
        assert record.value == b"on the second page"
