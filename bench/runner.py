"""One trial: a workload on one system, from fresh streams to the measured numbers.

Consumers start first (reading from the beginning), then producers; once every client is
connected the parent publishes the schedule (warm-up, then the measured window) and samples the
server processes' and the machine's CPU at the window's edges. After the window the producers
flush; the trial then waits until the consumers have read everything the producers had
acknowledged (or a drain timeout), so `consumed == acked` is the trial's integrity check.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
from dataclasses import dataclass, field

from .latency import LatencyHistogram
from .procstat import machine_cpu_s, processes_cpu_s, processes_write_bytes
from .workers import Control, consumer_main, producer_main
from .workload import Workload

READY_TIMEOUT_S = 120.0
START_DELAY_S = 0.3            # between publishing the schedule and its start
RESULT_TIMEOUT_S = 180.0       # producers' flush after the window
DRAIN_TIMEOUT_S = 60.0         # consumers catching up after the producers are done
JOIN_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.05

METRICS = ("producer_records_per_s", "producer_mb_per_s", "consumer_records_per_s",
           "latency_p50_ms", "latency_p99_ms", "cpu_s_per_million", "server_cpu_s_per_million",
           "latency_p999_ms")
END_TO_END = "end-to-end"      # latency_kind: send to receipt by a consumer


class TrialError(RuntimeError):
    """A worker failed or a trial did not finish in time."""


@dataclass
class TrialResult:
    system: str
    label: str
    repeat: int
    producer_records_per_s: float
    producer_mb_per_s: float
    consumer_records_per_s: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    cpu_s_per_million: float | None          # servers + clients, per million records acked
    server_cpu_s_per_million: float | None
    acked: int                               # whole run (warm-up + window + flush)
    consumed: int
    failed: int
    window_s: float
    window_acked: int
    window_consumed: int
    server_cpu_s: float
    producer_cpu_s: float
    consumer_cpu_s: float
    machine_busy_fraction: float             # of all cores, during the window
    other_cpu_s: float                       # machine CPU not used by this system or its clients
    drained: bool                            # consumers read everything acknowledged
    latency_hist: list = field(default_factory=list, repr=False)
    latency_p999_ms: float | None = None
    latency_kind: str | None = END_TO_END    # or "producer ack" (Kafka's Java tools)
    tool: dict = field(default_factory=dict, repr=False)   # kafka-java: the tools' own numbers
    server_disk_mb_per_s: float | None = None   # the servers' writes to storage in the window

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


def run_trial(system, w: Workload, prefix: str, repeat: int = 0) -> TrialResult:
    """Run `w` on `system` (already `ensure`d) with streams named `prefix-NNNN`."""
    system.create(prefix, w)
    try:
        return _run(system, w, prefix, repeat)
    finally:
        try:
            system.delete(prefix, w)
        except Exception:  # noqa: BLE001 - a failed cleanup must not hide the trial's result
            pass


def _run(system, w: Workload, prefix: str, repeat: int) -> TrialResult:
    ctx = mp.get_context("spawn")
    ctl = Control.create(ctx, w.consumers)
    procs = []
    try:
        for i in range(w.consumers):
            procs.append(ctx.Process(target=consumer_main, name=f"{system.name}-consumer-{i}",
                                     args=(system.name, system.bootstrap, prefix, w, i, ctl)))
        for i in range(w.producers):
            procs.append(ctx.Process(target=producer_main, name=f"{system.name}-producer-{i}",
                                     args=(system.name, system.bootstrap, prefix, w, i, ctl)))
        for p in procs:
            p.start()
        _collect(ctl, procs, "ready", w.consumers + w.producers, READY_TIMEOUT_S, system)

        start = time.time() + START_DELAY_S
        window_start = start + w.warmup_s
        window_end = window_start + w.duration_s
        ctl.times[:] = [start, window_start, window_end]
        ctl.go.set()
        pids = system.server_pids()
        _sleep_until(window_start)
        server0, machine0 = processes_cpu_s(pids), machine_cpu_s()
        written0 = processes_write_bytes(pids)
        _sleep_until(window_end)
        server1, machine1 = processes_cpu_s(pids), machine_cpu_s()
        written = processes_write_bytes(pids) - written0

        produced = _collect(ctl, procs, "result", w.producers,
                            RESULT_TIMEOUT_S + w.duration_s, system, role="producer")
        acked = sum(r["acked"] for r in produced.values())
        drained = _drain(ctl, w.consumers, acked)
        ctl.stop.set()
        consumed = _collect(ctl, procs, "result", w.consumers, RESULT_TIMEOUT_S, system,
                            role="consumer")
    finally:
        ctl.go.set()
        ctl.stop.set()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(5)
    result = _result(system.name, w, repeat, produced, consumed, drained,
                     server1 - server0, machine1[0] - machine0[0], machine1[1] - machine0[1])
    result.server_disk_mb_per_s = written / 1e6 / w.duration_s
    return result


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


def _collect(ctl: Control, procs, kind: str, count: int, timeout_s: float, system,
             role: str | None = None) -> dict:
    """Wait for `count` messages of `kind` (from `role`, if given); raise on a worker's error."""
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrialError(f"timed out after {timeout_s:.0f} s waiting for {count - len(got)} "
                             f"{role or 'worker'} {kind} message(s)")
        try:
            msg_kind, msg_role, index, payload = ctl.messages.get(timeout=min(1.0, left))
        except queue.Empty:
            system.check_alive()
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise TrialError(f"worker(s) died: {', '.join(dead)}") from None
            continue
        if msg_kind == "error":
            raise TrialError(f"{system.name} {msg_role} {index} failed:\n{payload}")
        if msg_kind == kind and (role is None or msg_role == role):
            got[(msg_role, index)] = payload
        else:  # a message for a later phase (a fast consumer's result): keep it for then
            ctl.messages.put((msg_kind, msg_role, index, payload))
            time.sleep(0.01)
    return got


def _drain(ctl: Control, consumers: int, expected: int) -> bool:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if sum(ctl.consumed[:consumers]) >= expected:
            return True
        time.sleep(DRAIN_POLL_S)
    return False


def _result(system: str, w: Workload, repeat: int, produced: dict, consumed: dict,
            drained: bool, server_cpu_s: float, machine_busy_s: float,
            machine_total_s: float) -> TrialResult:
    pw = [r["window"] for r in produced.values()]
    cw = [r["window"] for r in consumed.values()]
    producer_rate = sum(x["count"] / x["seconds"] for x in pw if x["seconds"] > 0)
    window_acked = sum(x["count"] for x in pw)
    window_consumed = sum(x["count"] for x in cw)
    producer_cpu = sum(x["cpu_s"] for x in pw)
    consumer_cpu = sum(x["cpu_s"] for x in cw)
    hist = LatencyHistogram()
    for r in consumed.values():
        hist.merge(LatencyHistogram(r["latency_hist"]))
    millions = window_acked / 1e6
    total_cpu = server_cpu_s + producer_cpu + consumer_cpu
    return TrialResult(
        system=system, label=w.label(), repeat=repeat,
        producer_records_per_s=producer_rate,
        producer_mb_per_s=producer_rate * w.record_size_bytes / 1e6,
        consumer_records_per_s=window_consumed / w.duration_s,
        latency_p50_ms=hist.percentile_ms(50), latency_p99_ms=hist.percentile_ms(99),
        cpu_s_per_million=total_cpu / millions if millions else None,
        server_cpu_s_per_million=server_cpu_s / millions if millions else None,
        acked=sum(r["acked"] for r in produced.values()),
        consumed=sum(r["consumed"] for r in consumed.values()),
        failed=sum(r["failed"] for r in produced.values()),
        window_s=w.duration_s, window_acked=window_acked, window_consumed=window_consumed,
        server_cpu_s=server_cpu_s, producer_cpu_s=producer_cpu, consumer_cpu_s=consumer_cpu,
        # /proc/stat ticks and wall time are sampled apart: a fully busy window can read 1+1e-12.
        machine_busy_fraction=min(1.0, machine_busy_s / machine_total_s) if machine_total_s else 0.0,
        other_cpu_s=max(0.0, machine_busy_s - total_cpu),
        drained=drained, latency_hist=hist.to_list(), latency_p999_ms=hist.percentile_ms(99.9))


def median_of(trials: list[TrialResult], metric: str) -> float | None:
    values = [getattr(t, metric) for t in trials if getattr(t, metric) is not None]
    return statistics.median(values) if values else None
