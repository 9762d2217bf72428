"""Where a broker's CPU goes with CURVE on, against plaintext: per thread and per library.

    python -m bench.curve_cpu --records 200000

For each mode a one-broker cluster takes the same produce load (one producer, 1 KiB values, R=1);
the broker's threads' CPU is read from /proc before and after (ZeroMQ's I/O thread, which does
the encryption, is `ZMQbg/IO/0`; the Python loop is the main thread), and `perf record` samples
the broker to split its CPU by shared object (libzmq and libsodium vs the Python interpreter).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from kera.client.admin import Admin
from kera.cli.local import LocalCluster
from kera.producer import Producer

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
VALUE_BYTES = 1024
PERF_SAMPLES_PER_S = 499
SHARED_OBJECTS_SHOWN = 6


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process `pid` (threads of one name summed)."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue   # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
    return out


def run_mode(secure: bool, records: int, tmp: Path) -> dict:
    with LocalCluster(tmp / ("curve" if secure else "plain"), secure=secure,
                      log_level="WARNING") as cluster:
        with Admin(cluster.bootstrap, key_file=cluster.key_file) as admin:
            admin.create_stream("load", streamlets=8)
        pid = cluster.brokers[0].pid
        perf_file = tmp / f"perf-{secure}.data"
        perf = subprocess.Popen(["perf", "record", "-F", str(PERF_SAMPLES_PER_S), "-p", str(pid),
                                 "-o", str(perf_file)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        before = thread_cpu_s(pid)
        started = time.monotonic()
        value = b"v" * VALUE_BYTES
        with Producer(cluster.bootstrap, key_file=cluster.key_file) as p:
            for i in range(0, records, 1000):
                p.send_batch("load", [value] * min(1000, records - i))
            p.flush()
        elapsed = time.monotonic() - started
        after = thread_cpu_s(pid)
        perf.send_signal(signal.SIGINT)
        perf.wait(60)
    threads = {n: after[n] - before.get(n, 0.0) for n in after if after[n] - before.get(n, 0.0) > 0}
    return {"elapsed_s": elapsed, "threads": threads, "objects": perf_objects(perf_file)}


def perf_objects(perf_file: Path) -> list[tuple[str, float]]:
    """(shared object, % of samples), most first, from `perf report --sort dso`."""
    try:
        text = subprocess.run(["perf", "report", "-i", str(perf_file), "--sort", "dso", "--stdio"],
                              capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].endswith("%"):
            rows.append((parts[1], float(parts[0][:-1])))
    return rows[:SHARED_OBJECTS_SHOWN]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.curve_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=200_000, help="records per mode (default: %(default)s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kera-curve-cpu-") as tmp:
        for secure in (False, True):
            r = run_mode(secure, args.records, Path(tmp))
            total = sum(r["threads"].values())
            print(f"{'CURVE' if secure else 'plaintext'}: {args.records:,} records of {VALUE_BYTES} B "
                  f"in {r['elapsed_s']:.2f} s; broker CPU {total:.2f} s "
                  f"({total / args.records * 1e6:.1f} s per million records)")
            for name, cpu in sorted(r["threads"].items(), key=lambda kv: -kv[1]):
                print(f"    thread {name:16s} {cpu:6.2f} s  {cpu / total:6.1%}")
            for obj, share in r["objects"]:
                print(f"    perf   {obj:40s} {share:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
