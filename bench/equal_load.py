"""Latency at equal offered load: every system runs at the same fractions (25/50/75 %) of the
slower system's sustainable maximum, measured first in the same run.

A system's sustainable maximum is the smaller of its median acknowledged producer rate and its
median consumer rate at full speed (a rate the consumers cannot keep up with makes the latency
grow without bound, whatever the system). The reference is the smallest of those over the
contending systems; Kafka's Java tools (`kafka-java*`) are a reference row, not a contender:
they neither set the loads nor run at them (ProducerPerformance's percentiles span its whole
run, JVM warm-up included, and its throttle sends faster after a slow start to catch up: at
25 % load its p99 was the warm-up's backlog, hundreds of ms). The offered rate is split evenly
over the producers (`rate_records_per_s` is per producer).
"""

from __future__ import annotations

from .workload import Workload

FRACTIONS = (0.25, 0.5, 0.75)
REFERENCE_ONLY = ("kafka-java", "kafka-java-tuned")   # neither set the loads nor run at them


def sustainable_rate(medians: dict) -> float | None:
    """records/s a system both acknowledged and consumed at full speed (medians of a config)."""
    rates = [medians.get("producer_records_per_s"), medians.get("consumer_records_per_s")]
    rates = [r for r in rates if r]
    return min(rates) if rates else None


def reference(summary: dict, systems) -> tuple[str, float] | None:
    """(system, records/s): the slowest contender's sustainable maximum in one configuration's
    summary; None if no contender has one."""
    rates = [(sustainable_rate(summary["medians"].get(s) or {}), s) for s in systems
             if s not in REFERENCE_ONLY]
    rates = [(r, s) for r, s in rates if r]
    if not rates:
        return None
    rate, system = min(rates)
    return system, rate


def load_workloads(w: Workload, rate_per_s: float, fractions=FRACTIONS) -> list[Workload]:
    """`w` at each fraction of `rate_per_s` (total over its producers), tagged with the
    fraction and the offered total."""
    out = []
    for f in fractions:
        per_producer = max(1, round(f * rate_per_s / w.producers))
        tags = {**{k: v for k, v in w.tags.items() if k != "load"}, "load": f"{f:.0%}",
                "offered": f"{per_producer * w.producers:,} rec/s"}
        out.append(w.replace(name=f"{w.name}-{round(f * 100)}pct",
                             rate_records_per_s=per_producer, tags=tags))
    return out


def plan(configs: list[dict], workloads: list[Workload], systems,
         fractions=FRACTIONS) -> tuple[list[Workload], list[dict]]:
    """The equal-load workloads for each full-speed configuration (`configs[i]` ran
    `workloads[i]`), and what each load was derived from (for results.json)."""
    loads, notes = [], []
    for config, w in zip(configs, workloads):
        ref = reference(config["summary"], systems)
        if ref is None:
            notes.append({"label": w.label(), "skipped": "no system had a maximum"})
            continue
        system, rate = ref
        planned = load_workloads(w, rate, fractions)
        loads += planned
        notes.append({"label": w.label(), "reference_system": system,
                      "reference_records_per_s": rate, "fractions": list(fractions),
                      "labels": [p.label() for p in planned]})
    return loads, notes
