"""The main job: an embedded cluster, a million records in and out, the rates.

    python -m kera.demo --records 1000000

Starts `kera local` (a coordinator, brokers and backups, each its own process), creates a
stream, writes the records with the batch producer API, reads them back with the bulk
consumer API, checks that every record came back exactly once, and prints the rates.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.cli.local import LocalCluster
from kera.producer import Producer

BATCH_RECORDS = 50_000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kera.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="records to write and read (default 1,000,000)")
    p.add_argument("--value-bytes", type=int, default=100, help="bytes per record value (default 100)")
    p.add_argument("--streamlets", type=int, default=8, help="streamlets of the demo stream (default 8)")
    p.add_argument("--active-groups", type=int, default=2, help="active groups per streamlet (default 2)")
    p.add_argument("--brokers", type=int, default=1, help="broker processes (default 1)")
    p.add_argument("--backups", type=int, default=2, help="backup processes (default 2)")
    p.add_argument("--replication", type=int, default=3,
                   help="copies of each record: the broker's plus R-1 backups' (default 3)")
    p.add_argument("--dir", default=None, help="data directory (default: a temporary one, removed after)")
    return p.parse_args(argv)


def produce(bootstrap: str, stream: str, records: int, value_bytes: int) -> float:
    """Write `records` values whose first 8 bytes are their index; returns seconds to acked."""
    rows = np.zeros((min(BATCH_RECORDS, records), value_bytes), dtype=np.uint8)
    start = time.perf_counter()
    with Producer(bootstrap) as producer:
        sent = 0
        while sent < records:
            n = min(BATCH_RECORDS, records - sent)
            batch = rows[:n]
            batch[:, :8] = np.arange(sent, sent + n, dtype="<u8").view(np.uint8).reshape(n, 8)
            producer.send_batch(stream, batch)
            sent += n
            _progress("sent", sent, records, start)
        print("  flushing: waiting for every record to be acknowledged", file=sys.stderr)
        producer.flush()
    return time.perf_counter() - start


def consume(bootstrap: str, stream: str, records: int, timeout_s: float = 60.0) -> tuple[float, np.ndarray]:
    """Read until `records` records arrived; returns seconds and how often each index was seen."""
    seen = np.zeros(records, dtype=np.uint32)
    got = 0
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    with Consumer(bootstrap, stream, start="earliest") as consumer:
        while got < records:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {got} of {records} records arrived within {timeout_s} s")
            for batch in consumer.poll_batch(timeout_s=1.0):
                offsets = batch.value_offsets.astype(np.int64)
                blob = np.frombuffer(batch.values_blob, dtype=np.uint8)
                idx = (offsets[:-1, None] + np.arange(8)).ravel()
                index = blob[idx].view("<u8")
                np.add.at(seen, index[index < records], 1)
                got += len(batch)
            _progress("consumed", got, records, start)
    return time.perf_counter() - start, seen


_last_tenth: dict[str, int] = {}


def _progress(what: str, done: int, total: int, start: float) -> None:
    """One updating line on a terminal; a line per tenth in a log."""
    rate = done / max(time.perf_counter() - start, 1e-9)
    line = f"  {what} {done:>10,} / {total:,}  ({rate / 1e6:5.2f} M records/s)"
    if sys.stderr.isatty():
        print("\r" + line, end="\n" if done >= total else "", file=sys.stderr, flush=True)
        return
    tenth = 10 * done // total
    if _last_tenth.get(what) != tenth:
        _last_tenth[what] = tenth
        print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kera-demo-") as tmp:
        data_dir = args.dir or tmp
        print(f"starting kera local: {args.brokers} broker(s), {args.backups} backup(s) in {data_dir}")
        with LocalCluster(data_dir, brokers=args.brokers, backups=args.backups) as cluster:
            print(f"bootstrap {cluster.bootstrap}")
            with Admin(cluster.bootstrap) as admin:
                admin.create_stream("demo", streamlets=args.streamlets, active_groups=args.active_groups,
                                    replication=args.replication)
            print(f"stream 'demo': {args.streamlets} streamlets x {args.active_groups} active groups, "
                  f"replication {args.replication}; {args.records:,} records of {args.value_bytes} bytes")
            produce_s = produce(cluster.bootstrap, "demo", args.records, args.value_bytes)
            consume_s, seen = consume(cluster.bootstrap, "demo", args.records)
            with Admin(cluster.bootstrap) as admin:
                stats = admin.stats()
    missing, duplicated = int((seen == 0).sum()), int((seen > 1).sum())
    mb = args.records * args.value_bytes / 1e6
    print()
    print(f"{'':10} {'records/s':>14} {'MB/s':>8} {'seconds':>8}")
    print(f"{'produce':10} {args.records / produce_s:>14,.0f} {mb / produce_s:>8.1f} {produce_s:>8.2f}   (acknowledged on {args.replication} copies)")
    print(f"{'consume':10} {args.records / consume_s:>14,.0f} {mb / consume_s:>8.1f} {consume_s:>8.2f}   (bulk poll_batch)")
    for broker_id, broker_stats in sorted(stats.get("brokers", {}).items()):
        writes = broker_stats.get("replication_writes", 0)
        chunks = broker_stats.get("chunks_appended", 0)
        if writes:
            print(f"broker {broker_id}: {chunks:,} chunks appended, {writes:,} replication writes "
                  f"({chunks / writes:.1f} chunks per write)")
    print(f"check: {args.records - missing:,} of {args.records:,} records read back, "
          f"{missing} missing, {duplicated} duplicated")
    return 0 if missing == 0 and duplicated == 0 else 1


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
