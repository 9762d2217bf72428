"""Results: one JSON with every setting and trial, a markdown table, PNG plots (kera vs Kafka).

Each configuration's numbers are the medians over its alternating trials, and the ratio is
kera / Kafka of those medians (for latency and CPU, lower is better: a ratio below 1 favours
kera there). With `--baseline REF` the table also has kera@REF (system "kera-baseline") and a
ratio row kera / kera@REF (`baseline_ratios`): below 1 for latency and CPU, above 1 for
records/s, means the working tree improved on REF. Each ratio row also gives the lowest and
highest ratio of single rounds (a round: one trial of each system, run back to back) for
records/s and CPU, so a reader sees how far one round strays from the median on a shared machine.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .runner import METRICS, TrialResult, median_of

# kera-curve: `--security` (CURVE on); kera-baseline: `--baseline REF` (kera as of REF);
# kafka-tuned: the Python client tuned for throughput; kafka-java(-tuned): Kafka's own Java tools;
# kera-kafka(-tuned): kera through its Kafka listener, driven by kafka's (kafka-tuned's) clients
SYSTEMS = ("kera", "kera-curve", "kera-baseline", "kera-kafka", "kera-kafka-tuned", "kafka",
           "kafka-tuned", "kafka-java", "kafka-java-tuned")
JAVA_SYSTEMS = ("kafka-java", "kafka-java-tuned")
RATE_METRICS = ("producer_records_per_s", "producer_mb_per_s", "consumer_records_per_s")
JAVA_MARK = "†"   # rows from Kafka's Java tools: latency is producer send-to-ack
LOG_SCALE_SPAN = 30.0   # bar heights spanning more than this factor get a log axis
PLOTS = {  # file: (title, metric, y label)
    "producer_throughput.png": ("Acknowledged producer throughput", "producer_records_per_s",
                                "records/s"),
    "consumer_throughput.png": ("Consumer throughput", "consumer_records_per_s", "records/s"),
    "latency_p99.png": ("End-to-end latency p99 (send to receipt)", "latency_p99_ms", "ms"),
    "latency_p50.png": ("End-to-end latency p50 (send to receipt)", "latency_p50_ms", "ms"),
    "cpu_per_million.png": ("CPU per million records (servers + clients)", "cpu_s_per_million",
                            "CPU seconds / 1M records"),
}


# Each ratio row, in table order: its key in a summary, the two systems it compares, whether it
# compares rates only (Kafka's Java tools: their latency is not end to end and their client CPU
# includes JVM start-up), and its label ({baseline}: the baseline's label, `system_label`).
RATIO_PAIRS = {"ratios": ("kera", "kafka", False, "kera/Kafka"),
               "tuned_ratios": ("kera", "kafka-tuned", False, "kera/kafka-tuned"),
               "java_ratios": ("kera", "kafka-java", True, "kera/kafka-java (rates)"),
               "curve_ratios": ("kera-curve", "kera", False, "CURVE/plaintext"),
               "kera_kafka_ratios": ("kera-kafka", "kafka", False, "kera-kafka/Kafka"),
               "kera_kafka_tuned_ratios": ("kera-kafka-tuned", "kafka-tuned", False,
                                           "kera-kafka-tuned/kafka-tuned"),
               "baseline_ratios": ("kera", "kera-baseline", False, "kera/{baseline}")}
# The metrics whose round-by-round ratios a ratio row also gives as a range (the spread a
# reader needs to judge a median ratio on a shared 2-core machine: runs differ by 10-25%).
SPREAD_METRICS = ("producer_records_per_s", "cpu_s_per_million")


def summarize(config: dict) -> dict:
    """Medians per system, the ratio rows' ratios of medians and the spread of each ratio over
    the rounds (`ratio_spreads`), for one configuration's trials."""
    trials = [TrialResult(**t) for t in config["trials"]]
    medians = {s: {m: median_of([t for t in trials if t.system == s], m) for m in METRICS}
               for s in SYSTEMS}
    ran = [s for s in SYSTEMS if any(t.system == s for t in trials)]
    integrity = {s: all(t.drained and t.consumed == t.acked and t.failed == 0
                        for t in trials if t.system == s) for s in ran}
    summary = {"medians": medians}
    for key, (a, b, rates_only, _label) in RATIO_PAIRS.items():
        summary[key] = _ratios(medians[a], medians[b], rates_only)
    summary["ratio_spreads"] = {key: paired_spread(trials, a, b, rates_only)
                                for key, (a, b, rates_only, _label) in RATIO_PAIRS.items()}
    summary.update({"integrity_ok": integrity,
                    "trials_per_system": {s: sum(t.system == s for t in trials) for s in SYSTEMS},
                    "machine_busy_fraction": median_of(trials, "machine_busy_fraction"),
                    "other_cpu_s": median_of(trials, "other_cpu_s")})
    return summary


def _ratios(a: dict, b: dict, rates_only: bool = False) -> dict:
    return {m: a[m] / b[m] if a[m] is not None and b[m] and (m in RATE_METRICS or not rates_only)
            else None for m in METRICS}


def paired_spread(trials: list[TrialResult], a: str, b: str, rates_only: bool = False) -> dict:
    """For each SPREAD_METRICS metric: [lowest, highest, rounds] of a/b over the rounds where
    both systems have a trial of the same repeat (trials alternate, so a round's two trials
    ran side by side); none for a metric with fewer than two such rounds."""
    by_repeat = {(t.system, t.repeat): t for t in trials}
    spread = {}
    for m in SPREAD_METRICS:
        if rates_only and m not in RATE_METRICS:
            continue
        pairs = [(getattr(t, m), getattr(by_repeat[(b, t.repeat)], m))
                 for t in trials if t.system == a and (b, t.repeat) in by_repeat]
        ratios = [x / y for x, y in pairs if x is not None and y]
        if len(ratios) >= 2:
            spread[m] = [min(ratios), max(ratios), len(ratios)]
    return spread


def machine_info() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average": os.getloadavg(),
            "versions": versions()}


def versions() -> dict:
    """kera's version and git commit (when run from a checkout), confluent-kafka's, Kafka's."""
    import importlib.metadata
    import subprocess

    out = {"kafka": "4.1.2"}
    for dist in ("kera", "confluent-kafka", "pyzmq"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["kera_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
            capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["kera_commit"] = None
    return out


def write_json(out_dir: Path, results: dict) -> Path:
    path = out_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str))
    tmp.replace(path)
    return path


def _fmt(v, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and digits == 0 and abs(v) >= 100:
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v:,.{max(digits, 2)}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ratio_row(label: str, what: str, r: dict, note: str) -> str:
    return (f"| {label} | **{what}** | **{_ratio(r['producer_records_per_s'])}** | | "
            f"**{_ratio(r['consumer_records_per_s'])}** | {_ratio(r['latency_p50_ms'])} | "
            f"{_ratio(r['latency_p99_ms'])} | {_ratio(r['cpu_s_per_million'])} | "
            f"{_ratio(r['server_cpu_s_per_million'])} | | {note} |")


def system_label(results: dict, system: str) -> str:
    """How a system is named in tables and plots: the baseline by its commit."""
    if system == "kera-baseline":
        return f"kera@{((results.get('baseline') or {}).get('short')) or 'baseline'}"
    if system in JAVA_SYSTEMS:
        return f"{system} {JAVA_MARK}"
    return system


def _config_rows(results: dict, config: dict, ceil: dict) -> list[str]:
    """One row per system that ran, then the ratio rows that have numbers."""
    s = config["summary"]
    label = config["workload"]["label"]
    ceiling = (ceil.get(str(config["workload"]["chunk_size_bytes"])) or {}).get("bytes_per_s")
    lines = []
    for system in SYSTEMS:
        m = s["medians"].get(system)
        if not (s["trials_per_system"].get(system) and m):   # older results lack new systems
            continue
        frac = "-"
        if ceiling and m["producer_mb_per_s"] is not None:
            frac = f"{m['producer_mb_per_s'] * 1e6 / ceiling:.1%}"
        lines.append(
            f"| {label} | {system_label(results, system)} | "
            f"{_fmt(m['producer_records_per_s'])} | "
            f"{_fmt(m['producer_mb_per_s'], 1)} | {_fmt(m['consumer_records_per_s'])} | "
            f"{_fmt(m['latency_p50_ms'], 1)} | {_fmt(m['latency_p99_ms'], 1)} | "
            f"{_fmt(m['cpu_s_per_million'], 2)} | {_fmt(m['server_cpu_s_per_million'], 2)} | "
            f"{frac} | {'yes' if s['integrity_ok'][system] else 'NO'} |")
    busy = f"busy {(s['machine_busy_fraction'] or 0):.0%}, other {(s['other_cpu_s'] or 0):.1f} s"
    spreads = s.get("ratio_spreads") or {}     # results written before spreads have none
    baseline = system_label(results, "kera-baseline")
    for key, (_a, _b, _rates_only, what) in RATIO_PAIRS.items():
        ratios = s.get(key) or {}
        if any(v is not None for v in ratios.values()):
            note = "; ".join(filter(None, [spread_note(spreads.get(key) or {}), busy]))
            lines.append(_ratio_row(label, what.format(baseline=baseline), ratios, note))
    return lines


def spread_note(spread: dict) -> str:
    """"rounds 1.58-2.43x rec/s, 0.50-0.60x CPU (3)": the lowest and highest ratio of the
    rounds (paired_spread); empty without two rounds."""
    names = {"producer_records_per_s": "rec/s", "cpu_s_per_million": "CPU"}
    parts = [f"{lo:.2f}-{hi:.2f}x {names[m]}" for m, (lo, hi, _n) in spread.items()]
    if not parts:
        return ""
    rounds = max(n for _lo, _hi, n in spread.values())
    return f"rounds {', '.join(parts)} ({rounds})"


def _baseline_note(results: dict) -> list[str]:
    b = results.get("baseline")
    if not b:
        return []
    return [f"Baseline kera@{b['short']} (`--baseline {b['ref']}`, commit {b['sha']}): its own "
            f"bench from {b['checkout']} run with {b['python']} (kera imported from "
            f"{b['imports'].get('kera_file')}), one trial per round, each on a cluster it "
            "starts and warms up itself; ratios kera/kera@REF are the working tree over "
            "the baseline.", ""]


def markdown(results: dict) -> str:
    lines = [f"# kera vs Apache Kafka — preset `{results['preset']}`", "",
             f"{results['description']}", "",
             f"Started {results['started']}, {results['machine']['cpus']} CPUs, load average at "
             f"start {', '.join(f'{x:.1f}' for x in results['machine']['load_average'])}. "
             "The machine is shared: `busy` is the whole machine's CPU use during the measured "
             "windows (of all cores), `other` the CPU seconds used by processes outside the "
             "system and its clients. Numbers are medians over alternating trials "
             "(kera, Kafka, kera, Kafka, ...); ratios are kera / Kafka.", ""]
    v = results["machine"].get("versions") or {}
    if v:
        lines += [f"kera {v.get('kera')} (commit {v.get('kera_commit') or '?'}), Apache Kafka "
                  f"{v.get('kafka')}, confluent-kafka {v.get('confluent-kafka')}, pyzmq "
                  f"{v.get('pyzmq')}, Python {results['machine']['python']}.", ""]
    lines += _baseline_note(results)
    ceil = results.get("ceiling") or {}
    if ceil:
        lines += ["Raw pyzmq ROUTER/DEALER ceiling (same bytes, no work; measured in this run): " +
                  "; ".join(f"{int(k) // 1024} KiB frames {v['bytes_per_s'] / 1e6:,.0f} MB/s"
                            for k, v in sorted(ceil.items(), key=lambda kv: int(kv[0]))), ""]
    lines += ["| configuration | system | producer rec/s | producer MB/s | consumer rec/s | "
              "p50 ms | p99 ms | CPU s/Mrec | server CPU s/Mrec | of ceiling | acked = consumed |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for config in results["configurations"]:
        lines += _config_rows(results, config, ceil)
    lines += _java_note(results) + equal_load_table(results)
    lines += ["", "## Settings", "",
              "Every configuration's workload, kera and Kafka settings are in `results.json` "
              "(`configurations[].workload`, `.kera`, `.kafka`). Layout of R copies: kera runs "
              "1 broker + R-1 backups (+ coordinator); Kafka runs R brokers, replication factor "
              "R, acks=all, min.insync.replicas=2 when R >= 3. Both clusters of a configuration "
              "stay up while the other system's trial runs.", ""]
    for config in results["configurations"]:
        w = config["workload"]
        lines.append(f"- **{w['label']}**: P={w['producers']} C={w['consumers']} S={w['streams']} "
                     f"streamlets={w['streamlets']} Q={w['active_groups']} R={w['replication']} "
                     f"V={w['effective_virtual_logs'] or 'default'} chunk={w['chunk_size_bytes']} B "
                     f"({w['records_per_chunk']} records) linger={w['linger_ms']} ms "
                     f"record={w['record_size_bytes']} B warm-up={w['warmup_s']} s "
                     f"window={w['duration_s']} s rate={w['rate_records_per_s'] or 'max'} "
                     f"buffer={w['producer_buffer_bytes'] // 1024} KiB")
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e['label']} {e['system']}: "
                                          f"{e['error'].strip().splitlines()[-1]}"
                                          for e in results["errors"]]
    return "\n".join(lines) + "\n"


def _ran(config: dict, system: str) -> bool:
    return bool(config["summary"]["trials_per_system"].get(system))


def _java_note(results: dict) -> list[str]:
    if not any(_ran(c, s) for c in results["configurations"] for s in JAVA_SYSTEMS):
        return []
    return ["", f"{JAVA_MARK} Kafka's own Java client, measured with its tools "
            "`ProducerPerformance` and `ConsumerPerformance` (kafka-tools 4.1.2) on the same "
            "Kafka cluster: the Kafka server's capacity apart from the Python client. Its p50 "
            "/ p99 are the producer's send-to-acknowledgement latency, not end to end; consumer "
            "rec/s is ConsumerPerformance's fetch.nMsg.sec; CPU includes the tool JVMs' start-up. "
            "Its ratio row compares rates only."]


def _latency_kind(config: dict, system: str) -> str:
    kinds = {t.get("latency_kind") for t in config["trials"] if t["system"] == system}
    return "send → ack" if "producer ack" in kinds else "send → receipt"


def _equal_load_rows(results: dict, config: dict) -> list[str]:
    w = config["workload"]
    offered = w["rate_records_per_s"] * w["producers"]
    rows = []
    for system in SYSTEMS:
        m = config["summary"]["medians"].get(system)
        if not (_ran(config, system) and m):
            continue
        rows.append(f"| {w['tags'].get('load', w['label'])} | {offered:,} | "
                    f"{system_label(results, system)} | {_fmt(m['producer_records_per_s'])} | "
                    f"{_fmt(m['consumer_records_per_s'])} | {_fmt(m['latency_p50_ms'], 1)} | "
                    f"{_fmt(m['latency_p99_ms'], 1)} | {_fmt(m.get('latency_p999_ms'), 1)} | "
                    f"{_latency_kind(config, system)} |")
    return rows


def equal_load_table(results: dict) -> list[str]:
    """The equal-load phase: latency percentiles per load and system (bench.equal_load)."""
    notes = [n for n in (results.get("equal_load") or []) if "labels" in n]
    if not notes:
        return []
    lines = ["", "## Latency at equal offered load", ""]
    for note in notes:
        lines += [f"**{note['label']}**: loads are fractions of "
                  f"{note['reference_records_per_s']:,.0f} records/s, the sustainable maximum "
                  f"of the slower system ({system_label(results, note['reference_system'])}: "
                  "the smaller of its acknowledged and consumed rates at full speed), offered "
                  "alike to every system, split over its producers.", "",
                  "| load | offered rec/s | system | produced rec/s | consumed rec/s | p50 ms | "
                  "p99 ms | p99.9 ms | latency |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
        for config in results["configurations"]:
            if config["workload"]["label"] in note["labels"] and "summary" in config:
                lines += _equal_load_rows(results, config)
        lines.append("")
    return lines


def write_markdown(out_dir: Path, results: dict) -> Path:
    path = out_dir / "results.md"
    path.write_text(markdown(results))
    return path


PLOT_COLORS = {"kera": "#1f77b4", "kera-baseline": "#9ecae1", "kera-kafka": "#2ca02c",
               "kera-kafka-tuned": "#98df8a", "kafka": "#ff7f0e", "kafka-tuned": "#d62728",
               "kafka-java": "#8c564b", "kafka-java-tuned": "#e377c2"}


def _plot_systems(results: dict) -> list[str]:
    """The systems drawn: kera, the baseline when it ran, Kafka when it ran."""
    ran = {s for c in results["configurations"] for s, n in
           c["summary"]["trials_per_system"].items() if n}
    return [s for s in PLOT_COLORS if s == "kera" or s in ran]


def _plot_against(results: dict, systems: list[str]) -> tuple[str, str]:
    """The ratio written above each configuration: kera/Kafka, or kera/baseline without Kafka
    (as named in the title, and the summary key holding it)."""
    if "kafka" in systems or "kera-baseline" not in systems:
        return "Kafka", "ratios"
    return system_label(results, "kera-baseline"), "baseline_ratios"


def write_plots(out_dir: Path, results: dict) -> list[Path]:
    """One grouped bar chart per metric: kera (the baseline) and Kafka per configuration, a
    ratio on top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = results["configurations"]
    if not configs:
        return []
    paths = [p for p in [write_equal_load_plot(out_dir, results, plt)] if p]
    for filename, (title, metric, ylabel) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(configs) + 2), 4.2))
        against = _draw_bars(ax, results, metric, ylabel)   # kera/Kafka or kera/kera@REF
        ax.set_title(f"{title} — preset {results['preset']} (ratio kera/{against})", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _draw_bars(ax, results: dict, metric: str, ylabel: str) -> str:
    """Bars of every plotted system, ratio labels, axes; returns what kera is compared with."""
    configs = results["configurations"]
    systems = _plot_systems(results)
    width = 0.8 / len(systems)
    xs = range(len(configs))
    values = {s: [c["summary"]["medians"][s][metric] or 0.0 for c in configs] for s in systems}
    for i, s in enumerate(systems):
        name = "Apache Kafka" if s == "kafka" else system_label(results, s)
        if s in JAVA_SYSTEMS and "latency" in metric:
            name += " (send→ack)"
        ax.bar([x + (i - (len(systems) - 1) / 2) * width for x in xs], values[s], width,
               label=name, color=PLOT_COLORS[s])
    every = [v for s in systems for v in values[s]]
    top = max(every + [1e-9])
    against, key = _plot_against(results, systems)
    for x, c in zip(xs, configs):
        r = (c["summary"].get(key) or {}).get(metric)
        h = max(values[s][x] for s in systems)
        if r is not None:
            ax.text(x, h * 1.02 if h else top * 0.02, f"{r:.2f}x", ha="center", va="bottom",
                    fontsize=8)
    many = len(configs) > 4
    ax.set_xticks(list(xs))
    ax.set_xticklabels([c["workload"]["label"] for c in configs], rotation=30 if many else 0,
                       ha="right" if many else "center", fontsize=8)
    positive = [v for v in every if v > 0]
    if positive and max(positive) / min(positive) > LOG_SCALE_SPAN:
        ax.set_yscale("log")  # the systems differ by orders of magnitude: show them all
        ax.set_ylim(min(positive) / 2, top * 3)
        ylabel += " (log scale)"
    else:
        ax.set_ylim(0, top * 1.15)
    ax.set_ylabel(ylabel)
    return against


EQUAL_LOAD_PLOT = "latency_equal_load.png"
PERCENTILE_STYLES = (("latency_p50_ms", "p50", "-"), ("latency_p99_ms", "p99", "--"),
                     ("latency_p999_ms", "p99.9", ":"))


def _equal_load_series(results: dict, labels: list[str]) -> dict:
    """{system: [(offered rec/s, medians)]} over the equal-load configurations `labels`."""
    out: dict = {}
    for config in results["configurations"]:
        w = config["workload"]
        if w["label"] not in labels or "summary" not in config:
            continue
        for system in SYSTEMS:
            if _ran(config, system):
                out.setdefault(system, []).append((w["rate_records_per_s"] * w["producers"],
                                                   config["summary"]["medians"][system]))
    return out


def write_equal_load_plot(out_dir: Path, results: dict, plt) -> Path | None:
    """Latency percentiles against the offered load, one colour per system (log y)."""
    notes = [n for n in (results.get("equal_load") or []) if "labels" in n]
    if not notes:
        return None
    series = _equal_load_series(results, [label for n in notes for label in n["labels"]])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for system, points in series.items():
        for metric, name, style in PERCENTILE_STYLES:
            xs = [x for x, m in points if m.get(metric)]
            ys = [m[metric] for _, m in points if m.get(metric)]
            ax.plot(xs, ys, style, marker="o", markersize=3, color=PLOT_COLORS.get(system),
                    label=f"{system_label(results, system)} {name}")
    ax.set_yscale("log")
    ax.set_xlabel("offered records/s (same for every system)")
    ax.set_ylabel("latency ms (log scale)")
    ax.set_title(f"Latency at equal offered load — preset {results['preset']}", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / EQUAL_LOAD_PLOT
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
