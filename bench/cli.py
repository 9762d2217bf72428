"""`python -m bench` / `kera bench`: run a preset of workloads on kera and Apache Kafka.

    python -m bench --preset quick
    python -m bench --preset streams --where R=3 --set duration_s=3 --repeats 1
    python -m bench --list
    python -m bench --preset throughput --systems kera --baseline main~1   # vs another commit

Writes results/<date>-<preset>/{results.json, results.md, *.png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import importlib.util
import signal
import sys
import threading
import tempfile
import traceback
from pathlib import Path

from . import equal_load, report
from .baseline import SYSTEM as BASELINE, BaselineError, BaselineSystem, prepare
from .ceiling import zmq_ceiling
from .clients import kafka_client
from .progress import make_progress
from .runner import TrialResult
from .kafka_java import java_missing
from .systems import KafkaClusterShare, make_system
from .workload import PRESETS, Workload

log = logging.getLogger(__name__)

SYSTEM_ORDER = ("kera", "kera-curve", "kera-kafka", "kera-kafka-tuned", "kafka", "kafka-tuned",
                "kafka-java", "kafka-java-tuned")
JAVA_SYSTEMS = ("kafka-java", "kafka-java-tuned")   # Kafka's own Java tools
DEFAULT_SYSTEMS = ("kera", "kafka")
# --security: which kera systems run ("both": plaintext and CURVE side by side, alternating).
SECURITY_SYSTEMS = {"off": ("kera",), "curve": ("kera-curve",), "both": ("kera", "kera-curve")}
WARM_UP_S = 2.0   # alternation within each repeat: kera, Kafka, kera, Kafka ...


def run_benchmark(workloads: list[Workload], *, preset: str, description: str, repeats: int,
                  out_dir: Path, systems=DEFAULT_SYSTEMS, ceiling_bytes: int = 0,
                  work_dir: Path | None = None, plots: bool = True, warm_up: bool = True,
                  progress=None, baseline=None, equal_load_fractions=()) -> dict:
    """Run every workload `repeats` times on each system, alternating; write the results.
    With `warm_up`, each freshly started cluster first runs a short unrecorded trial.
    `baseline` (a prepared bench.baseline.BaselineEnv) runs system "kera-baseline".
    `equal_load_fractions`: then run every workload again at these fractions of the slower
    system's maximum just measured (bench.equal_load)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = progress or make_progress(len(workloads) * repeats * len(systems))
    results = {"preset": preset, "description": description,
               "started": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": report.machine_info(), "repeats": repeats, "systems": list(systems),
               "ceiling": {}, "configurations": [], "errors": [], "files": {},
               "baseline": baseline.describe() if baseline else None, "equal_load": None}
    try:
        if ceiling_bytes:
            for chunk in sorted({w.chunk_size_bytes for w in workloads}):
                progress.note(f"raw pyzmq ceiling, {chunk} B frames, {ceiling_bytes >> 20} MiB")
                c = zmq_ceiling(ceiling_bytes, frame_bytes=chunk)
                results["ceiling"][str(chunk)] = c
                progress.note(f"ceiling: {c['bytes_per_s'] / 1e6:,.0f} MB/s")
        if work_dir is not None:
            Path(work_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="kera-bench-", dir=work_dir) as tmp:
            running = make_systems(systems, Path(tmp), baseline, preset, out_dir)
            try:
                _run_all(workloads, repeats, running, results, out_dir, progress, warm_up)
                if equal_load_fractions:
                    _run_equal_load(workloads, equal_load_fractions, repeats, running, results,
                                    out_dir, progress, warm_up)
            finally:
                for system in running.values():
                    system.stop()
        if plots:
            results["files"]["plots"] = [p.name for p in report.write_plots(out_dir, results)]
    finally:
        results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        for config in results["configurations"]:
            if "summary" not in config:   # interrupted (Ctrl-C) mid-configuration
                config["summary"] = report.summarize(config)   # of its trials so far
        results["files"]["json"] = report.write_json(out_dir, results).name
        results["files"]["markdown"] = report.write_markdown(out_dir, results).name
        report.write_json(out_dir, results)
        progress.close()
    return results


def make_systems(systems, work_dir: Path, baseline, preset: str, out_dir: Path) -> dict:
    """{name: system} in alternation order; the baseline is not a cluster here but runs each
    trial with its own bench; the Kafka systems share one cluster."""
    share = KafkaClusterShare()
    return {name: BaselineSystem(baseline, preset, work_dir, out_dir) if name == BASELINE
            else make_system(name, work_dir, share) for name in systems}


def _run_equal_load(workloads, fractions, repeats, running: dict, results: dict,
                    out_dir: Path, progress, warm_up: bool) -> None:
    """The second phase: every contender at `fractions` of the slower maximum of the first
    (not Kafka's Java tools: their percentiles span the whole run, JVM warm-up included, and
    their throttle catches up after it, so they say nothing about latency at a load)."""
    loads, notes = equal_load.plan(results["configurations"][:len(workloads)], workloads,
                                   list(running), fractions)
    results["equal_load"] = notes
    running = {n: s for n, s in running.items() if n not in equal_load.REFERENCE_ONLY}
    for note in notes:
        progress.note(f"equal load for {note['label']}: "
                      + (note.get("skipped") or f"{note['reference_system']} sustained "
                         f"{note['reference_records_per_s']:,.0f} rec/s; running "
                         f"{', '.join(note['labels'])}"))
    progress.add_total(len(loads) * repeats * len(running))
    _run_all(loads, repeats, running, results, out_dir, progress, warm_up)


def _run_all(workloads, repeats, running: dict, results: dict, out_dir: Path,
             progress, warm_up: bool) -> None:
    """Every workload on every system, alternating, `repeats` rounds; topics and streams are
    named by the configuration's index in the run (a later phase never reuses a name)."""
    for w in workloads:
        ci = len(results["configurations"])
        config = {"workload": w.to_dict(), "trials": []}
        for name, system in running.items():
            config[name] = system.settings(w)
        results["configurations"].append(config)
        broken: set[str] = set()
        for repeat in range(repeats):
            for name, system in running.items():
                what = f"{w.label()} {name} #{repeat + 1}"
                progress.trial_started(what)
                if name in broken:
                    progress.trial_done(f"{what}: skipped (failed before)")
                    continue
                try:
                    if system.ensure(w) and warm_up:
                        progress.note(f"{name}: new cluster {system.bootstrap}; warming up")
                        with system.client_env():
                            system.trial(warm_up_workload(w), f"w{ci:02d}-{name}")
                    with system.client_env():
                        trial = system.trial(w, f"t{ci:02d}-{repeat}-{name}", repeat)
                except Exception:  # noqa: BLE001 - recorded; the run goes on
                    err = traceback.format_exc()
                    results["errors"].append({"label": w.label(), "system": name,
                                              "repeat": repeat, "error": err})
                    progress.trial_done(f"{what}: FAILED {err.strip().splitlines()[-1]}")
                    broken.add(name)
                    system.stop()   # a fresh cluster for the next configuration
                    continue
                config["trials"].append(trial.to_dict())
                progress.trial_done(_one_line(what, trial))
        config["summary"] = report.summarize(config)
        report.write_json(out_dir, results)
        report.write_markdown(out_dir, results)


def warm_up_workload(w: Workload) -> Workload:
    """A short unrecorded trial on a freshly started cluster: JIT-compiles Kafka's broker and
    lets its coordinators load (the first idempotent producer waits for them), for both systems
    alike."""
    return w.replace(streams=min(w.streams, 4), warmup_s=0.0, duration_s=WARM_UP_S,
                     rate_records_per_s=0, tags={})


def _one_line(what: str, t: TrialResult) -> str:
    p99 = "-" if t.latency_p99_ms is None else f"{t.latency_p99_ms:.1f}"
    cpu = "-" if t.cpu_s_per_million is None else f"{t.cpu_s_per_million:.1f}"
    ok = "ok" if t.consumed == t.acked and t.drained else f"MISMATCH consumed {t.consumed}"
    return (f"{what}: produce {t.producer_records_per_s:,.0f} rec/s "
            f"({t.producer_mb_per_s:.1f} MB/s), consume {t.consumer_records_per_s:,.0f} rec/s, "
            f"p99 {p99} ms, {cpu} CPU s/Mrec, acked {t.acked:,} {ok}, "
            f"machine busy {t.machine_busy_fraction:.0%}{_disk(t)}")


def _disk(t: TrialResult) -> str:
    mb_s = t.server_disk_mb_per_s
    return "" if mb_s is None else f", servers wrote {mb_s:,.1f} MB/s to disk"


# ---------------------------------------------------------------------- selection

def _parse_value(field: dataclasses.Field, text: str):
    if text.lower() in ("none", "null"):
        return None
    kind = str(field.type)
    if "int" in kind and "float" not in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    return text


def apply_overrides(workloads: list[Workload], pairs: list[str]) -> list[Workload]:
    fields = {f.name: f for f in dataclasses.fields(Workload)}
    changes = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in fields or key in ("name", "tags"):
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(k for k in fields if k not in ('name', 'tags'))}")
        changes[key] = _parse_value(fields[key], value)
    return [w.replace(**changes) for w in workloads]


def select(workloads: list[Workload], pairs: list[str]) -> list[Workload]:
    """Keep workloads whose tag (or field) KEY equals VALUE for every KEY=VALUE."""
    out = []
    for w in workloads:
        keep = True
        for pair in pairs:
            key, _, value = pair.partition("=")
            actual = w.tags.get(key, getattr(w, key, None))
            keep &= str(actual) == value
        if keep:
            out.append(w)
    return out


def default_out_dir(preset: str) -> Path:
    return Path("results") / f"{datetime.datetime.now():%Y-%m-%d-%H%M%S}-{preset}"


# ---------------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="quick", choices=sorted(PRESETS),
                   help="which set of workloads (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="list the presets and their workloads")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of alternating trials (one per system) per configuration "
                        "(default: the preset's)")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="only configurations whose tag or field KEY is VALUE (e.g. R=3); repeat")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a workload field in every configuration (e.g. duration_s=3)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated systems to run, of {', '.join(SYSTEM_ORDER)} "
                        "(default: the preset's, else kera,kafka)")
    p.add_argument("--kafka-java", action="store_true",
                   help="add a reference row measured with Kafka's own Java tools "
                        "(ProducerPerformance, ConsumerPerformance) on the same Kafka cluster "
                        "(system kafka-java; kafka-java-tuned with --kafka-tuned); skipped "
                        "with a message when Java is missing")
    p.add_argument("--kafka-tuned", action="store_true",
                   help="add Kafka with its producer tuned for throughput (system "
                        "kafka-tuned: bigger batch.size, linger.ms, buffer; see bench/README.md)")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default: results/<date>-<preset>)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where cluster data goes (default: the system's temp dir)")
    p.add_argument("--security", default="off", choices=sorted(SECURITY_SYSTEMS),
                   help="kera with CURVE (curve), or plaintext and CURVE side by side in one "
                        "run (both; ratio rows curve/plain); default: %(default)s")
    p.add_argument("--baseline", metavar="REF", default=None,
                   help="also run kera as of git commit REF (branch, tag, sha, e.g. main~1), "
                        "alternating with the working tree's kera, and add a ratio row "
                        "kera/kera@REF; REF is checked out with its own venv (system site "
                        "packages, nothing downloaded) under --baseline-cache, reused by sha; "
                        "its bench must have the flags a trial uses, as 7a24f2f's does "
                        "(default: none)")
    p.add_argument("--baseline-cache", type=Path, default=None, metavar="DIR",
                   help="where baseline checkouts and venvs are kept "
                        "(default: ~/.cache/kera-bench/baseline)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the raw pyzmq ceiling")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--plain", action="store_true", help="plain progress lines even with rich")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   help="log level on stderr (default: %(default)s)")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so every cluster and JVM the run started (even one still
        # starting) is stopped on the way out, instead of the process dying under them.
        signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level=getattr(logging, args.log_level, logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.list:
        for p in PRESETS.values():
            extra = (f", systems {','.join(p.systems)}" if p.systems else "") + (
                f", then equal load at {', '.join(f'{f:.0%}' for f in p.equal_load)}"
                if p.equal_load else "")
            print(f"{p.name}: {p.description} (repeats {p.repeats}{extra})")
            for w in p.workloads:
                print(f"    {w.label():30s} P={w.producers} C={w.consumers} S={w.streams} "
                      f"streamlets={w.streamlets} Q={w.active_groups} R={w.replication} "
                      f"V={w.effective_virtual_logs or 'default'} chunk={w.chunk_size_bytes} "
                      f"window={w.duration_s}s")
        return 0
    preset = PRESETS[args.preset]
    workloads = select(apply_overrides(list(preset.workloads), args.set), args.where)
    if not workloads:
        print(f"no configuration of preset {preset.name!r} matches {args.where}", file=sys.stderr)
        return 2
    try:
        names = args.systems or ",".join(preset.systems or DEFAULT_SYSTEMS)
        systems = choose_systems(with_reference_systems(names, args.kafka_java,
                                                        args.kafka_tuned),
                                 args.security, bool(args.baseline))
        systems = without_java_if_missing(systems, java_missing(), _note)
        missing = confluent_missing(systems)
        if missing:
            raise ValueError(missing)   # at once, not as a Kafka trial's failure minutes later
        baseline = prepare(args.baseline, cache_dir=args.baseline_cache,
                           note=_note) if args.baseline else None
    except (ValueError, BaselineError) as e:
        print(e, file=sys.stderr)
        return 2
    repeats = args.repeats or preset.repeats
    out_dir = args.out or default_out_dir(preset.name)
    progress = make_progress(len(workloads) * repeats * len(systems), plain=args.plain)
    progress.note(f"preset {preset.name}: {len(workloads)} configuration(s) x {repeats} "
                  f"repeat(s) x {', '.join(systems)}; results in {out_dir}")
    results = run_benchmark(workloads, preset=preset.name, description=preset.description,
                            repeats=repeats, out_dir=out_dir, systems=systems,
                            ceiling_bytes=0 if args.no_ceiling else preset.ceiling_bytes,
                            work_dir=args.work_dir, plots=not args.no_plots, progress=progress,
                            baseline=baseline, equal_load_fractions=preset.equal_load)
    print(report.markdown(results))
    print(f"results: {out_dir}/", file=sys.stderr)
    return 1 if results["errors"] else 0


def confluent_missing(systems: list[str], find_spec=importlib.util.find_spec) -> str | None:
    """Why the systems driven by confluent-kafka cannot run here, or None."""
    needing = [s for s in systems if kafka_client(s) and "java" not in s]
    if needing and find_spec("confluent_kafka") is None:
        return (f"{', '.join(needing)} need the confluent-kafka client, which is not installed: "
                f'pip install "kera[bench]"')
    return None


def choose_systems(names: str, security: str, baseline: bool) -> list[str]:
    """The systems of `--systems`, kera expanded by `--security`, and the baseline (`--baseline`)
    right after the working tree's kera systems: kera, [kera-curve,] kera-baseline, kafka."""
    systems = [s.strip() for s in names.split(",") if s.strip()]
    if "kera" in systems and security != "off":
        at = systems.index("kera")
        systems[at:at + 1] = SECURITY_SYSTEMS[security]
    bad = [s for s in systems if s not in SYSTEM_ORDER]
    if bad or not systems:
        raise ValueError(f"--systems: unknown {bad}; choose from {', '.join(SYSTEM_ORDER)}")
    if baseline:
        if "kera" not in systems:
            raise ValueError("--baseline compares the working tree's plaintext kera with REF's: "
                             "keep kera in --systems (and --security off or both)")
        last = max(i for i, s in enumerate(systems) if s.startswith("kera"))
        systems.insert(last + 1, BASELINE)
    return systems


def with_reference_systems(names: str, kafka_java: bool, kafka_tuned: bool) -> str:
    """`--systems` with the systems `--kafka-java` and `--kafka-tuned` add (once each)."""
    systems = [s.strip() for s in names.split(",") if s.strip()]
    extra = (["kafka-tuned"] if kafka_tuned else []) + (["kafka-java"] if kafka_java else []) \
        + (["kafka-java-tuned"] if kafka_java and kafka_tuned else [])
    return ",".join(systems + [s for s in extra if s not in systems])


def without_java_if_missing(systems: list[str], missing: str | None, note) -> list[str]:
    """`systems` without Kafka's Java tools, saying so, when Java is `missing` (a reason)."""
    if not missing or not any(s in JAVA_SYSTEMS for s in systems):
        return systems
    note(f"skipping {', '.join(s for s in systems if s in JAVA_SYSTEMS)}: {missing}")
    kept = [s for s in systems if s not in JAVA_SYSTEMS]
    if not kept:
        raise ValueError(f"nothing to run: {missing}")
    return kept


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="Benchmark kera against Apache Kafka.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except KeyboardInterrupt:
        return 130
