"""Kafka's own Java clients as a system of the run (`kafka-java`, `kafka-java-tuned`): a
reference row measured with ProducerPerformance and ConsumerPerformance on the same Kafka
cluster the Python client's trials use, so the Kafka server's capacity shows apart from the
Python client's.

A trial, on fresh topics shaped like the workload's:
- P producer JVMs (the workload's producers), producer i writing to topic i mod S with the
  workload's record size, acks=all, idempotence, batch.size = chunk, linger.ms, buffer.memory
  = the producer buffer (the tuned system: bench.clients.kafka_tuned_producer's values);
- one ConsumerPerformance JVM per topic written, started first, reading every record produced
  to it from the beginning while the producers run;
- each producer sends enough records for the tool's first 5 s interval (its warm-up) plus the
  window: unthrottled, at the rate of the previous trial of the workload, or of a first,
  unrecorded calibration run on other topics (a warm-up for the brokers too); at an offered
  rate, `rate_records_per_s` (ProducerPerformance --throughput).
Reported: the producers' records/s after their first interval line (the whole run's if there
was none; sums over the JVMs), the producers' send-to-ack latency
(p50/p99/p99.9 over the whole run, as the tool keeps them: the highest over the JVMs; not
end to end, latency_kind "producer ack"),
ConsumerPerformance's fetch.nMsg.sec (its rate after joining the group), the server CPU over
the producers' run and the tool JVMs' own CPU (start-up and JIT included).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from . import kafka_tools as tools
from .procstat import machine_cpu_s, processes_cpu_s
from .runner import TrialError, TrialResult
from .systems import KafkaSystem
from .workload import Workload

CALIBRATION_RECORDS = 300_000    # per producer JVM: a few seconds at this machine's rates
# A calibration run is short, so its rate includes the client's JIT warm-up: the measured run is
# sized for this much more, so it outlasts the first interval plus the window.
CALIBRATION_HEADROOM = 1.5
MIN_RECORDS = 10_000             # a measured run shorter than this is mostly JVM start-up
TOOL_MARGIN_S = 120.0            # JVM start, topic metadata, flush: beyond the planned run
TOOL_MIN_RATE_PER_S = 2_000      # an unthrottled producer slower than this is broken: bounds its wait
CONSUMER_IDLE_TIMEOUT_MS = 30_000  # ConsumerPerformance gives up after this long without data
CONSUMER_DRAIN_TIMEOUT_S = 60.0  # consumers finishing after the producers exited
WAIT_POLL_S = 0.05
KILL_WAIT_S = 10.0
PRODUCER_ACK = "producer ack"    # latency_kind of these rows


def java_missing() -> str | None:
    """Why Kafka's Java tools cannot run here, or None."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return None
    if shutil.which("java"):
        return None
    return "java not found on PATH or in $JAVA_HOME (Kafka's tools need Java 17+)"


class KafkaJavaSystem(KafkaSystem):
    """Kafka measured by its own Java tools; shares the run's Kafka cluster."""

    def __init__(self, work_dir: Path, name: str = "kafka-java", share=None):
        super().__init__(work_dir, name, share)
        self.rates_per_producer: dict[str, float] = {}   # calibrated, by workload label
        self.logs = Path(work_dir) / name

    def settings(self, w: Workload) -> dict:
        return {"layout": {**w.kafka_layout(), "version": "4.1.2"},
                "client": "Kafka's Java tools (kafka-tools 4.1.2): ProducerPerformance, "
                          "ConsumerPerformance", "tool_heap": tools.TOOL_HEAP,
                "producer": tools.producer_props(w, "<bootstrap>", self.tuned),
                "topic": {"partitions": w.streamlets, "replication.factor": w.replication},
                "producer_jvms": w.producers, "consumer_jvms": len(_topics_written(w)),
                "latency": "producer send to acknowledgement (not end to end)"}

    def trial(self, w: Workload, prefix: str, repeat: int = 0) -> TrialResult:
        records = self._records_per_producer(w, prefix)
        self.create(prefix, w)
        try:
            return self._measure(w, prefix, repeat, records)
        finally:
            try:
                self.delete(prefix, w)
            except Exception:  # noqa: BLE001 - a failed cleanup must not hide the result
                pass

    def _records_per_producer(self, w: Workload, prefix: str) -> int:
        rate = w.rate_records_per_s or self.rates_per_producer.get(w.label())
        if not rate:
            rate = CALIBRATION_HEADROOM * self._calibrate(w, f"{prefix}c")
        return max(MIN_RECORDS, round(rate * (tools.REPORT_INTERVAL_S + w.duration_s)))

    def _calibrate(self, w: Workload, prefix: str) -> float:
        """Records/s one producer JVM sends, unthrottled, on throw-away topics."""
        self.create(prefix, w)
        try:
            runs = self._produce(w, prefix, CALIBRATION_RECORDS, tools.UNTHROTTLED, "cal")
        finally:
            self.delete(prefix, w)
        return sum(r["steady_records_per_s"] for r, _ in runs) / len(runs)

    def _measure(self, w: Workload, prefix: str, repeat: int, records: int) -> TrialResult:
        consumers = self._start_consumers(w, prefix, records)
        try:
            pids = self.server_pids()
            server0, machine0, t0 = processes_cpu_s(pids), machine_cpu_s(), time.monotonic()
            rate = w.rate_records_per_s or tools.UNTHROTTLED
            produced = self._produce(w, prefix, records, rate, f"t{repeat}")
            elapsed_s = time.monotonic() - t0
            server1, machine1 = processes_cpu_s(pids), machine_cpu_s()
            consumed = [_finish_consumer(*c) for c in consumers]
        finally:
            for _, proc, _ in consumers:
                _kill(proc)
        if not w.rate_records_per_s:   # the next trial of w is sized by this one
            self.rates_per_producer[w.label()] = sum(
                p["steady_records_per_s"] for p, _ in produced) / len(produced)
        return java_trial_result(self.name, w, repeat, produced, consumed, elapsed_s,
                                 server1 - server0, _delta(machine0, machine1))

    def _produce(self, w: Workload, prefix: str, records: int, rate: int, tag: str) -> list:
        """Run the producer JVMs to the end: [(summary, cpu_s)] per JVM."""
        props = tools.producer_props(w, self.bootstrap, self.tuned)
        procs = [self._start(tools.producer_args(topic, records, rate, w, props),
                             f"{tag}-producer-{i}")
                 for i, topic in enumerate(_producer_topics(w, prefix))]
        timeout_s = TOOL_MARGIN_S + records / (rate if rate > 0 else TOOL_MIN_RATE_PER_S)
        try:
            return [_finish_producer(proc, out, timeout_s) for proc, out in procs]
        finally:
            for proc, _ in procs:
                _kill(proc)

    def _start_consumers(self, w: Workload, prefix: str, records: int) -> list:
        """One ConsumerPerformance per topic written, for every record produced to it."""
        out = []
        for topic, producers in _topics_written(w, prefix).items():
            args = tools.consumer_args(topic, records * producers, self.bootstrap,
                                       f"{topic}-perf", CONSUMER_IDLE_TIMEOUT_MS)
            proc, path = self._start(args, f"consumer-{topic}")
            out.append((topic, proc, path))
        return out

    def _start(self, args: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        from .kafka.cluster import JVM_GC_OPTS, LOG4J_CONFIG, _java

        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.logs / f"{name}.out"
        cmd = [_java(), f"-Xmx{tools.TOOL_HEAP}", *JVM_GC_OPTS, f"-Dkafka.logs.dir={self.logs}",
               f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp",
               self.cluster._classpath(), *args]
        with open(path, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return proc, path


def _producer_topics(w: Workload, prefix: str) -> list[str]:
    from .clients import stream_name
    return [stream_name(prefix, i % w.streams) for i in range(w.producers)]


def _topics_written(w: Workload, prefix: str = "") -> dict[str, int]:
    """{topic: producer JVMs writing it}."""
    out: dict[str, int] = {}
    for topic in _producer_topics(w, prefix):
        out[topic] = out.get(topic, 0) + 1
    return out


def _finish_producer(proc: subprocess.Popen, path: Path, timeout_s: float) -> tuple:
    cpu_s = wait_cpu_s(proc, timeout_s)
    text = path.read_text(errors="replace")
    if proc.returncode != 0:
        raise TrialError(f"ProducerPerformance exited {proc.returncode}: {text[-600:]}")
    return tools.parse_producer_run(text), cpu_s


def _finish_consumer(topic: str, proc: subprocess.Popen, path: Path) -> tuple:
    cpu_s = wait_cpu_s(proc, CONSUMER_DRAIN_TIMEOUT_S + CONSUMER_IDLE_TIMEOUT_MS / 1000)
    text = path.read_text(errors="replace")
    if proc.returncode != 0:
        raise TrialError(f"ConsumerPerformance on {topic} exited {proc.returncode}: "
                         f"{text[-600:]}")
    return tools.parse_consumer_summary(text), cpu_s


def wait_cpu_s(proc: subprocess.Popen, timeout_s: float) -> float:
    """Wait for `proc` (at most `timeout_s`, then kill it and raise TrialError) and return the
    CPU seconds it used (user + system, all its threads), read from wait4's rusage."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            _kill(proc)
            raise TrialError(f"{' '.join(proc.args[-12:])} still running after {timeout_s:.0f} s")
        time.sleep(WAIT_POLL_S)


def _kill(proc: subprocess.Popen) -> None:
    if proc.returncode is not None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGKILL)
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def _delta(before: tuple, after: tuple) -> tuple[float, float]:
    return after[0] - before[0], after[1] - before[1]


def java_trial_result(system: str, w: Workload, repeat: int, produced: list, consumed: list,
                      elapsed_s: float, server_cpu_s: float, machine: tuple) -> TrialResult:
    """A TrialResult from the tools' summaries: `produced` [(producer summary, cpu_s)],
    `consumed` [(consumer summary, cpu_s)], `machine` (busy, total) CPU seconds."""
    acked = sum(p["records"] for p, _ in produced)
    got = sum(c["data.consumed.in.nMsg"] for c, _ in consumed)
    rate = sum(p["steady_records_per_s"] for p, _ in produced)
    pcpu, ccpu = sum(c for _, c in produced), sum(c for _, c in consumed)
    total_cpu, millions = server_cpu_s + pcpu + ccpu, acked / 1e6
    busy, total = machine

    def worst(key: str) -> float:
        return max(p[key] for p, _ in produced)

    return TrialResult(
        system=system, label=w.label(), repeat=repeat, producer_records_per_s=rate,
        producer_mb_per_s=rate * w.record_size_bytes / 1e6,
        consumer_records_per_s=sum(c["fetch.nMsg.sec"] for c, _ in consumed),
        latency_p50_ms=worst("latency_p50_ms"), latency_p99_ms=worst("latency_p99_ms"),
        latency_p999_ms=worst("latency_p999_ms"), latency_kind=PRODUCER_ACK,
        cpu_s_per_million=total_cpu / millions if millions else None,
        server_cpu_s_per_million=server_cpu_s / millions if millions else None,
        acked=acked, consumed=got, failed=0, window_s=elapsed_s, window_acked=acked,
        window_consumed=got, server_cpu_s=server_cpu_s, producer_cpu_s=pcpu,
        consumer_cpu_s=ccpu, machine_busy_fraction=min(1.0, busy / total) if total else 0.0,
        other_cpu_s=max(0.0, busy - total_cpu), drained=got >= acked,
        tool={"producers": [p for p, _ in produced], "consumers": [c for c, _ in consumed]})
