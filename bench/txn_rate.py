"""Transactions per second at R=3 (issue 39): kera's transactional Producer, the same
confluent-kafka transactional producer against kera's Kafka listener and against Apache Kafka.

    python -m bench.txn_rate [--producers P] [--seconds S] [--rounds N] [--systems ...]

One transaction = begin, 100 records of 100 bytes (50 to each of 2 streams / topics, one
streamlet / partition each, R=3), commit; each producer process runs them back to back (closed
loop). The same 100 records are also sent without a transaction, two ways:

* `flush`: send them, then wait for their acknowledgements (flush), back to back: what the
  transaction adds to a unit of 100 records the application waits for;
* `stream`: send them and go on (the producer's buffer bounds what is in flight): the
  non-transactional producer's full rate, what a transaction costs against not waiting.

Systems (rows): `kera` (kera.producer.Producer(transactional_id=...): init_transactions,
begin_transaction, send_batch per stream, commit_transaction), `kera-kafka` (confluent-kafka
against kera's Kafka listener, bench.systems.KeraKafkaSystem) and `kafka` (confluent-kafka
against Kafka 4.1.2, bench.systems.KafkaSystem). Both kera rows run on one kera cluster (1
broker + 2 backups + coordinator, every broker with a Kafka listener); Kafka is 3 brokers with
min.insync.replicas=2; both clusters stay up for the whole run. Producer settings are the
harness's (bench.clients: 16 KiB chunks = batch.size, linger 5 ms, acks=all, idempotence).

Rounds alternate every (system, mode) trial on fresh streams/topics; the table gives medians
over rounds, and the transactional/non-transactional ratios with their lowest and highest
single-round value (one trial of each mode back to back), after one unrecorded warm-up round
(a fresh cluster's first trials are slow). CPU per record: the servers' CPU
(/proc, bench.procstat) over the window plus the producer processes' own, per record acked.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from .clients import kafka_producer_settings, kera_producer_settings, stream_name
from .procstat import machine_cpu_s, processes_cpu_s
from .runner import JOIN_TIMEOUT_S, READY_TIMEOUT_S, RESULT_TIMEOUT_S, START_DELAY_S, _collect
from .systems import make_system
from .workers import Control, WindowSampler, _wait_schedule, payload
from .workload import Workload

RECORDS_PER_TXN = 100          # the transaction: 100 records across 2 streams
STREAMS = 2
MODES = ("txn", "flush", "stream")
SYSTEMS = ("kera", "kera-kafka", "kafka")
FLUSH_TIMEOUT_S = 60.0
KAFKA_TXN_TIMEOUT_S = 30.0     # each confluent-kafka transactional call


@dataclass
class Trial:
    system: str
    mode: str
    round: int
    records: int               # acknowledged (committed) inside the window
    units: int                 # transactions (txn) or 100-record flushes (flush) in the window
    seconds: float
    cpu_s: float               # servers + producer processes, over the window
    busy: float                # the machine's busy fraction over the window

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def cpu_us_per_record(self) -> float | None:
        return self.cpu_s * 1e6 / self.records if self.records else None


# ---------------------------------------------------------------------- producer processes

class KeraClient:
    """kera's own Producer: one transaction (or flushed unit) is a send_batch per stream."""

    def __init__(self, bootstrap: str, names: list[str], w: Workload, mode: str, tid: str):
        from kera.producer import Producer

        self.mode = mode
        self.names = names
        self.p = Producer(bootstrap, **kera_producer_settings(w),
                          transactional_id=tid if mode == "txn" else None)
        if mode == "txn":
            self.p.init_transactions()
        self.done = 0

    def step(self, values) -> None:
        half = len(values) // STREAMS
        if self.mode == "txn":
            self.p.begin_transaction()
        for s, name in enumerate(self.names):
            self.p.send_batch(name, values[s * half:(s + 1) * half])
        if self.mode == "txn":
            self.p.commit_transaction()
        elif self.mode == "flush":
            self.p.flush(FLUSH_TIMEOUT_S)
        self.done += len(values)

    def acked(self) -> int:
        return self.p.stats["records_acked"] if self.mode == "stream" else self.done

    def close(self) -> None:
        self.p.close(timeout=30.0)


class KafkaClient:
    """confluent-kafka's producer (Kafka, or kera's Kafka listener): produce_batch per topic."""

    def __init__(self, bootstrap: str, names: list[str], w: Workload, mode: str, tid: str):
        from confluent_kafka import Producer

        conf = {"bootstrap.servers": bootstrap, **kafka_producer_settings(w)}
        if mode == "txn":
            conf["transactional.id"] = tid
        self.p = Producer(conf)
        if mode == "txn":
            self.p.init_transactions(KAFKA_TXN_TIMEOUT_S)
        self.mode = mode
        self.names = names
        self.size = w.record_size_bytes
        self.produced = 0
        self.done = 0

    def step(self, values) -> None:
        half = len(values) // STREAMS
        blob = values.tobytes()
        if self.mode == "txn":
            self.p.begin_transaction()
        for s, name in enumerate(self.names):
            msgs = [{"value": blob[i * self.size:(i + 1) * self.size]}
                    for i in range(s * half, (s + 1) * half)]
            self._produce(name, msgs)
        if self.mode == "txn":
            self.p.commit_transaction(KAFKA_TXN_TIMEOUT_S)
        elif self.mode == "flush":
            if self.p.flush(FLUSH_TIMEOUT_S):
                raise TimeoutError("Kafka flush left records unacknowledged")
        self.done += len(values)

    def _produce(self, name: str, msgs: list) -> None:
        while True:
            queued = self.p.produce_batch(name, msgs, partition=0)
            self.produced += queued
            if queued == len(msgs):
                break
            msgs = [{"value": m["value"]} for m in msgs if "_error" in m]   # the queue was full
            self.p.poll(0.005)
        self.p.poll(0)

    def acked(self) -> int:
        return self.produced - len(self.p) if self.mode == "stream" else self.done

    def close(self) -> None:
        self.p.flush(30.0)


def producer_main(kind: str, bootstrap: str, names: list[str], w: Workload, mode: str,
                  index: int, tid: str, ctl: Control) -> None:
    """One producer process: `mode` units of RECORDS_PER_TXN records until the window ends."""
    try:
        cls = KeraClient if kind == "kera" else KafkaClient
        client = cls(bootstrap, names, w, mode, tid)
        values = payload(w.replace(chunk_size_bytes=64 * 1024), seed=index)[:RECORDS_PER_TXN]
        ctl.messages.put(("ready", "producer", index, None))
        _, window_start, window_end = _wait_schedule(ctl)
        sampler = WindowSampler(client.acked, window_start, window_end)
        sampler.start()
        while time.time() < window_end:
            client.step(values)
        window = sampler.window()
        client.close()
        ctl.messages.put(("result", "producer", index, window))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the trial
        ctl.messages.put(("error", "producer", index, traceback.format_exc()))


# ---------------------------------------------------------------------- one trial

def window_trial(system, target, args_of, workers: int, warmup_s: float, duration_s: float,
                 edge=None) -> tuple[list[dict], float, float, list]:
    """Spawn `workers` processes running `target(*args_of(i), ctl)`, start them together,
    and measure the window after `warmup_s`: returns (each worker's WindowSampler window,
    the servers' CPU seconds, the machine's busy fraction, `edge()` at the window's start
    and end). Shared by bench.compaction_rate."""
    ctx = mp.get_context("spawn")
    ctl = Control.create(ctx, 0)
    procs = [ctx.Process(target=target, args=(*args_of(i), ctl), name=f"{system.name}-p{i}")
             for i in range(workers)]
    edges = []
    try:
        for p in procs:
            p.start()
        _collect(ctl, procs, "ready", workers, READY_TIMEOUT_S, system)
        start = time.time() + START_DELAY_S
        ctl.times[:] = [start, start + warmup_s, start + warmup_s + duration_s]
        ctl.go.set()
        pids = system.server_pids()
        samples = []
        for t in ctl.times[1:]:
            time.sleep(max(0.0, t - time.time()))
            samples.append((processes_cpu_s(pids), machine_cpu_s()))
            edges.append(edge() if edge else None)
        results = _collect(ctl, procs, "result", workers, RESULT_TIMEOUT_S, system)
    finally:
        ctl.go.set()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
    (s0, (b0, t0)), (s1, (b1, t1)) = samples
    return list(results.values()), s1 - s0, (b1 - b0) / max(t1 - t0, 1e-9), edges


def run_trial(system, kind: str, mode: str, w: Workload, args, rnd: int, prefix: str) -> Trial:
    """One (system, mode) trial on fresh streams `prefix-0000`, `prefix-0001`."""
    system.create(prefix, w)
    try:
        names = [stream_name(prefix, s) for s in range(STREAMS)]
        bootstrap = system.cluster.bootstrap if kind == "kera" else system.bootstrap
        windows, server_cpu, busy, _ = window_trial(
            system, producer_main,
            lambda i: (kind, bootstrap, names, w, mode, i, f"{prefix}-t{i}"),
            args.producers, args.warmup, args.seconds)
    finally:
        system.delete(prefix, w)
    records = sum(x["count"] for x in windows)
    units = records // RECORDS_PER_TXN if mode != "stream" else 0
    cpu = server_cpu + sum(x["cpu_s"] for x in windows)
    return Trial(kind_label(system, kind), mode, rnd, records, units, args.seconds, cpu, busy)


def kind_label(system, kind: str) -> str:
    return "kera" if kind == "kera" else system.name


# ---------------------------------------------------------------------- report

def median(trials: list[Trial], system: str, mode: str, attr: str) -> float | None:
    values = [getattr(t, attr) for t in trials if t.system == system and t.mode == mode]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def round_ratios(trials: list[Trial], system: str, mode: str) -> list[float]:
    """Per round: txn records/s over `mode`'s (one trial of each, back to back)."""
    by = {(t.round, t.mode): t for t in trials if t.system == system}
    return [by[r, "txn"].records_per_s / by[r, mode].records_per_s
            for r in sorted({t.round for t in trials})
            if (r, "txn") in by and (r, mode) in by and by[r, mode].records]


def report(trials: list[Trial], systems: list[str]) -> str:
    lines = ["| system | mode | commits/s | records/s | CPU us/record (all) | machine busy |",
             "|---|---|---:|---:|---:|---:|"]
    for s in systems:
        for m in MODES:
            rps = median(trials, s, m, "records_per_s")
            if rps is None:
                continue
            commits = f"{rps / RECORDS_PER_TXN:,.0f}" if m == "txn" else "-"
            cpu = median(trials, s, m, "cpu_us_per_record")
            lines.append(f"| {s} | {m} | {commits} | {rps:,.0f} | "
                         f"{cpu:.1f} | {median(trials, s, m, 'busy'):.0%} |")
    lines += ["", "| system | txn / flush records/s | txn / stream records/s |", "|---|---|---|"]
    for s in systems:
        cells = []
        for m in ("flush", "stream"):
            r = round_ratios(trials, s, m)
            cells.append(f"{statistics.median(r):.2f}x (rounds {min(r):.2f}-{max(r):.2f}, "
                         f"{len(r)})" if r else "-")
        lines.append(f"| {s} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines + against_kafka(trials, systems))


def against_kafka(trials: list[Trial], systems: list[str]) -> list[str]:
    """Per system, its commits/s over Kafka's in the same round (median, lowest, highest)."""
    if "kafka" not in systems:
        return []
    txn = {(t.system, t.round): t.records_per_s for t in trials if t.mode == "txn"}
    lines = ["", "| system | commits/s against kafka's, same round |", "|---|---|"]
    for s in systems:
        r = [txn[s, rnd] / txn["kafka", rnd] for (name, rnd) in txn
             if name == s and txn.get(("kafka", rnd))]
        if s != "kafka" and r:
            lines.append(f"| {s} | {statistics.median(r):.2f}x (rounds {min(r):.2f}-"
                         f"{max(r):.2f}, {len(r)}) |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--producers", type=int, default=2, help="producer processes (2)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window (5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured start (1)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--modes", default=",".join(MODES), help="txn,flush,stream")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    modes = args.modes.split(",")
    w = Workload("txn", streams=STREAMS, streamlets=1, replication=3)
    print(f"P={args.producers} producer processes per trial, {args.seconds:.0f} s windows, "
          f"R=3, {RECORDS_PER_TXN} records of {w.record_size_bytes} B across {STREAMS} "
          f"streams per transaction, {args.rounds} rounds", flush=True)
    trials = run_rounds(systems, modes, w, args)
    print(report(trials, systems))


def run_rounds(systems: list[str], modes: list[str], w: Workload, args) -> list[Trial]:
    trials = []
    with tempfile.TemporaryDirectory(prefix="kera-txn-rate-") as tmp:
        kera = make_system("kera-kafka", Path(tmp))
        kafka = make_system("kafka", Path(tmp))
        clusters = [s for s, used in ((kera, {"kera", "kera-kafka"} & set(systems)),
                                      (kafka, "kafka" in systems)) if used]
        try:
            for system in clusters:
                system.ensure(w)
            # Round -1 is unrecorded: a fresh cluster's first trials are slow (JIT, Kafka's
            # transaction coordinators loading), as the harness's warm-up trial is.
            for rnd in range(-1, args.rounds):
                for name in systems:
                    system, kind = (kafka, "kafka") if name == "kafka" else \
                        (kera, "kera" if name == "kera" else "kafka")
                    for mode in modes if rnd % 2 == 0 else modes[::-1]:
                        t = run_trial(system, kind, mode, w, args, rnd,
                                      f"txn{rnd + 1}-{name}-{mode}")
                        if rnd >= 0:
                            trials.append(t)
                        print(f"round {rnd} {name:10} {mode:6} {t.records_per_s:>10,.0f} rec/s "
                              f"{t.units / t.seconds:>8,.0f} units/s  busy {t.busy:.0%}",
                              flush=True)
        finally:
            for system in clusters:
                system.stop()
    return trials


if __name__ == "__main__":
    main()
