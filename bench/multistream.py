"""One Consumer reading many streams vs one Consumer per stream (issue 11 item 3).

    python -m bench.multistream --streams 128 512

For each stream count: start a `kera local` cluster (LocalCluster: 2 brokers, 1 backup), create
S streams of one streamlet (R=1, 1 KiB chunks: the `streams` preset's shape), fill each with
`--records-per-stream` 100-byte records, then read everything twice, in this one process and
side by side on the same data: (a) one Consumer of all S streams, (b) the old way, one Consumer
per stream, drained round-robin with poll_batch. Prints records/s of each, timed from the first
consumer's construction to the last record (request threads start fetching as soon as each
consumer is built, so timing only after construction would credit the per-stream way with what
it prefetched meanwhile), the time to construct them, and the file descriptors and threads
(kernel tasks: zmq's I/O threads included) the consumers added to the process, and the
broker connections their request threads hold.
A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.errors import KeraError
from kera.cli.local import LocalCluster
from kera.producer import Producer

RECORD_BYTES = 100
CHUNK_SIZE_BYTES = 1024
READ_TIMEOUT_S = 600.0         # give up on a read that makes no progress for this long
READY_TIMEOUT_S = 60.0
SETTLE_S = 5.0                 # closed clients' threads are gone well within this


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fill(bootstrap: str, names: list[str], per_stream: int) -> None:
    value = b"v" * RECORD_BYTES
    with Admin(bootstrap, timeout_s=READY_TIMEOUT_S) as admin:
        for name in names:
            admin.create_stream(name, streamlets=1, replication=1, wait_ready=False)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name in names:
            admin.wait_ready(name, max(1.0, deadline - time.monotonic()))
    with Producer(bootstrap, chunk_size_bytes=CHUNK_SIZE_BYTES) as producer:
        for name in names:
            producer.send_batch(name, [value] * per_stream)
        producer.flush()


def drain(consumers: list[Consumer], total: int) -> None:
    """poll_batch round-robin until `total` records were read."""
    got = 0
    last_progress = time.monotonic()
    while got < total:
        before = got
        for c in consumers:
            got += sum(len(b) for b in c.poll_batch(timeout_s=0.0 if len(consumers) > 1 else 0.2))
        if got > before:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > READ_TIMEOUT_S:
            raise TimeoutError(f"read {got} of {total} records, then nothing for {READ_TIMEOUT_S} s")
        elif len(consumers) > 1:
            time.sleep(0.001)   # nothing cached anywhere: let the request threads run


def settle() -> None:
    """Wait (SETTLE_S at most) for the threads of clients closed before to be gone, so that
    the counts below are of the consumers measured only."""
    deadline = time.monotonic() + SETTLE_S
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def measure(label: str, make, total: int) -> dict:
    settle()
    fds0, threads0, py_threads0 = open_fds(), threads(), threading.active_count()
    t0 = time.monotonic()
    try:
        consumers = make()
    except Exception as exc:   # noqa: BLE001 - a figure of its own (e.g. out of sockets)
        return {"label": label, "error": repr(exc)}
    t1 = time.monotonic()
    try:
        drain(consumers, total)
        t2 = time.monotonic()
        # Connections open lazily: counted once everything was read, before closing.
        fds, nthreads = open_fds() - fds0, threads() - threads0
        conns = sum(len(c._fetcher.conns) for c in consumers)   # request threads' connections
        py_threads = threading.active_count() - py_threads0
    except KeraError as exc:   # a figure of its own: the old way runs out of sockets
        return {"label": label, "error": f"{exc} (after {len(consumers)} consumers were built)"}
    finally:
        for c in consumers:
            c.close()
    return {"label": label, "records_per_s": total / (t2 - t0), "construct_s": t1 - t0,
            "fds": fds, "threads": nthreads, "py_threads": py_threads,
            "connections": conns}


def run(streams: int, per_stream: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kera-multistream-") as tmp:
        cluster = LocalCluster(tmp, brokers=2, backups=1, log_level="WARNING")
        try:
            names = [f"ms-{i:04d}" for i in range(streams)]
            fill(cluster.bootstrap, names, per_stream)
            total = streams * per_stream
            one = measure("one Consumer of all streams",
                          lambda: [Consumer(cluster.bootstrap, names)], total)
            many = measure("one Consumer per stream",
                           lambda: [Consumer(cluster.bootstrap, n) for n in names], total)
        finally:
            cluster.stop()
    return [one, many]


def show(streams: int, per_stream: int, results: list[dict]) -> None:
    print(f"\n{streams} streams x {per_stream} records of {RECORD_BYTES} B (R=1, 1 streamlet, "
          f"{CHUNK_SIZE_BYTES} B chunks, 2 brokers)")
    for r in results:
        if "error" in r:
            print(f"  {r['label']:<30} failed: {r['error']}")
            continue
        print(f"  {r['label']:<30} {r['records_per_s']:>10,.0f} records/s   construct "
              f"{r['construct_s']:6.2f} s   {r['connections']} broker connections   +{r['fds']} fds   "
              f"+{r['py_threads']} Python threads (+{r['threads']} kernel tasks)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--records-per-stream", type=int, default=2000)
    args = ap.parse_args(argv)
    for streams in args.streams:
        show(streams, args.records_per_stream, run(streams, args.records_per_stream))


if __name__ == "__main__":
    main()
