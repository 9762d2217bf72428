"""Replication counters end to end: `Admin.stats()`, `kera stats`, the Prometheus endpoints
(`--metrics-port`), and the command-line path `kera local --backups`, `kera stream create
--replication`, `kera cluster --replicas`."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from kera.client.admin import Admin
from kera.cli.local import free_port

from test_replication import Writer, create, flushed, wait_for

pytestmark = pytest.mark.timeout(180)


def kera(*args: str, bootstrap: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kera", *args, "--bootstrap", bootstrap],
                          input=input, capture_output=True, text=True, timeout=60)


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"([a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(3))
    return out


def test_counters_through_admin_kera_stats_and_prometheus(fresh_cluster):
    broker_port, backup_port = free_port(), free_port()
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                            extra_broker_args=["--metrics-port", str(broker_port)],
                            extra_backup_args=["--metrics-port", str(backup_port)])
    broker, backup = cluster.brokers[0].address, cluster.backups[0].address
    sid = create(cluster, "obs", replication=2, streamlets=4)
    writer = Writer(broker, producer_id=31)
    writer.send_all([[writer.chunk(sid, sl) for sl in range(4)] for _ in range(10)])
    wait_for(lambda: flushed(backup), "the backup to flush")

    with Admin(cluster.bootstrap) as admin:
        stats = admin.stats()
    b, k = stats["brokers"][0], stats["backups"][0]
    assert b["chunks_appended"] == 40 and b["bytes_appended"] > 0
    assert b["replication_writes"] >= 1
    assert b["chunks_per_replication_write"] == pytest.approx(
        b["replication_chunks"] / b["replication_writes"])
    assert b["durable_lag_bytes"] == 0 and b["pending_produce"] == 0
    assert b["replication_bytes"] >= k["bytes_received"] >= b["bytes_appended"]
    assert 1 <= k["replicate_writes"] <= b["replication_writes"]
    if not b.get("replica_failures") and not b.get("replication_throttled"):
        # No write had to be repeated: every chunk went over once.
        assert b["replication_chunks"] == k["chunks_received"] == 40
        assert b["replication_bytes"] == k["bytes_received"] == b["bytes_appended"]
        assert b["replication_writes"] == k["replicate_writes"] <= 40
    assert k["chunks_per_replicate_write"] == pytest.approx(b["chunks_per_replication_write"])
    assert k["flushes"] >= 1 and k["flush_bytes"] == k["bytes_received"]
    assert k["unflushed_bytes"] == 0

    def coordinator_entries() -> int:   # the broker reports its virtual segments by heartbeat
        with Admin(cluster.bootstrap) as admin:
            return admin.stats()["coordinator"]["replica_entries"]
    wait_for(coordinator_entries, "the coordinator to count the replicated virtual segment")

    # `kera stats`: the same counters, as JSON and as a table with one column per daemon.
    as_json = kera("stats", "--json", bootstrap=cluster.bootstrap)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["brokers"]["0"]["chunks_appended"] == 40
    assert data["brokers"]["0"]["replication_writes"] >= b["replication_writes"]
    assert data["backups"]["0"]["flush_bytes"] == k["flush_bytes"]
    table = kera("stats", bootstrap=cluster.bootstrap)
    assert table.returncode == 0, table.stderr
    # Grouped per daemon kind (kera.cli.stats_view): rows are COUNTER UNIT value-per-daemon.
    lines = table.stdout.splitlines()
    assert "== brokers ==" in lines and "== backups ==" in lines
    rows = {line.split()[0]: line.split()[1:] for line in lines
            if len(line.split()) >= 3 and not line.startswith(("COUNTER", "=="))
            and ":" not in line.split()[0]}
    assert rows["chunks_appended"] == ["count", "40"]
    assert "replication_writes" in rows and "flushes" in rows and "durable_lag_bytes" in rows

    # Prometheus text: the daemons refresh their snapshot on a timer, so wait for the figures.
    wait_for(lambda: metrics(broker_port).get("kera_broker_chunks_appended") == 40,
             "the broker's metrics to show the appends")
    m = metrics(broker_port)
    assert m["kera_broker_replication_writes"] == b["replication_writes"]
    assert m["kera_broker_replication_bytes"] == b["replication_bytes"]
    assert m["kera_broker_durable_lag_bytes"] == 0
    assert "kera_broker_chunks_per_replication_write" in m
    wait_for(lambda: metrics(backup_port).get("kera_backup_flush_bytes") == k["flush_bytes"],
             "the backup's metrics to show the flushes")
    m = metrics(backup_port)
    assert m["kera_backup_chunks_received"] == k["chunks_received"] and m["kera_backup_flushes"] >= 1
    assert m["kera_backup_unflushed_bytes"] == 0
    writer.close()


def test_command_line_cluster_with_replication(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kera", "local", "--dir", str(tmp_path),
                             "--port", "0", "--brokers", "1", "--backups", "2",
                             "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        boot = proc.stdout.readline().strip()
        assert boot.startswith("127.0.0.1:"), boot
        assert "2 backups" in proc.stdout.readline()
        created = kera("stream", "create", "lines", "--replication", "3", "--durability", "disk",
                       bootstrap=boot)
        assert created.returncode == 0, created.stderr
        assert "replication 3" in created.stdout
        lines = [f"line {i}" for i in range(3000)]
        produced = kera("produce", "lines", "-o", "linger_ms=2", bootstrap=boot,
                        input="\n".join(lines) + "\n")
        assert produced.returncode == 0, produced.stderr
        consumed = kera("consume", "lines", "--from", "earliest", "--max-records", "3000",
                        "--timeout-s", "20", bootstrap=boot)
        assert consumed.stdout.splitlines() == lines

        data = json.loads(kera("stats", "--json", bootstrap=boot).stdout)
        broker = data["brokers"]["0"]
        assert broker["replication_writes"] >= 1 and broker["durable_lag_bytes"] == 0
        # R=3 with two backups: both received every chunk the broker appended.
        for b in ("0", "1"):
            assert data["backups"][b]["bytes_received"] == broker["bytes_appended"]

        # `kera cluster --replicas`: which backups hold each virtual segment (both, here).
        def listed():
            out = kera("cluster", "--replicas", "--json", bootstrap=boot)
            assert out.returncode == 0, out.stderr
            entries = json.loads(out.stdout)["replicas"]
            return entries if entries and all(sorted(e[3]) == [0, 1] for e in entries) else None
        entries = wait_for(listed, "the coordinator to list the replicas")
        assert all(e[0] == 0 for e in entries)
        table = kera("cluster", "--replicas", bootstrap=boot)
        assert table.returncode == 0 and "BACKUPS" in table.stdout and "0,1" in table.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_per_stream_traffic_in_kera_stats_streams_and_prometheus(fresh_cluster):
    from kera.consumer import Consumer
    from kera.producer import Producer
    broker_port = free_port()
    cluster = fresh_cluster(brokers=1, log_level="WARNING",
                            extra_broker_args=["--metrics-port", str(broker_port),
                                               "--metrics-stream-labels"])
    create(cluster, "busy", streamlets=2, replication=1)
    create(cluster, "quiet", replication=1)
    with Producer(cluster.bootstrap, linger_ms=1) as p:
        for i in range(300):
            p.send("busy", b"b%d" % i)
        for i in range(7):
            p.send("quiet", b"q%d" % i)
    with Consumer(cluster.bootstrap, "busy", start="earliest") as c:
        assert len([c.poll(timeout_s=10) for _ in range(300)]) == 300

    as_json = kera("stats", "--streams", "--json", bootstrap=cluster.bootstrap)
    assert as_json.returncode == 0, as_json.stderr
    streams = json.loads(as_json.stdout)["streams"]
    busy, quiet = streams["busy"], streams["quiet"]
    assert (busy["records_in"], quiet["records_in"]) == (300, 7)
    assert busy["chunks_in"] >= 1 and busy["bytes_in"] > quiet["bytes_in"] > 0
    assert busy["chunks_out"] >= busy["chunks_in"] and busy["bytes_out"] >= busy["bytes_in"]
    assert quiet["chunks_out"] == quiet["bytes_out"] == 0
    table = kera("stats", "--streams", bootstrap=cluster.bootstrap).stdout.splitlines()
    assert table[1].split()[:3] == ["stream", "records", "in"]
    assert [line.split()[:2] for line in table[2:]] == [["busy", "300"], ["quiet", "7"]]
    rates = kera("stats", "--streams", "--interval-s", "0.5", "--json", bootstrap=cluster.bootstrap)
    assert json.loads(rates.stdout)["streams"]["busy"]["records_in"] == 0   # nothing since
    assert kera("stats", "--interval-s", "1", bootstrap=cluster.bootstrap).returncode != 0

    def labelled() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{broker_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {m.group(1, 2): float(m.group(3)) for m in re.finditer(
            r'^(kera_broker_stream_[a-z_]+)\{stream="([^"]+)"\} (\S+)$', text, re.M)}
    wait_for(lambda: labelled().get(("kera_broker_stream_records_in", "busy")) == 300,
             "the broker's metrics to show the stream's appends")
    m = labelled()
    assert m[("kera_broker_stream_records_in", "quiet")] == 7
    assert m[("kera_broker_stream_bytes_out", "busy")] == busy["bytes_out"]
