"""The throughput workload with kera's daemons on test hosts vs on loopback (issue 13).

    sudo python -m bench.multihost [--repeats 2] [--chunk-kib 16] [--replication 3]

Test hosts are network namespaces joined by a bridge (tests/hosts: the coordinator on host 1,
the broker on host 2, backups on hosts 4-6, each its own address); the bench's producer and
consumer processes run on the root namespace's host, so every request and every replica crosses
a veth pair and the bridge instead of loopback. The same workload (the throughput preset's
shape: one stream of 32 streamlets x 4 active groups, P=C=2) runs on a loopback cluster and on
the hosts cluster, alternating trials, both clusters up throughout; the table gives the medians
and the ratio hosts / loopback. Needs root and iproute2 (as `make test-hosts` does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .cli import warm_up_workload
from .runner import median_of, run_trial
from .systems import KeraSystem
from .workload import KiB, Workload

HOSTS_DIR = Path(__file__).resolve().parents[1] / "tests" / "hosts"
METRICS = (("producer_records_per_s", "producer rec/s"), ("consumer_records_per_s", "consumer rec/s"),
           ("latency_p50_ms", "p50 ms"), ("latency_p99_ms", "p99 ms"),
           ("server_cpu_s_per_million", "server CPU s/Mrec"))


class HostsKeraSystem(KeraSystem):
    """kera with its daemons placed on test hosts (tests/hosts/host_layout.py)."""

    def __init__(self, work_dir: Path, where):
        super().__init__(work_dir)
        self.where = where

    def start(self, layout: dict, cluster_dir: Path):
        from kera.cli.local import LocalCluster

        return LocalCluster(cluster_dir, brokers=layout["brokers"], backups=layout["backups"],
                            virtual_logs=layout["virtual_logs"], log_level="WARNING",
                            where=self.where)


def workload(args) -> Workload:
    return Workload(f"multihost-{args.chunk_kib}k-r{args.replication}", producers=2, consumers=2,
                    streams=1, streamlets=32, active_groups=4, replication=args.replication,
                    chunk_size_bytes=args.chunk_kib * KiB, warmup_s=2.0, duration_s=5.0)


def run(systems: dict, w: Workload, repeats: int) -> dict[str, list]:
    """Alternating trials of `w` on each system (warmed up once); {name: [TrialResult]}."""
    trials: dict[str, list] = {name: [] for name in systems}
    for name, system in systems.items():
        system.ensure(w)
        run_trial(system, warm_up_workload(w), f"w-{name}")
    for repeat in range(repeats):
        for name, system in systems.items():
            t = run_trial(system, w, f"t{repeat}-{name}", repeat)
            trials[name].append(t)
            print(f"{name} #{repeat + 1}: {t.producer_records_per_s:,.0f} rec/s produced, "
                  f"{t.consumer_records_per_s:,.0f} consumed", flush=True)
    return trials


def table(trials: dict[str, list]) -> str:
    rows = ["| placement | " + " | ".join(title for _, title in METRICS) + " |",
            "|---|" + "---:|" * len(METRICS)]
    medians = {name: [median_of(ts, m) for m, _ in METRICS] for name, ts in trials.items()}
    for name, values in medians.items():
        rows.append(f"| {name} | " + " | ".join(_fmt(v) for v in values) + " |")
    ratios = [None if lo in (None, 0) or hi is None else hi / lo
              for lo, hi in zip(medians["loopback"], medians["hosts"])]
    rows.append("| hosts / loopback | " + " | ".join(
        "" if r is None else f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(rows)


def _fmt(value) -> str:
    return "" if value is None else f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="trials per placement (default 2)")
    ap.add_argument("--chunk-kib", type=int, default=16, help="chunk size in KiB (default 16)")
    ap.add_argument("--replication", type=int, default=3, choices=(1, 2, 3),
                    help="R (default 3: the broker's host and two backups' hosts)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HOSTS_DIR))
    from host_layout import HOSTS, placement
    from netns import TestHosts, unavailable
    missing = unavailable()
    if missing:
        raise SystemExit(f"bench.multihost: test hosts unavailable here: {missing}")
    w = workload(args)
    with tempfile.TemporaryDirectory(prefix="kera-multihost-") as d, TestHosts(HOSTS) as hosts:
        systems = {"loopback": KeraSystem(Path(d) / "loopback"),
                   "hosts": HostsKeraSystem(Path(d) / "hosts", placement(hosts))}
        try:
            trials = run(systems, w, args.repeats)
        finally:
            for system in systems.values():
                system.stop()
    print(f"\n{w.label()}: P=C=2, 1 stream x 32 streamlets x 4 groups, "
          f"{args.chunk_kib} KiB chunks, R={args.replication}\n")
    print(table(trials))


if __name__ == "__main__":
    main()
