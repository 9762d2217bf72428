"""Counters a daemon exposes: through its `stats` op and as a Prometheus endpoint.

Each daemon that serves `--metrics-port` has a DaemonMetrics: a prometheus_client registry of
its own (not the process-wide default, so two daemons in one process never mix) holding a
SnapshotCollector, which turns the daemon's counter snapshot and its labelled rows (e.g. per
stream) into gauge families with HELP text at scrape time, and the latency histograms the
daemon's shell observes. prometheus_client's HTTP server answers the scrapes on a thread.

Names are `<prefix>_<counter>` (`kera_broker_chunks_appended`), as `kera stats` names the
counters; they stay gauges even where they only grow, because a Prometheus counter must end in
`_total` and dashboards use these names.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Latency histogram buckets in seconds (Prometheus' base unit): 0.5 ms, a write acknowledged
# from a backup's memory on loopback, up to 10 s, the default request timeout; roughly 1-2.5-5
# steps so p50 and p99 are read within a factor of ~2 anywhere in between.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)

# HELP text of the metrics a dashboard is built on (docs/grafana/kera.json); any other
# counter gets a generic line naming it (its meaning is in `kera stats` and the daemon's code).
HELP = {
    "kera_broker_chunks_appended": "chunks appended to this broker's streamlets",
    "kera_broker_bytes_appended": "bytes of chunks appended to this broker's streamlets",
    "kera_broker_duplicates": "chunks refused as retries of chunks already appended",
    "kera_broker_produce_requests": "produce requests received",
    "kera_broker_replication_writes": "replication writes sent to backups",
    "kera_broker_replication_bytes": "bytes sent to backups in replication writes",
    "kera_broker_durable_lag_bytes": "bytes appended but not yet acknowledged by every backup",
    "kera_broker_pending_produce": "produce requests waiting to be durable",
    "kera_broker_writes_in_flight": "replication writes awaiting their backup's ack",
    "kera_broker_streams": "streams this broker knows",
    "kera_broker_fetch_chunks": "chunks sent in fetch replies",
    "kera_broker_fetch_bytes": "bytes sent in fetch replies",
    "kera_broker_memory_bytes": "bytes of segments mapped in memory",
    "kera_broker_memory_limit_bytes": "the broker's --memory-limit",
    "kera_broker_tiered_bytes": "bytes of segment files in --dir",
    "kera_broker_metadata_version": "the stream metadata version this broker applied",
    "kera_broker_stream_records_in": "records appended to the stream on this broker",
    "kera_broker_stream_records_out": "records fetched from the stream on this broker",
    "kera_broker_stream_bytes_in": "bytes appended to the stream on this broker",
    "kera_broker_stream_bytes_out": "bytes fetched from the stream on this broker",
    "kera_backup_unflushed_bytes": "replica bytes acknowledged but not yet on disk",
    "kera_backup_memory_bytes": "replica bytes held in memory",
    "kera_backup_disk_bytes": "replica bytes in this backup's --dir",
    "kera_backup_disk_limit_bytes": "the backup's --disk-limit (0: none)",
    "kera_backup_replicate_writes": "replication writes received",
    "kera_coordinator_metadata_version": "the cluster's metadata version",
    "kera_coordinator_brokers_alive": "brokers whose heartbeats arrive",
    "kera_coordinator_backups_alive": "backups whose heartbeats arrive",
    "kera_coordinator_streams": "streams in the cluster",
    "kera_coordinator_failovers": "broker failovers the coordinator drove",
    "kera_coordinator_streamlets_recovering": "streamlets being recovered on a new owner",
    "kera_group_lag_records": "records a group's committed position is behind the durable end",
    "kera_group_lag_bytes": "bytes a group's committed position is behind the durable end",
}

_NOT_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


class Counters(dict):
    """Named numeric counters; `add` and `set` are the only writers."""

    def add(self, name: str, amount: int | float = 1) -> None:
        self[name] = self.get(name, 0) + amount

    def set(self, name: str, value: int | float) -> None:
        self[name] = value


@dataclass(frozen=True)
class Labelled:
    """Gauges `prefix_<name>{label="<row key>"}` from `rows()`, {row key: {name: number}}
    (e.g. a broker's per-stream traffic). `rows` must be safe to call from the scrape thread."""
    prefix: str
    label: str
    rows: Callable[[], dict]


def metric_name(prefix: str, name: str) -> str:
    return _NOT_NAME_CHARS.sub("_", f"{prefix}_{name}")


def help_of(metric: str) -> str:
    return HELP.get(metric) or f"kera counter {metric} (see `kera stats`)"


def _numbers(stats: dict) -> Iterable[tuple[str, int | float]]:
    for name, value in sorted(stats.items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, value


def snapshot_families(prefix: str, stats: dict, labels: dict | None) -> list[Metric]:
    """One gauge family per number in `stats`, with the daemon's constant `labels`."""
    labels = labels or {}
    names, values = sorted(labels), [str(labels[k]) for k in sorted(labels)]
    out = []
    for name, value in _numbers(stats):
        metric = metric_name(prefix, name)
        family = GaugeMetricFamily(metric, help_of(metric), labels=names)
        family.add_metric(values, value)
        out.append(family)
    return out


def labelled_families(spec: Labelled) -> list[Metric]:
    families: dict[str, GaugeMetricFamily] = {}
    for key, stats in sorted(spec.rows().items()):
        for name, value in _numbers(stats):
            metric = metric_name(spec.prefix, name)
            if metric not in families:
                families[metric] = GaugeMetricFamily(metric, help_of(metric), labels=[spec.label])
            families[metric].add_metric([str(key)], value)
    return [families[m] for m in sorted(families)]


def text_families(text: str) -> list[Metric]:
    """Families from Prometheus text (e.g. the coordinator's group lag), given HELP text."""
    out = []
    for family in text_string_to_metric_families(text):
        if not family.documentation:
            family.documentation = help_of(family.name)
        out.append(family)
    return out


class SnapshotCollector(Collector):
    """At each scrape: the daemon's snapshot, its labelled rows and any `extra` text, as
    metric families (see the module docstring)."""

    def __init__(self, prefix: str, snapshot: Callable[[], dict], labels: dict | None = None,
                 labelled: Iterable[Labelled] = (), extra: Callable[[], str] | None = None):
        self.prefix, self.snapshot, self.labels = prefix, snapshot, labels
        self.labelled, self.extra = tuple(labelled), extra

    def collect(self) -> Iterable[Metric]:
        yield from snapshot_families(self.prefix, dict(self.snapshot()), self.labels)
        for spec in self.labelled:
            yield from labelled_families(spec)
        if self.extra is not None:
            yield from text_families(self.extra())


class DaemonMetrics:
    """One daemon's registry: its SnapshotCollector and the latency histograms its shell
    observes (`histogram`). `serve` starts the HTTP endpoint."""

    def __init__(self, prefix: str, snapshot: Callable[[], dict], labels: dict | None = None,
                 labelled: Iterable[Labelled] = (), extra: Callable[[], str] | None = None):
        self.prefix, self.labels = prefix, dict(labels or {})
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(prefix, snapshot, labels, labelled, extra))
        self._histograms: dict[str, Histogram] = {}
        self.httpd = None

    def histogram(self, name: str, doc: str, **labels: str):
        """The latency histogram `prefix_name` (seconds) for `labels` plus the daemon's own:
        observe with `.observe(seconds)`. Called again with other `labels` values, the same
        family (its label names must be the same)."""
        every = {**self.labels, **labels}
        parent = self._histograms.get(name)
        if parent is None:
            parent = Histogram(metric_name(self.prefix, name), doc, sorted(every),
                               registry=self.registry, buckets=LATENCY_BUCKETS_S)
            self._histograms[name] = parent
        return parent.labels(**every) if every else parent

    def serve(self, port: int, host: str) -> None:
        """Answer `GET /metrics` on `host:port` from a daemon thread."""
        self.httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, self.httpd.server_address[1])

    def shutdown(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


def serve_metrics(port: int, prefix: str, snapshot: Callable[[], dict], labels: dict | None = None,
                  host: str = "127.0.0.1", labelled: Iterable[Labelled] = (),
                  extra: Callable[[], str] | None = None) -> DaemonMetrics:
    """A DaemonMetrics serving on `host:port`. `snapshot` must be safe to call from the scrape
    thread (a copy taken under the daemon's lock, or a dict the loop replaces whole)."""
    metrics = DaemonMetrics(prefix, snapshot, labels, labelled, extra)
    metrics.serve(port, host)
    return metrics


def add_stream_labels_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--metrics-stream-labels`: series labelled by stream or group name only when asked, as
    they name what ACLs may hide from a scraper (the endpoint has no authentication)."""
    parser.add_argument("--metrics-stream-labels", action="store_true",
                        help=f"also export {what} on the metrics endpoint: labels naming "
                             "streams or groups, which ACLs may hide from whoever reaches the "
                             "endpoint (default: off)")


def labelled_text(prefix: str, label: str, rows: dict[str, dict]) -> str:
    """Prometheus text of {label value: {name: number}}: one gauge `prefix_name` per name with
    one sample per label value (e.g. a broker's per-stream compaction figures)."""
    samples: dict[str, list[str]] = {}
    for value, stats in sorted(rows.items()):
        for name, number in _numbers(stats):
            samples.setdefault(name, []).append(
                f'{prefix}_{name}{{{label}="{label_value(value)}"}} {number}')
    lines = []
    for name in sorted(samples):
        lines += [f"# TYPE {prefix}_{name} gauge", *samples[name]]
    return "\n".join(lines) + "\n" if lines else ""


def label_value(value: str) -> str:
    """A label value as Prometheus' text format wants it (backslash, quote, newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
