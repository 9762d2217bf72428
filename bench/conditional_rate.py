"""Conditional appends per second (kera.services.conditional), with and without conflicts.

    python -m bench.conditional_rate [--writers W] [--seconds S] [--replication R]

Starts a local cluster (one broker, R-1 backups), then for each case runs W writer threads for
S seconds, each its own ConditionalAppender appending one 100-byte record per call to one
streamlet, naming one lock, with its high-water mark:

* `no conflicts`: each writer its own lock, so every append is accepted;
* `conflicts`: all writers share LOCKS_SHARED locks and keep only their own high-water mark
  (raised to the number a refusal names), so many appends are refused and re-executed.

Prints appends tried, accepted and refused per second. A writer waits for each answer (an
append is acknowledged once on R copies), so the rate is W / (round trip), as for Waltz clients.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from kera.services.conditional import ConditionalAppender
from kera.errors import LockConflict
from kera.cli.local import LocalCluster

STREAM = "conditional_rate"
VALUE = b"x" * 100
LOCKS_SHARED = 4


def writer(bootstrap: str, w: int, shared: bool, stop: threading.Event, counts: list) -> None:
    rng = random.Random(w)
    hwm = -1
    with ConditionalAppender(bootstrap) as log:
        while not stop.is_set():
            lock = rng.randrange(LOCKS_SHARED) if shared else 1000 + w
            try:
                md = log.append(STREAM, [VALUE], locks=[lock], high_water_mark=hwm)
                hwm = max(hwm, md.number)
                counts[0] += 1
            except LockConflict as err:
                hwm = max(hwm, err.number)
                counts[1] += 1


def run_case(bootstrap: str, writers: int, seconds: float, shared: bool) -> tuple[int, int]:
    stop = threading.Event()
    counts = [[0, 0] for _ in range(writers)]
    threads = [threading.Thread(target=writer, args=(bootstrap, w, shared, stop, counts[w]))
               for w in range(writers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--replication", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(Path(tmp), backups=args.replication - 1, log_level="WARNING") as cluster:
        cluster.admin().create_stream(STREAM, streamlets=1, replication=args.replication)
        print(f"{args.writers} writers, {args.seconds:.0f} s per case, R={args.replication}, "
              f"one streamlet, 100-byte records")
        print(f"{'case':14} {'tried/s':>9} {'accepted/s':>11} {'refused/s':>10}")
        for name, shared in (("no conflicts", False), ("conflicts", True)):
            ok, refused = run_case(cluster.bootstrap, args.writers, args.seconds, shared)
            s = args.seconds
            print(f"{name:14} {(ok + refused) / s:>9,.0f} {ok / s:>11,.0f} {refused / s:>10,.0f}")


if __name__ == "__main__":
    main()
