"""Coordinator loop time per heartbeat with 4 brokers at the replica map limit: the
sans-IO core handling one broker heartbeat (a report of a few virtual segments) plus the
persistence of its change on a real directory, as the server does it each loop turn.

    python -m bench.coordinator_persist [--dir DIR] [--heartbeats N]

Compares side by side, on the same state: `rewrite` (what the coordinator did before the change
log: the whole state as JSON, replaced atomically, on every heartbeat with a report) and `log`
(kera.coordinator.store.MetadataStore: one appended record and one fdatasync).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from kera.coordinator import store
from kera.coordinator.core import Coordinator
from kera.coordinator.replica_map import REPLICA_ENTRIES_PER_BROKER_MAX
from kera.daemon.durable import write_atomic

BROKERS = 4
ENTRIES_PER_HEARTBEAT = 4   # virtual segments whose placement changed since the last report


def populated() -> Coordinator:
    c = Coordinator(0.0)
    for i in range(BROKERS):
        c.handle("register", {"kind": "broker", "address": f"127.0.0.1:{7100 + i}",
                              "node": f"n{i}"}, 0.0)
    for i in range(3):
        c.handle("register", {"kind": "backup", "address": f"127.0.0.1:{7200 + i}",
                              "node": f"b{i}"}, 0.0)
    for b in range(BROKERS):
        c.replica_map.report(b, [[n % 8, n, [n % 3, (n + 1) % 3]]
                              for n in range(REPLICA_ENTRIES_PER_BROKER_MAX)])
    c.replica_map.take_journal()
    return c


def heartbeat(c: Coordinator, n: int) -> None:
    broker = n % BROKERS
    entries = [[0, REPLICA_ENTRIES_PER_BROKER_MAX + n * ENTRIES_PER_HEARTBEAT + k, [0, 1]]
               for k in range(ENTRIES_PER_HEARTBEAT)]
    c.handle("heartbeat", {"kind": "broker", "daemon_id": broker,
                           "metadata_version": c.version, "vsegs": entries}, 1.0)


def run_rewrite(c: Coordinator, directory: Path, n: int) -> float:
    started = time.perf_counter()
    heartbeat(c, n)
    c.replica_map.take_journal()
    data = json.dumps(c.to_state(), separators=(",", ":"), sort_keys=True).encode()
    write_atomic(directory / "coordinator-rewrite.json", data)
    return time.perf_counter() - started


def run_log(c: Coordinator, s: store.MetadataStore, saved: list, n: int) -> float:
    started = time.perf_counter()
    heartbeat(c, n)
    moved = c.version != saved[0]
    saved[0] = c.version
    s.commit(c.base_state() if moved else None, c.replica_map.take_journal())
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--heartbeats", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)   # the map is at its limit: eviction warnings
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        c = populated()
        s = store.MetadataStore(directory / "log")
        (directory / "log").mkdir()
        s.snapshot(c.to_state())
        saved = [c.version]
        times: dict[str, list[float]] = {"rewrite": [], "log": []}
        for n in range(args.heartbeats):   # alternated, so both see the same machine load
            times["rewrite"].append(run_rewrite(c, directory, 2 * n))
            times["log"].append(run_log(c, s, saved, 2 * n + 1))
        started = time.perf_counter()   # a snapshot when the log is long: the loop's share
        s.start_snapshot(c.base_state(), {b: dict(t) for b, t in c.replica_map.tables.items()})
        switch_ms = (time.perf_counter() - started) * 1000
        s.close()
        written_ms = (time.perf_counter() - started) * 1000
        entries = sum(map(len, c.replica_map.tables.values()))
        print(f"{BROKERS} brokers, {entries} replica map entries, "
              f"{ENTRIES_PER_HEARTBEAT} entries per heartbeat, {args.heartbeats} heartbeats each")
        for name, values in times.items():
            ms = sorted(v * 1000 for v in values)
            print(f"{name:8s} median {statistics.median(ms):9.3f} ms   max {ms[-1]:9.3f} ms")
        print(f"snapshot: {switch_ms:.1f} ms on the loop (copies + log switch), "
              f"{written_ms:.0f} ms until written by its thread")
        ratio = statistics.median(times["rewrite"]) / statistics.median(times["log"])
        print(f"rewrite / log (median): {ratio:.0f}x")


if __name__ == "__main__":
    main()
