"""A broker's Prometheus endpoint end to end (kera.daemon.metrics, kera.broker.latency): real
producers and consumers against a broker with `--metrics-port` and an R=2 stream; its scrape
parsed with prometheus_client's parser has HELP and TYPE for every family, the counters under
their `kera stats` names, produce, fetch (immediate and held) and replication latency
histograms counting the requests served, and no series naming a stream unless asked; and every
metric the Grafana dashboard (docs/grafana/kera.json) queries is served by some daemon."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kera.cli.local import free_port
from kera.consumer import Consumer
from kera.producer import Producer

from test_replication import create, wait_for

pytestmark = pytest.mark.timeout(120)

RECORDS = 200
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kera.json"


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def count(families: dict, name: str, **labels: str) -> float:
    """The `_count` sample of histogram `name` (summed over other labels) matching `labels`."""
    return sum(s.value for s in families[name].samples if s.name == name + "_count"
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_latency_histograms_counters_with_help_and_the_dashboards_metrics(fresh_cluster):
    port, backup_port, coordinator_port = free_port(), free_port(), free_port()
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                            extra_broker_args=["--metrics-port", str(port)],
                            extra_backup_args=["--metrics-port", str(backup_port)],
                            extra_coordinator_args=["--metrics-port", str(coordinator_port),
                                                    "--metrics-stream-labels"])
    create(cluster, "timed", replication=2, streamlets=2)
    with Producer(cluster.bootstrap, linger_ms=1) as p:
        for i in range(RECORDS):
            p.send("timed", b"v%d" % i)
            if i % 20 == 19:
                p.flush()   # several produce requests, each acknowledged once durable
    with Consumer(cluster.bootstrap, "timed", start="earliest", group="readers") as c:
        assert len([c.poll(timeout_s=10) for _ in range(RECORDS)]) == RECORDS
        assert c.poll(timeout_s=1.0) is None   # its fetches are held, then answered empty
        c.commit()

    # Counters reach the endpoint with the next heartbeat; histograms at once.
    def settled():
        f = scrape(port)
        gauge = {n: f[f"kera_broker_{n}"].samples[0].value
                 for n in ("produce_requests", "pending_produce", "writes_in_flight")}
        done = gauge["pending_produce"] == gauge["writes_in_flight"] == 0
        return f if done and gauge["produce_requests"] >= RECORDS // 20 and count(
            f, "kera_broker_produce_latency_seconds") == gauge["produce_requests"] else None
    families = wait_for(settled, "every produce request timed and counted")
    assert all(f.documentation for f in families.values()), "a family without HELP"
    assert families["kera_broker_chunks_appended"].type == "gauge"
    assert families["kera_broker_produce_latency_seconds"].type == "histogram"
    assert count(families, "kera_broker_fetch_latency_seconds", held="false") > 0
    wait_for(lambda: count(scrape(port), "kera_broker_fetch_latency_seconds", held="true") > 0,
             "a held fetch timed")
    writes = families["kera_broker_replication_writes"].samples[0].value
    assert 0 < count(families, "kera_broker_replication_latency_seconds") <= writes
    address = cluster.brokers[0].address
    assert {s.labels["address"] for s in families["kera_broker_produce_latency_seconds"].samples
            } == {address}
    # Stream names are exported only with --metrics-stream-labels.
    assert not [name for name in families if name.startswith("kera_broker_stream_")]

    served = with_samples(families) | with_samples(scrape(backup_port))
    # The lag exporter's pass is cached a few seconds (kera.coordinator.group_lag).
    wait_for(lambda: served.update(with_samples(scrape(coordinator_port)))
             or "kera_group_lag_bytes" in served, "the coordinator's group lag", timeout_s=30)
    # kera_broker_stream_*: served with --metrics-stream-labels (test_replication_observability).
    wanted = {m for m in dashboard_metrics() if not m.startswith("kera_broker_stream_")}
    assert wanted - served == set()


def with_samples(families: dict) -> set[str]:
    return {name for name, family in families.items() if family.samples}


def dashboard_metrics() -> set[str]:
    """The metric families the dashboard's queries name (histograms by family name)."""
    text = " ".join(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
                    for t in p.get("targets", ()))
    return {re.sub(r"_bucket$", "", m) for m in re.findall(r"kera_[a-z_]+", text)}
