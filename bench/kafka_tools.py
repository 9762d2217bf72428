"""Kafka's own Java performance tools, `ProducerPerformance` and `ConsumerPerformance` (the
`kafka-tools` jar the harness' Maven classpath already holds): the command lines the
`kafka-java` systems run and the numbers read back from what the tools print.

ProducerPerformance prints a line every 5 s and, at the end, one summary line:

    300000 records sent, 49693.6 records/sec (4.74 MB/sec), 825.56 ms avg latency,
    1632.00 ms max latency, 978 ms 50th, 1214 ms 95th, 1238 ms 99th, 1261 ms 99.9th.

(one line; latency is the producer's send-to-acknowledgement time, not end to end).
ConsumerPerformance prints a CSV header and one line of values:

    start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec,
    rebalance.time.ms, fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec
"""

from __future__ import annotations

import re

from .clients import kafka_tuned_producer
from .workload import Workload

PRODUCER_PERFORMANCE = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_PERFORMANCE = "org.apache.kafka.tools.ConsumerPerformance"
# What bin/kafka-producer-perf-test.sh and kafka-consumer-perf-test.sh give the tool JVM.
TOOL_HEAP = "512M"
UNTHROTTLED = -1                 # ProducerPerformance --throughput: no limit
# ProducerPerformance's --record-size records are random upper-case letters: the same load as
# the workload's with compression "none"; with lz4/zstd they compress unlike its payload.
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_PRODUCER_SUMMARY = re.compile(
    rf"{_NUMBER} records sent, {_NUMBER} records/sec \({_NUMBER} MB/sec\), "
    rf"{_NUMBER} ms avg latency, {_NUMBER} ms max latency, {_NUMBER} ms 50th, "
    rf"{_NUMBER} ms 95th, {_NUMBER} ms 99th, {_NUMBER} ms 99\.9th")
_PRODUCER_INTERVAL = re.compile(
    rf"^{_NUMBER} records sent, {_NUMBER} records/sec \({_NUMBER} MB/sec\), "
    rf"{_NUMBER} ms avg latency, {_NUMBER} ms max latency\.$", re.MULTILINE)
REPORT_INTERVAL_S = 5.0          # ProducerPerformance prints an interval line this often (fixed)
PRODUCER_FIELDS = ("records", "records_per_s", "mb_per_s", "latency_avg_ms", "latency_max_ms",
                   "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_p999_ms")
CONSUMER_HEADER = "start.time"
CONSUMER_TEXT_FIELDS = ("start.time", "end.time")


class ToolOutputError(ValueError):
    """A tool's output lacks the summary the harness reads (it failed or was cut short)."""


def producer_props(w: Workload, bootstrap: str, tuned: bool = False) -> dict[str, str]:
    """The Java producer's settings for `w`: the harness' Kafka settings in the Java client's
    names (batch.size = chunk, linger.ms, buffer.memory = the producer buffer), or the tuned
    ones (bench.clients.kafka_tuned_producer)."""
    batch, linger, buffer = (w.chunk_size_bytes, w.linger_ms, w.producer_buffer_bytes)
    if tuned:
        t = kafka_tuned_producer(w)
        batch, linger, buffer = t["batch_size_bytes"], t["linger_ms"], t["buffer_bytes"]
    return {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": "true",
            "compression.type": w.compression, "batch.size": str(batch),
            "linger.ms": str(round(linger)), "buffer.memory": str(buffer),
            "max.in.flight.requests.per.connection": "5"}


def producer_args(topic: str, records: int, rate_per_s: int, w: Workload,
                  props: dict[str, str]) -> list[str]:
    """ProducerPerformance's arguments: `records` records of the workload's size to `topic`,
    at most `rate_per_s` records/s (UNTHROTTLED: as fast as acknowledged)."""
    return [PRODUCER_PERFORMANCE, "--topic", topic, "--num-records", str(records),
            "--record-size", str(w.record_size_bytes), "--throughput", str(rate_per_s),
            "--producer-props", *(f"{k}={v}" for k, v in props.items())]


def consumer_args(topic: str, records: int, bootstrap: str, group: str,
                  idle_timeout_ms: int) -> list[str]:
    """ConsumerPerformance's arguments: read `records` records of `topic` from the beginning
    in consumer group `group`, giving up after `idle_timeout_ms` without a record."""
    return [CONSUMER_PERFORMANCE, "--bootstrap-server", bootstrap, "--topic", topic,
            "--messages", str(records), "--group", group, "--timeout", str(idle_timeout_ms)]


def parse_producer_summary(text: str) -> dict:
    """The final summary of ProducerPerformance's output (the interval lines lack the
    percentiles and are skipped); latencies in ms, MB as the tool prints it (2**20 bytes)."""
    found = _PRODUCER_SUMMARY.findall(text)
    if not found:
        raise ToolOutputError(f"no ProducerPerformance summary in: {_tail(text)!r}")
    values = dict(zip(PRODUCER_FIELDS, (float(v) for v in found[-1])))
    values["records"] = int(values["records"])
    return values


def parse_producer_intervals(text: str) -> list[tuple[int, float]]:
    """(records, records/s) of each of ProducerPerformance's interval lines, in order."""
    return [(int(float(m[0])), float(m[1])) for m in _PRODUCER_INTERVAL.findall(text)]


def records_per_s_after_first_interval(summary: dict, intervals: list) -> float | None:
    """The rate after the first interval line (which holds the client's JIT warm-up and
    first metadata and producer-id requests): the summary's records and elapsed time minus
    the first interval's; None when the run had no interval line or nothing after it."""
    if not intervals or not summary["records_per_s"]:
        return None
    first_records, first_rate = intervals[0]
    rest = summary["records"] - first_records
    elapsed_s = summary["records"] / summary["records_per_s"] - first_records / first_rate
    return rest / elapsed_s if rest > 0 and elapsed_s > 0 else None


def parse_producer_run(text: str) -> dict:
    """The summary with `steady_records_per_s` (the rate after the first interval, or the
    whole run's when there was no interval line) and `steady` saying which it is."""
    summary = parse_producer_summary(text)
    steady = records_per_s_after_first_interval(summary, parse_producer_intervals(text))
    return {**summary, "steady": steady is not None,
            "steady_records_per_s": steady or summary["records_per_s"]}


def parse_consumer_summary(text: str) -> dict:
    """ConsumerPerformance's CSV line as {column: value}: numbers as floats, the two times as
    text, data.consumed.in.nMsg as an int."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    at = next((i for i, line in enumerate(lines) if line.startswith(CONSUMER_HEADER)), None)
    if at is None or at + 1 >= len(lines):
        raise ToolOutputError(f"no ConsumerPerformance summary in: {_tail(text)!r}")
    names = [n.strip() for n in lines[at].split(",")]
    cells = [c.strip() for c in lines[at + 1].split(",")]
    if len(cells) != len(names):
        raise ToolOutputError(f"ConsumerPerformance: {len(names)} columns but values "
                              f"{lines[at + 1]!r}")
    out = {n: c if n in CONSUMER_TEXT_FIELDS else float(c) for n, c in zip(names, cells)}
    out["data.consumed.in.nMsg"] = int(out["data.consumed.in.nMsg"])
    return out


def _tail(text: str, chars: int = 300) -> str:
    return text[-chars:]
