"""Tiering figures, measured in one run on a local cluster (one broker; R=1, or R copies with
R-1 backups under `--replication R`):

1. Broker resident memory over a long ingest with a memory limit: RSS, and the part of it
   that segments take (anonymous shared maps: RssShmem), sampled every `--sample-s` while
   producers write several times the limit; the broker's `memory_bytes` and `tiered_bytes`
   alongside.
2. Consumer throughput reading tiered data from disk vs from memory: after the ingest, a
   stream whose segments are all on disk and one whose segments are all in memory, the same
   size, each read whole by a fresh consumer (bulk `poll_batch`). The disk stream is read once
   with its files' pages evicted from the page cache first (posix_fadvise DONTNEED: cold,
   from the device), then both streams alternately `--rounds` times (warm: page cache vs
   memory); medians are reported. At R=1 the broker wrote each segment's file through the page
   cache before acknowledging it; at R >= 2 it writes new files with O_DIRECT
   (kera.broker.tier_files), so the cold read is also what a consumer just behind the memory
   limit gets.

    python -m bench.tiering --ingest-mib 1024 --limit-mib 64 --out /tmp/kera-tiering

Writes `samples.csv`, `summary.json` and, with matplotlib, `tiering.png` under --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kera import Consumer, Producer

from kera.net import rpc
from kera.broker.memory import resident_bytes
from kera.cli.local import LocalCluster

MiB = 1 << 20
VALUE_BYTES = 1000
BATCH = 4096


def values(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, VALUE_BYTES), dtype=np.uint8)


def produce(bootstrap: str, stream: str, nbytes: int, producer_id: int) -> float:
    """Write ~nbytes of 1000-byte values; returns MB/s."""
    n = nbytes // VALUE_BYTES
    block = values(BATCH, producer_id)
    started = time.monotonic()
    with Producer(bootstrap, producer_id=producer_id) as p:
        sent = 0
        while sent < n:
            k = min(BATCH, n - sent)
            p.send_batch(stream, block[:k])
            sent += k
        p.flush()
        assert p.stats["records_failed"] == 0
    return nbytes / MiB / (time.monotonic() - started)


def consume(bootstrap: str, stream: str, records: int) -> tuple[float, int]:
    """Read `records` records with bulk polls; returns (MiB/s, bytes read)."""
    got = nbytes = 0
    started = None     # from the first batch: connection set-up is not read throughput
    with Consumer(bootstrap, stream, fetch_max_bytes=16 * MiB) as c:
        deadline = time.monotonic() + 300
        while got < records:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {got} of {records} records from {stream}")
            for b in c.poll_batch(timeout_s=1.0):
                if started is None:
                    started = time.monotonic()
                    first = len(b)
                    continue
                got += len(b)
                nbytes += len(b) * VALUE_BYTES
            if started is not None and got + first >= records:
                break
    return nbytes / MiB / (time.monotonic() - started), nbytes


def stats(address: str) -> dict:
    header, _ = rpc.call(address, "stats", timeout_s=5.0)
    return header["stats"]


def evict(paths) -> int:
    """Drop the files' clean pages from the page cache (no root needed); returns bytes."""
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


class Sampler(threading.Thread):
    def __init__(self, pid: int, address: str, interval_s: float):
        super().__init__(daemon=True)
        self.pid, self.address, self.interval_s = pid, address, interval_s
        self.rows: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = resident_bytes(self.pid)
            try:
                s = stats(self.address)
            except Exception:  # noqa: BLE001 - a busy broker: skip this sample
                s = {}
            self.rows.append({"t_s": round(time.monotonic() - self.t0, 2),
                              "rss_mib": rss.get("VmRSS", 0) / MiB,
                              "rss_anon_mib": rss.get("RssAnon", 0) / MiB,
                              "rss_file_mib": rss.get("RssFile", 0) / MiB,
                              "rss_shmem_mib": rss.get("RssShmem", 0) / MiB,
                              "memory_mib": s.get("memory_bytes", 0) / MiB,
                              "tiered_mib": s.get("tiered_bytes", 0) / MiB,
                              "appended_mib": s.get("bytes_appended", 0) / MiB})
            self.stop.wait(self.interval_s)


def _write_samples(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _create_streams(cluster, segment_bytes: int, replication: int) -> dict[str, int]:
    """The run's three streams; returns their ids by name."""
    with cluster.admin() as admin:
        return {name: admin.create_stream(name, streamlets=2, segment_size_bytes=segment_bytes,
                                          group_segments=8, replication=replication)["id"]
                for name in ("ingest", "on-disk", "in-memory")}


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limit = args.limit_mib * MiB
    data = Path(tempfile.mkdtemp(prefix="kera-tiering-", dir=args.data_dir))
    seg = args.segment_mib * MiB
    with LocalCluster(data, brokers=1, backups=args.replication - 1, log_level="WARNING",
                      extra_broker_args=["--memory-limit", str(limit)]) as cluster:
        broker = cluster.brokers[0]
        ids = _create_streams(cluster, seg, args.replication)
        sampler = Sampler(broker.pid, broker.address, args.sample_s)
        sampler.start()
        # Oldest first: "on-disk" is pushed out by the long ingest; "in-memory" is written
        # last and stays resident (tiering takes the oldest sealed segments first).
        read_bytes = args.read_mib * MiB
        produce(cluster.bootstrap, "on-disk", read_bytes, 1)
        ingest_rate = produce(cluster.bootstrap, "ingest", args.ingest_mib * MiB, 2)
        produce(cluster.bootstrap, "in-memory", read_bytes, 3)
        time.sleep(1.0)
        before_reads = stats(broker.address)
        files = list((data / "broker-0" / "segments").rglob("*.seg"))
        on_disk_files = [f for f in files if f.parent.name.startswith(f"{ids['on-disk']:020d}-")]
        records = read_bytes // VALUE_BYTES
        evicted = evict(on_disk_files)
        cold, _ = consume(cluster.bootstrap, "on-disk", records)
        # Alternate the two warm reads, several rounds: the machine is noisy, the median of
        # reads taken side by side is the figure.
        warm_runs, memory_runs = [], []
        for _ in range(args.rounds):
            memory_runs.append(consume(cluster.bootstrap, "in-memory", records)[0])
            warm_runs.append(consume(cluster.bootstrap, "on-disk", records)[0])
        warm, memory = float(np.median(warm_runs)), float(np.median(memory_runs))
        after = stats(broker.address)
        sampler.stop.set()
        sampler.join()
    rows = sampler.rows
    ingest_rows = [r for r in rows if r["appended_mib"] > args.read_mib]
    summary = {
        "replication": args.replication,
        "memory_limit_mib": args.limit_mib,
        "segment_mib": args.segment_mib,
        "ingested_mib": round(before_reads["bytes_appended"] / MiB, 1),
        "ingest_mib_per_s": round(ingest_rate, 1),
        "rss_max_mib": round(max(r["rss_mib"] for r in rows), 1),
        "rss_anon_max_mib": round(max(r["rss_anon_mib"] for r in rows), 1),
        "rss_shmem_max_mib": round(max(r["rss_shmem_mib"] for r in rows), 1),
        "rss_during_ingest_median_mib": round(float(np.median(
            [r["rss_mib"] for r in ingest_rows])), 1) if ingest_rows else None,
        "rss_shmem_during_ingest_median_mib": round(float(np.median(
            [r["rss_shmem_mib"] for r in ingest_rows])), 1) if ingest_rows else None,
        "memory_bytes_max_mib": round(max(r["memory_mib"] for r in rows), 1),
        "tiered_mib": round(before_reads["tiered_bytes"] / MiB, 1),
        "read_mib_each": args.read_mib,
        "evicted_mib": round(evicted / MiB, 1),
        "consume_from_disk_cold_mib_per_s": round(cold, 1),
        "consume_from_disk_warm_mib_per_s": round(warm, 1),
        "consume_from_memory_mib_per_s": round(memory, 1),
        "consume_rounds": {"disk_warm": [round(x, 1) for x in warm_runs],
                           "memory": [round(x, 1) for x in memory_runs]},
        "disk_cold_vs_memory": round(cold / memory, 2),
        "disk_warm_vs_memory": round(warm / memory, 2),
        "tier_maps": after.get("tier_maps", 0),
        "produce_throttled_memory": after.get("produce_throttled_memory", 0),
    }
    _write_samples(rows, out / "samples.csv")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(rows, summary, out / "tiering.png")
    return summary


def _plot(rows, summary, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = [r["t_s"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(t, [r["rss_mib"] for r in rows], label="broker RSS")
    a.plot(t, [r["rss_shmem_mib"] for r in rows], label="broker RSS of segments (shmem)")
    a.plot(t, [r["rss_anon_mib"] for r in rows], label="broker RSS of the heap (anon)")
    a.plot(t, [r["memory_mib"] for r in rows], label="segment bytes in memory")
    a.plot(t, [r["appended_mib"] for r in rows], "--", label="bytes ingested")
    a.axhline(summary["memory_limit_mib"], color="k", linestyle=":", label="--memory-limit")
    a.set_xlabel("time (s)")
    a.set_ylabel("MiB")
    a.set_yscale("log")
    a.set_title(f"Broker memory during a {summary['ingested_mib']:.0f} MiB ingest")
    a.legend(fontsize=8)
    labels = ["memory", "disk (page cache)", "disk (cold)"]
    rates = [summary["consume_from_memory_mib_per_s"], summary["consume_from_disk_warm_mib_per_s"],
             summary["consume_from_disk_cold_mib_per_s"]]
    b.bar(labels, rates, color=["tab:green", "tab:blue", "tab:orange"])
    for i, r in enumerate(rates):
        b.text(i, r, f"{r:.0f}", ha="center", va="bottom")
    b.set_ylabel("consumer throughput (MiB/s)")
    b.set_title(f"Reading {summary['read_mib_each']} MiB, one consumer, "
                f"R={summary['replication']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tiering", description=__doc__.splitlines()[0])
    p.add_argument("--ingest-mib", type=int, default=1024)
    p.add_argument("--limit-mib", type=int, default=128)
    p.add_argument("--segment-mib", type=int, default=4)
    p.add_argument("--read-mib", type=int, default=64, help="size of each read stream")
    p.add_argument("--sample-s", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=5, help="alternated warm reads of each stream")
    p.add_argument("--replication", type=int, default=1,
                   help="copies of each record: the cluster gets R-1 backups (default: 1)")
    p.add_argument("--data-dir", default=None, help="where the cluster's data goes (default: TMPDIR)")
    p.add_argument("--out", default="results/tiering")
    args = p.parse_args(argv)
    if args.replication < 1:
        p.error(f"--replication must be at least 1, not {args.replication}")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
