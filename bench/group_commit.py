"""Consumer-group commit latency and the commit rate one coordinator sustains.

    python -m bench.group_commit [--commits 2000] [--clients 1 4]

Starts `kera local` (1 broker, 1 backup), creates a stream, and for each client count runs that
many group members (one Consumer each, one group per client so every commit is accepted),
each committing its positions synchronously in a loop (`Consumer.commit()`: one durable
coordinator write per commit turn). Prints the commit latency (p50, p99) and the aggregate
commit rate.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import numpy as np

from kera import Consumer
from kera.cli.local import LocalCluster

ASSIGN_TIMEOUT_S = 30.0
ASSIGN_POLL_S = 0.01     # how often to look for the first assignment while waiting


def member(bootstrap: str, stream: str, group: str, commits: int, out: list) -> None:
    with Consumer(bootstrap, stream, group=group, auto_commit_interval_ms=None) as c:
        deadline = time.monotonic() + ASSIGN_TIMEOUT_S
        while not c.assignment():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{group}: no assignment within {ASSIGN_TIMEOUT_S} s")
            time.sleep(ASSIGN_POLL_S)
        for _ in range(commits):
            started = time.perf_counter()
            c.commit()
            out.append(time.perf_counter() - started)


def run(bootstrap: str, stream: str, clients: int, commits: int) -> dict:
    latencies: list[float] = []
    threads = [threading.Thread(target=member, args=(bootstrap, stream, f"bench-{clients}-{i}",
                                                     commits, latencies)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    lat = np.array(latencies) * 1000
    return {"clients": clients, "commits": len(lat), "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "commits_per_s": len(lat) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=2000, help="commits per client")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kera-commit-") as tmp:
        cluster = LocalCluster(tmp, brokers=1, backups=1, log_level="WARNING")
        try:
            with cluster.admin() as admin:
                admin.create_stream("commits", streamlets=4)
            for clients in args.clients:
                r = run(cluster.bootstrap, "commits", clients, args.commits)
                print(f"{r['clients']} clients: {r['commits']} commits, p50 {r['p50_ms']:.2f} ms, "
                      f"p99 {r['p99_ms']:.2f} ms, {r['commits_per_s']:.0f} commits/s")
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
