"""A daemon's Prometheus exposition (kera.daemon.metrics): the snapshot collector's families with
HELP and TYPE under the names `kera stats` gives, labelled rows, text from other exporters, the
latency histograms, and one registry per daemon served over HTTP."""

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kera.coordinator.group_lag import lag_text
from kera.daemon.metrics import LATENCY_BUCKETS_S, DaemonMetrics, Labelled


class Lag:
    records, bytes = 40, 4096


def exposition(metrics: DaemonMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def broker_metrics(snapshot: dict, rows: dict | None = None) -> DaemonMetrics:
    return DaemonMetrics("kera_broker", lambda: snapshot, {"address": "h:7001"},
                         [Labelled("kera_broker_stream", "stream", lambda: rows or {})],
                         extra=lambda: lag_text({"g": {("s", 3): Lag()}}, 0, 0))


def test_snapshot_counters_are_gauges_with_help_under_their_kera_stats_names():
    snap = {"chunks_appended": 40, "chunks_per_replication_write": 2.5, "registered": True,
            "node": "host-a", "refused-not.owner": 2}
    text = exposition(broker_metrics(snap))
    assert "# HELP kera_broker_chunks_appended chunks appended to this broker's streamlets" in text
    assert "# TYPE kera_broker_chunks_appended gauge" in text
    assert 'kera_broker_chunks_appended{address="h:7001"} 40.0' in text.splitlines()
    got = families(text)
    assert got["kera_broker_chunks_per_replication_write"].samples[0].value == 2.5
    # A name with characters Prometheus refuses keeps working as before (underscores).
    assert got["kera_broker_refused_not_owner"].samples[0].value == 2
    assert "kera_broker_registered" not in got and "kera_broker_node" not in got
    assert all(f.documentation for f in got.values())   # every family has HELP text


def test_labelled_rows_and_other_exporters_text_become_families_with_help():
    rows = {'we"ird': {"records_in": 7, "bytes_in": 90}, "b": {"records_in": 1}}
    got = families(exposition(broker_metrics({}, rows)))
    records = got["kera_broker_stream_records_in"]
    assert records.type == "gauge" and records.documentation
    assert {s.labels["stream"]: s.value for s in records.samples} == {'we"ird': 7, "b": 1}
    assert [s.labels for s in got["kera_broker_stream_bytes_in"].samples] == [{"stream": 'we"ird'}]
    lag = got["kera_group_lag_records"]
    assert lag.documentation.startswith("records a group's committed position")
    assert lag.samples[0].labels == {"group": "g", "stream": "s", "streamlet": "3"}
    assert lag.samples[0].value == 40


def test_latency_histograms_count_observations_in_their_buckets_with_the_daemon_labels():
    metrics = broker_metrics({})
    fetch = metrics.histogram("fetch_latency_seconds", "fetch latency", held="false")
    held = metrics.histogram("fetch_latency_seconds", "fetch latency", held="true")
    fetch.observe(0.003)
    fetch.observe(0.2)
    held.observe(1.5)
    family = families(exposition(metrics))["kera_broker_fetch_latency_seconds"]
    assert family.type == "histogram" and family.documentation == "fetch latency"
    buckets = {(s.labels["held"], s.labels["le"]): s.value for s in family.samples
               if s.name.endswith("_bucket")}
    assert len(buckets) == 2 * (len(LATENCY_BUCKETS_S) + 1)   # + the +Inf bucket
    assert buckets[("false", "0.0025")] == 0 and buckets[("false", "0.005")] == 1
    assert buckets[("false", "0.25")] == 2 and buckets[("true", "1.0")] == 0
    assert buckets[("true", "+Inf")] == 1
    count = [s for s in family.samples if s.name.endswith("_count") and s.labels["held"] == "false"]
    assert count[0].value == 2 and count[0].labels["address"] == "h:7001"


def test_each_daemon_has_its_own_registry_served_on_its_own_port():
    first, second = broker_metrics({"streams": 1}), broker_metrics({"streams": 2})
    # The same histogram name in two daemons of one process: no clash (not the global registry).
    first.histogram("produce_latency_seconds", "produce").observe(0.001)
    second.histogram("produce_latency_seconds", "produce")
    try:
        for metrics, streams in ((first, 1), (second, 2)):
            metrics.serve(0, "127.0.0.1")
            port = metrics.httpd.server_address[1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                got = families(r.read().decode())
            assert got["kera_broker_streams"].samples[0].value == streams
            counts = [s.value for s in got["kera_broker_produce_latency_seconds"].samples
                      if s.name.endswith("_count")]
            assert counts == [1 if metrics is first else 0]
    finally:
        first.shutdown()
        second.shutdown()
