"""Compaction under an update stream at R=3 (issue 38): kera's compactor against Kafka's log
cleaner on the same machine, side by side.

    python -m bench.compaction_rate [--keys K] [--seconds S] [--rounds N] [--systems ...]

The update stream: P producer processes send keyed 100-byte records, keys drawn from a bounded
space of K (each producer cycles through its own shuffles of all K keys, so every key is
updated at the same rate), to one stream / topic of `--streamlets` streamlets / partitions at
R=3 (16 KiB chunks = batch.size, linger 5 ms, acks=all: the harness's producer settings,
bench.clients). kera: send_batch of one chunk's worth of records per streamlet per call
(placed by key); Kafka: produce_batch of the same records, placed by key (librdkafka's
partitioner). Every trial gets a fresh stream / topic, with compaction `off` (cleanup policy
delete, nothing expires) or `on` (compact), both with the same small segments so segments
close within the window: kera `--segment-mib` segments, `--group-segments` per group (a pass
reads only finished groups); Kafka `segment.bytes` = the same MiB. min.cleanable.dirty.ratio
is 0.5 on both (both defaults). Kafka's `log.cleaner.backoff.ms` is set to 1000 (its default,
15000, would leave the cleaner asleep most of a window; kera's broker looks for a due streamlet
every second).

Loads: `max` (closed loop: as fast as the system takes them), then `half`: each producer
offered half of the median `max` rate of the same system with compaction off (the issue's
"half the R=3 produce rate"). Each round runs, per system, off and on at max, then off and on
at half (the order of off/on alternating between rounds); `--equal-rate N` adds a load
`equal`, every system offered N records/s in all (e.g. the slower system's half rate), off and
on. A fresh cluster first runs one unrecorded trial. The rate loss is 1 - on/off of the
producers' acknowledged records/s, per round.

Measured over the window: acknowledged records/s; bytes compacted per second (kera: the
`bytes_before` of the passes swapped in, from the broker's `stats` op, per stream; Kafka: the
"Start size" of every cleaning its cleaner threads logged, enabled at INFO through the brokers'
dynamic logger config (set with Kafka's own Admin client, a Java source file), summed over the
3 brokers: each Kafka replica cleans its own copy); the compaction threads' CPU (/proc
task stat: kera's `broker-compaction` thread, found by its Python name with `py-spy dump`;
Kafka's `kafka-log-cleaner-thread-*`, by their native names) per MiB compacted; and the
servers' CPU per record. Keep-up: the stream's stored bytes at the window's end against its
live set (kera: the finished segments' bytes, clean + dirty, from `stats`; Kafka: the
partitions' log files on broker 1), and kera's dirty ratio at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .clients import kafka_producer_settings, kera_producer_settings
from .procstat import CLOCK_TICKS_PER_S
from .systems import make_system
from .txn_rate import window_trial
from .workers import Control, WindowSampler, _wait_schedule, payload
from .workload import KiB, MiB, Workload

SYSTEMS = ("kera", "kafka")
KEY_FORMAT = b"k%07d"
FLUSH_TIMEOUT_S = 120.0
DIRTY_RATIO = 0.5                 # min.cleanable.dirty.ratio, both systems' default
KAFKA_CLEANER_BACKOFF_MS = 1000   # kera's COMPACTION_CHECK_S
# Where the cleaner threads log each cleaning's statistics (at INFO; the benchmark brokers
# log WARN and above: bench/kafka/log4j2.properties).
KAFKA_CLEANER_LOGGER = "org.apache.kafka.storage.internals.log.LogCleaner$CleanerThread"
# Run by `java` as a single source file (JEP 330) against the brokers' jars: the cleaner's
# back-off for the whole cluster, then one logger's level on each broker id given.
KAFKA_SETTINGS_JAVA = """
import java.util.*;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.common.config.ConfigResource;

public class KafkaCleanerSettings {
    public static void main(String[] a) throws Exception {
        try (Admin admin = Admin.create(Map.of("bootstrap.servers", a[0]))) {
            Map<ConfigResource, Collection<AlterConfigOp>> m = new HashMap<>();
            m.put(new ConfigResource(ConfigResource.Type.BROKER, ""), List.of(new AlterConfigOp(
                new ConfigEntry("log.cleaner.backoff.ms", a[1]), AlterConfigOp.OpType.SET)));
            for (int i = 3; i < a.length; i++)
                m.put(new ConfigResource(ConfigResource.Type.BROKER_LOGGER, a[i]),
                      List.of(new AlterConfigOp(new ConfigEntry(a[2], "INFO"),
                                                AlterConfigOp.OpType.SET)));
            admin.incrementalAlterConfigs(m).all().get();
        }
    }
}
"""
KAFKA_CLEANER_THREAD = "kafka-log-clean"   # kafka-log-cleaner-thread-N, cut to 15 chars
KERA_COMPACTION_THREAD = "broker-compaction"
CONFIG_TOOL_TIMEOUT_S = 120.0     # the Java settings run: JVM start, compile, one request
PY_SPY_TIMEOUT_S = 30.0


@dataclass
class Trial:
    system: str
    mode: str                     # off | on
    load: str                     # max | half
    round: int
    records: int                  # acknowledged inside the window
    seconds: float
    server_cpu_s: float
    busy: float
    compacted_bytes: int = 0      # before the rewrite, over the window (Kafka: all replicas)
    compacted_after: int = 0
    passes: int = 0
    cleaner_cpu_s: float = 0.0    # the compaction threads (Kafka: all brokers')
    stored_bytes: int | None = None   # at the window's end (module docstring); kera: on only
    dirty_ratio: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def compacted_mib_per_s(self) -> float:
        return self.compacted_bytes / MiB / self.seconds

    @property
    def cleaner_cpu_s_per_mib(self) -> float | None:
        mib = self.compacted_bytes / MiB
        return self.cleaner_cpu_s / mib if mib else None


# ---------------------------------------------------------------------- /proc per thread

def task_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{thread id: (its native name, CPU seconds)} of every thread of process `pid`."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                text = f.read()
        except OSError:
            continue
        comm = text[text.index(b"(") + 1:text.rindex(b")")].decode(errors="replace")
        fields = text[text.rindex(b")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S)
    return out


def py_thread_ids(pid: int, name: str) -> set[int]:
    """Native ids of the Python threads of `pid` called `name` (py-spy dump; empty if none
    or py-spy is missing)."""
    try:
        out = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--json", "--nonblocking"],
                             capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
        threads = json.loads(out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return set()
    return {t.get("os_thread_id") for t in threads
            if t.get("thread_name") == name and t.get("os_thread_id")}


# ---------------------------------------------------------------------- producer processes

class KeraUpdates:
    def __init__(self, bootstrap: str, name: str, w: Workload):
        from kera.producer import Producer
        self.p = Producer(bootstrap, **kera_producer_settings(w))
        self.name = name

    def send(self, values, keys) -> None:
        self.p.send_batch(self.name, values, keys=keys)

    def acked(self) -> int:
        return self.p.stats["records_acked"]

    def close(self) -> None:
        self.p.flush(FLUSH_TIMEOUT_S)
        self.p.close(timeout=30.0)


class KafkaUpdates:
    def __init__(self, bootstrap: str, name: str, w: Workload):
        from confluent_kafka import Producer
        self.p = Producer({"bootstrap.servers": bootstrap, **kafka_producer_settings(w)})
        self.name = name
        self.size = w.record_size_bytes
        self.produced = 0

    def send(self, values, keys) -> None:
        blob, size = values.tobytes(), self.size
        msgs = [{"value": blob[i * size:(i + 1) * size], "key": k}
                for i, k in enumerate(keys.tolist())]
        while True:
            queued = self.p.produce_batch(self.name, msgs)
            self.produced += queued
            if queued == len(msgs):
                break
            msgs = [{"value": m["value"], "key": m["key"]} for m in msgs if "_error" in m]
            self.p.poll(0.005)     # the queue (buffer_bytes) was full
        self.p.poll(0)

    def acked(self) -> int:
        return self.produced - len(self.p)

    def close(self) -> None:
        if self.p.flush(FLUSH_TIMEOUT_S):
            raise TimeoutError("Kafka flush left records unacknowledged")


class KeyCycle:
    """Keys of the update stream: shuffles of all `keys` keys back to back."""

    def __init__(self, keys: int, seed: int):
        self.pool = np.array([KEY_FORMAT % i for i in range(keys)], dtype=f"S{len(KEY_FORMAT % 0)}")
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(self.pool)
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        if self.at + n > len(self.order):
            self.order = self.rng.permutation(self.pool)
            self.at = 0
        self.at += n
        return self.order[self.at - n:self.at]


def updates_main(kind: str, bootstrap: str, name: str, w: Workload, keys: int, unit: int,
                 index: int, ctl: Control) -> None:
    """One producer process: `unit` keyed records per call until the window ends, at
    w.rate_records_per_s (0: as fast as acknowledged)."""
    try:
        client = (KeraUpdates if kind == "kera" else KafkaUpdates)(bootstrap, name, w)
        values = payload(w.replace(chunk_size_bytes=unit * (w.record_size_bytes + 16)),
                         seed=index)[:unit]
        cycle = KeyCycle(keys, seed=index)
        ctl.messages.put(("ready", "producer", index, None))
        start, window_start, window_end = _wait_schedule(ctl)
        sampler = WindowSampler(client.acked, window_start, window_end)
        sampler.start()
        interval_s = unit / w.rate_records_per_s if w.rate_records_per_s else 0.0
        k = 0
        while (now := time.time()) < window_end:
            if interval_s and start + k * interval_s > now:
                time.sleep(min(start + k * interval_s - now, window_end - now))
                continue
            client.send(values, cycle.take(unit))
            k += 1
        window = sampler.window()
        client.close()
        ctl.messages.put(("result", "producer", index, window))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the trial
        ctl.messages.put(("error", "producer", index, traceback.format_exc()))


# ---------------------------------------------------------------------- kera's side

class KeraSide:
    """kera's cluster (bench.systems.KeraSystem, 1 broker + 2 backups) and its compactor."""

    kind = "kera"

    def __init__(self, work_dir: Path, args):
        self.system = make_system("kera", work_dir)
        self.args = args
        self.broker_pid = None
        self.thread_ids: set[int] = set()

    def start(self, w: Workload) -> None:
        self.system.ensure(w)
        self.broker_pid = next(d.pid for d in self.system.cluster.daemons
                               if d.kind == "broker")

    def admin(self):
        return self.system.cluster.admin(timeout_s=60.0)

    def create(self, name: str, on: bool) -> None:
        a = self.args
        extra = {"cleanup_policy": "compact",
                 "min_cleanable_dirty_ratio": DIRTY_RATIO} if on else {}
        with self.admin() as admin:
            admin.create_stream(name, streamlets=a.streamlets, active_groups=1, replication=3,
                                segment_size_bytes=a.segment_mib * MiB,
                                group_segments=a.group_segments, **extra)

    def delete(self, name: str) -> None:
        with self.admin() as admin:
            admin.delete_stream(name)

    def edge(self, name: str) -> dict:
        """What the window's edges sample: the stream's compaction counters, every broker
        thread's CPU."""
        with self.admin() as admin:
            stats = admin.stats()["brokers"]
        row = {}
        for s in stats.values():
            row = (s.get("compaction_streams") or {}).get(name) or row
        return {"row": row, "tasks": task_cpu(self.broker_pid)}

    def fill(self, t: Trial, name: str, edges: list) -> None:
        (a, b) = edges
        ra, rb = a["row"], b["row"]
        t.compacted_bytes = rb.get("bytes_before", 0) - ra.get("bytes_before", 0)
        t.compacted_after = rb.get("bytes_after", 0) - ra.get("bytes_after", 0)
        t.passes = rb.get("passes", 0) - ra.get("passes", 0)
        if rb:   # only a compacted stream has a row
            t.stored_bytes = rb.get("clean_bytes", 0) + rb.get("dirty_bytes", 0)
        t.dirty_ratio = rb.get("dirty_ratio")
        t.extra = {"build_seconds": rb.get("seconds", 0.0) - ra.get("seconds", 0.0)}
        if t.passes and not self.thread_ids:
            self.thread_ids = py_thread_ids(self.broker_pid, KERA_COMPACTION_THREAD)
        t.cleaner_cpu_s = sum(b["tasks"].get(tid, ("", 0.0))[1] - a["tasks"].get(tid, ("", 0.0))[1]
                              for tid in self.thread_ids)

    def stop(self) -> None:
        self.system.stop()


# ---------------------------------------------------------------------- Kafka's side

CLEANED = re.compile(r"Start size: ([\d,.]+) MB \(([\d,]+) messages\)\s+End size: ([\d,.]+) MB")


class KafkaSide:
    """Kafka's cluster (bench.systems.KafkaSystem, 3 brokers) and its log cleaners."""

    kind = "kafka"

    def __init__(self, work_dir: Path, args):
        self.system = make_system("kafka", work_dir)
        self.args = args

    def start(self, w: Workload) -> None:
        if self.system.ensure(w):
            self._configure()

    def _configure(self) -> None:
        """The cleaner's back-off (cluster-wide) and its statistics' logger at INFO on every
        broker, with Kafka's own Admin client: confluent-kafka cannot alter broker loggers,
        and ConfigCommand refuses the logger's name (a '$')."""
        from .kafka.cluster import JVM_TOOL_OPTS, _java
        c = self.system.cluster
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "KafkaCleanerSettings.java"
            source.write_text(KAFKA_SETTINGS_JAVA)
            cmd = [_java(), *JVM_TOOL_OPTS, "-cp", str(c.lib_dir / "*"), str(source),
                   c.bootstrap, str(KAFKA_CLEANER_BACKOFF_MS), KAFKA_CLEANER_LOGGER,
                   *(str(n.node_id) for n in c.nodes)]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 timeout=CONFIG_TOOL_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"setting Kafka's cleaner up failed: {out.stderr[-2000:]}")

    def create(self, name: str, on: bool) -> None:
        config = {"segment.bytes": self.args.segment_mib * MiB,
                  "min.cleanable.dirty.ratio": DIRTY_RATIO}
        if on:
            config["cleanup.policy"] = "compact"
        self.system.cluster.create_topic(name, self.args.streamlets, replication=3,
                                         min_insync=2, config=config)

    def delete(self, name: str) -> None:
        self.system.cluster.delete_topics([name])

    def edge(self, name: str) -> dict:
        nodes = self.system.cluster.nodes
        return {"logs": [_size(n.server_log_path) for n in nodes],
                "tasks": [task_cpu(n.process.pid) for n in nodes],
                "stored": sum(_size(p) for d in nodes[0].data_dir.glob(f"{name}-*")
                              for p in d.glob("*.log"))}

    def fill(self, t: Trial, name: str, edges: list) -> None:
        a, b = edges
        before = after = passes = 0
        for node, start, end in zip(self.system.cluster.nodes, a["logs"], b["logs"]):
            text = _read(node.server_log_path, start, end)
            for m in CLEANED.finditer(text):
                before += _mb(m.group(1))
                after += _mb(m.group(3))
                passes += 1
        t.compacted_bytes, t.compacted_after, t.passes = before, after, passes
        t.cleaner_cpu_s = sum(_named_cpu(tb, KAFKA_CLEANER_THREAD)
                              - _named_cpu(ta, KAFKA_CLEANER_THREAD)
                              for ta, tb in zip(a["tasks"], b["tasks"]))
        t.stored_bytes = b["stored"]

    def stop(self) -> None:
        self.system.stop()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read(path: Path, start: int, end: int) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(max(0, end - start)).decode(errors="replace")


def _mb(text: str) -> int:
    """Kafka's cleaner stats print MB as 1024 * 1024 bytes, one decimal."""
    return int(float(text.replace(",", "")) * MiB)


def _named_cpu(tasks: dict, prefix: str) -> float:
    return sum(cpu for comm, cpu in tasks.values() if comm.startswith(prefix))


# ---------------------------------------------------------------------- trials

def run_trial(side, mode: str, load: str, rate_per_producer: int, w: Workload, args,
              rnd: int) -> Trial:
    """One trial on a fresh stream / topic: the update stream with compaction `mode`."""
    name = f"cmp{rnd + 1}-{side.kind}-{mode}-{load}"
    side.create(name, mode == "on")
    try:
        bootstrap = side.system.cluster.bootstrap
        unit = w.records_per_chunk * args.streamlets     # a chunk's worth per streamlet
        wr = w.replace(rate_records_per_s=rate_per_producer)
        windows, server_cpu, busy, edges = window_trial(
            side.system, updates_main,
            lambda i: (side.kind, bootstrap, name, wr, args.keys, unit, i),
            args.producers, args.warmup, args.seconds, edge=lambda: side.edge(name))
        t = Trial(side.kind, mode, load, rnd, sum(x["count"] for x in windows), args.seconds,
                  server_cpu, busy)
        side.fill(t, name, edges)
        return t
    finally:
        side.delete(name)


def half_rate(trials: list[Trial], system: str, producers: int) -> int:
    """Per producer: half the median max rate of `system` with compaction off so far."""
    rates = [t.records_per_s for t in trials
             if t.system == system and t.mode == "off" and t.load == "max"]
    return max(1, int(statistics.median(rates) / 2 / producers))


def run_rounds(sides: list, w: Workload, args) -> list[Trial]:
    trials: list[Trial] = []
    for side in sides:
        side.start(w)
        # Unrecorded: a fresh cluster's first trial is slow (JIT, first connections).
        run_trial(side, "off", "warmup", 0, w, args, -1)
    for rnd in range(args.rounds):
        modes = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        for side in sides:
            for load in loads(args):
                rate = {"max": 0, "equal": args.equal_rate // args.producers}.get(load) \
                    if load != "half" else half_rate(trials, side.kind, args.producers)
                for mode in modes:
                    t = run_trial(side, mode, load, rate, w, args, rnd)
                    t.extra["offered_per_producer"] = rate
                    trials.append(t)
                    print(progress_line(t), flush=True)
    return trials


def loads(args) -> tuple:
    return ("max", "half", "equal") if args.equal_rate else ("max", "half")


def progress_line(t: Trial) -> str:
    return (f"round {t.round} {t.system:5} {t.load:4} {t.mode:3} {t.records_per_s:>10,.0f} rec/s"
            f"  compacted {t.compacted_mib_per_s:6.1f} MiB/s ({t.passes} passes)"
            f"  cleaner CPU {t.cleaner_cpu_s:5.2f} s  server CPU {t.server_cpu_s:5.1f} s"
            f"  stored {_fmt(_mib(t.stored_bytes), '.1f')} MiB  busy {t.busy:.0%}")


# ---------------------------------------------------------------------- report

def _med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(trials: list[Trial], systems: list[str], args) -> str:
    lines = ["| system | load | compaction | producer rec/s | compacted MiB/s | after/before "
             "| passes | compaction thread CPU s/MiB | server CPU us/rec | stored MiB at end "
             "| machine busy |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in systems:
        for load in loads(args):
            for mode in ("off", "on"):
                ts = [t for t in trials if (t.system, t.load, t.mode) == (s, load, mode)]
                if ts:
                    lines.append(_row(s, load, mode, ts))
    lines += ["", "| system | load | rate loss with compaction on (rounds) | incremental server "
              "CPU s per MiB compacted (on - off) |", "|---|---|---|---|"]
    for s in systems:
        for load in loads(args):
            lines.append(_loss_row(trials, s, load))
    return "\n".join(lines)


def _row(s: str, load: str, mode: str, ts: list[Trial]) -> str:
    cmp_ = _med(t.compacted_mib_per_s for t in ts)
    ratio = _med(t.compacted_after / t.compacted_bytes if t.compacted_bytes else None for t in ts)
    per_rec = _med(t.server_cpu_s * 1e6 / t.records if t.records else None for t in ts)
    return (f"| {s} | {load} | {mode} | {_med(t.records_per_s for t in ts):,.0f} | "
            f"{cmp_:.1f} | {_fmt(ratio, '.2f')} | {_med(t.passes for t in ts):.0f} | "
            f"{_fmt(_med(t.cleaner_cpu_s_per_mib for t in ts), '.3f')} | {_fmt(per_rec, '.2f')} | "
            f"{_fmt(_med(_mib(t.stored_bytes) for t in ts), '.1f')} | "
            f"{_med(t.busy for t in ts):.0%} |")


def _mib(n: int | None) -> float | None:
    return None if n is None else n / MiB


def _loss_row(trials: list[Trial], s: str, load: str) -> str:
    by = {(t.round, t.mode): t for t in trials if (t.system, t.load) == (s, load)}
    rounds = sorted({r for r, _ in by if (r, "on") in by and (r, "off") in by})
    losses = [1 - by[r, "on"].records_per_s / by[r, "off"].records_per_s for r in rounds]
    extra = [(by[r, "on"].server_cpu_s - by[r, "off"].server_cpu_s)
             / (by[r, "on"].compacted_bytes / MiB)
             for r in rounds if by[r, "on"].compacted_bytes]
    loss = (f"{statistics.median(losses):.1%} ({min(losses):.1%} to {max(losses):.1%}, "
            f"{len(losses)})" if losses else "-")
    cpu = f"{statistics.median(extra):.3f} ({min(extra):.3f} to {max(extra):.3f})" if extra else "-"
    return f"| {s} | {load} | {loss} | {cpu} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--producers", type=int, default=2, help="producer processes (2)")
    parser.add_argument("--streamlets", type=int, default=8, help="streamlets = partitions (8)")
    parser.add_argument("--keys", type=int, default=100_000, help="key space (100,000)")
    parser.add_argument("--segment-mib", type=int, default=1, help="segment MiB, both (1)")
    parser.add_argument("--group-segments", type=int, default=2, help="kera segments per group (2)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window (15)")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured start (5)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--equal-rate", type=int, default=0,
                        help="also run every system at this offered total records/s, off and "
                             "on (load 'equal'; 0: not)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="kera,kafka")
    parser.add_argument("--json", type=Path, help="also write every trial here")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    w = Workload("compaction", streams=1, streamlets=args.streamlets, replication=3,
                 chunk_size_bytes=16 * KiB)
    print(f"R=3, 1 stream of {args.streamlets} streamlets, {args.keys:,} keys, 100-byte values, "
          f"P={args.producers}, {args.segment_mib} MiB segments (kera: {args.group_segments} "
          f"per group), {args.warmup:.0f}+{args.seconds:.0f} s trials, {args.rounds} rounds",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="kera-compaction-rate-") as tmp:
        sides = [(KeraSide if s == "kera" else KafkaSide)(Path(tmp), args) for s in systems]
        try:
            trials = run_rounds(sides, w, args)
        finally:
            for side in sides:
                side.stop()
    if args.json:
        args.json.write_text(json.dumps([t.__dict__ for t in trials], indent=1, default=str))
    print(report(trials, systems, args))


if __name__ == "__main__":
    main()
