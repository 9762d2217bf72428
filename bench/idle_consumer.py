"""A consumer at the end of many quiet streams: its CPU, its broker's, and the fetches a second
the broker answers, with fetches held until records come (`fetch_max_wait_ms`) and without.

    python -m kera.bench.idle_consumer                       # 512 streams, waits 0 and 100 ms
    python -m kera.bench.idle_consumer --streams 128 --waits 0 100 500 --seconds 20

Starts a `kera local` cluster (1 coordinator, 1 broker, 2 backups), creates the streams (one
streamlet each, R=3), and for each wait in turn (the list repeated `--rounds` times,
alternating) opens one Consumer of all of them, lets it reach their end, then reads CPU
(user + system) over the window: the broker's from /proc, the consumer's from this process.
Reported, never asserted: the machine is shared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from kera.bench.procstat import process_cpu_s

SETTLE_S = 2.0            # the consumer's first fetches (every stream's group table) are done


def fetches_answered(cluster) -> int:
    with cluster.admin() as admin:
        return sum(b.get("fetch_requests", 0) for b in admin.stats()["brokers"].values())


def measure_one(cluster, names: list[str], wait_ms: int, window_s: float) -> dict:
    from kera import Consumer

    broker_pid = cluster.brokers[0].pid
    with Consumer(cluster.bootstrap, names, fetch_max_wait_ms=wait_ms) as consumer:
        consumer.poll(timeout_s=SETTLE_S)
        b0, c0, f0 = process_cpu_s(broker_pid) or 0.0, time.process_time(), fetches_answered(cluster)
        time.sleep(window_s)   # the measurement itself: nothing to poll for
        b1, c1, f1 = process_cpu_s(broker_pid) or 0.0, time.process_time(), fetches_answered(cluster)
    return {"wait_ms": wait_ms, "broker": (b1 - b0) / window_s, "consumer": (c1 - c0) / window_s,
            "fetches_per_s": (f1 - f0) / window_s}


def run(streams: int, waits: list[int], window_s: float, rounds: int) -> list[dict]:
    from kera.cli.local import LocalCluster

    with LocalCluster(tempfile.mkdtemp(prefix="kera-idle-consumer-"), brokers=1, backups=2,
                      log_level="WARNING") as cluster:
        names = [f"quiet-{i}" for i in range(streams)]
        with cluster.admin() as admin:
            for name in names:
                admin.create_stream(name, streamlets=1, replication=3)
            for name in names:
                admin.wait_ready(name)
        out = []
        for r in range(rounds):
            for wait_ms in waits:
                row = measure_one(cluster, names, wait_ms, window_s)
                print(f"  round {r + 1}, fetch_max_wait_ms={wait_ms}: broker {row['broker']:.1%} "
                      f"of a core, consumer {row['consumer']:.1%}, "
                      f"{row['fetches_per_s']:.0f} fetches/s", flush=True)
                out.append(row)
        return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="CPU of a consumer of many quiet streams and of "
                                     "its broker, with held fetches and without")
    parser.add_argument("--streams", type=int, default=512, help="quiet streams read (default 512)")
    parser.add_argument("--waits", type=int, nargs="+", default=[0, 100], metavar="MS",
                        help="fetch_max_wait_ms values to compare (0: never held; default 0 100)")
    parser.add_argument("--seconds", type=float, default=10.0, help="window per trial (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations (default 2)")
    args = parser.parse_args(argv)
    print(f"one consumer of {args.streams} quiet streams (R=3), {args.seconds:.0f} s per trial")
    run(args.streams, args.waits, args.seconds, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
