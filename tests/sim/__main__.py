"""Run simulation seeds from the command line.

    python -m tests.sim 1234                 # one seed: its report, or the failure
    python -m tests.sim 1234 --trace 50      # ... and the last 50 deliveries before it ended
    python -m tests.sim --from 0 --count 200 # many seeds, one line each
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tests.sim.cluster import Cluster
from tests.sim.shell import SimFailure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("seed", nargs="?", type=int, help="run this one seed")
    parser.add_argument("--from", dest="start", type=int, default=0)
    parser.add_argument("--count", type=int, default=0, help="run seeds from --from on")
    parser.add_argument("--duration", type=float, default=None, help="active phase, simulated s")
    parser.add_argument("--trace", type=int, default=0, help="print the last N deliveries")
    parser.add_argument("--log", default=None, help="core log level (e.g. WARNING) for one seed")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else list(range(args.start, args.start + args.count))
    if not seeds:
        parser.error("give a seed or --count")
    current: list = [None]
    if args.log:
        class SimTime(logging.Formatter):   # stamp each line with the simulated clock
            def format(self, record):
                now = current[0].sched.now if current[0] is not None else 0.0
                return f"{now:10.6f} {record.name} {record.levelname}: {record.getMessage()}"

        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(SimTime())
        logging.getLogger("kera").addHandler(handler)
        logging.getLogger("kera").setLevel(args.log.upper())
    failed = 0
    started = time.perf_counter()
    cpu_started = time.process_time()
    steps = 0
    for seed in seeds:
        cluster = current[0] = Cluster(seed, duration_s=args.duration, trace=bool(args.trace),
                                       logs=bool(args.log))
        t0 = time.perf_counter()
        try:
            report = cluster.run()
        except SimFailure as exc:
            failed += 1
            print(f"FAIL {exc}")
            if args.trace and cluster.trace:
                print("\n".join(cluster.trace[-args.trace:]))
            continue
        finally:
            steps += cluster.sched.steps
        print(f"ok   {report.line()} [{time.perf_counter() - t0:.2f} s]")
        if len(seeds) == 1:
            print(f"     profile: {cluster.profile}")
            print(f"     counts: {report.counts}")
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    print(f"{len(seeds) - failed}/{len(seeds)} seeds passed, {steps} steps "
          f"({steps // len(seeds)} per seed) in {elapsed:.1f} s ({cpu:.1f} s of CPU)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
