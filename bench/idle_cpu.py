"""Idle CPU of a `kera local` cluster: each daemon's CPU share while nothing is sent or read.

    python -m kera.bench.idle_cpu                  # 1 coordinator, 2 brokers, 2 backups, 30 s
    python -m kera.bench.idle_cpu --seconds 60 --stream 4

Starts a fresh cluster (optionally with one stream of N streamlets, replicated to both
backups, so brokers have streamlets and backups have replicas to tend), waits for it to
settle, then reads user + system CPU of every daemon from /proc over the window. Reported,
never asserted: the machine is shared, so the whole machine's busy share is printed too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from kera.bench.procstat import machine_cpu_s, process_cpu_s

SETTLE_S = 3.0          # startup work (registration, first heartbeats) is not idle cost
DEFAULT_WINDOW_S = 30.0  # long enough that 10 ms clock ticks are under 0.1 % of a core


def measure(pids: dict[str, int], window_s: float) -> tuple[dict[str, float], float]:
    """Each named process's CPU share of one core over `window_s`, and the machine's busy
    share of all its cores."""
    before = {name: process_cpu_s(pid) or 0.0 for name, pid in pids.items()}
    busy0, total0 = machine_cpu_s()
    time.sleep(window_s)  # the measurement itself: nothing to poll for
    busy1, total1 = machine_cpu_s()
    shares = {name: ((process_cpu_s(pid) or 0.0) - before[name]) / window_s
              for name, pid in pids.items()}
    return shares, (busy1 - busy0) / max(total1 - total0, 1e-9)


def run(window_s: float, streamlets: int, brokers: int = 2, backups: int = 2) -> tuple[dict, float]:
    from kera.cli.local import LocalCluster

    with LocalCluster(tempfile.mkdtemp(prefix="kera-idle-"), brokers=brokers, backups=backups,
                      log_level="WARNING") as cluster:
        if streamlets:
            with cluster.admin() as admin:
                admin.create_stream("idle", streamlets=streamlets, replication=min(backups + 1, 3))
        time.sleep(SETTLE_S)
        return measure({d.name: d.pid for d in cluster.daemons}, window_s)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="idle CPU per daemon of a kera local cluster")
    parser.add_argument("--seconds", type=float, default=DEFAULT_WINDOW_S)
    parser.add_argument("--stream", type=int, default=4, metavar="STREAMLETS",
                        help="create one stream with this many streamlets first (0: none)")
    args = parser.parse_args(argv)
    shares, machine = run(args.seconds, args.stream)
    print(f"idle CPU over {args.seconds:.0f} s (share of one core; machine busy {machine:.1%} of all cores)")
    for name, share in shares.items():
        print(f"  {name:<12} {share:6.1%}")
    print(f"  {'total':<12} {sum(shares.values()):6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
