"""How long clients stall when a broker dies (issue 14, item 5).

Starts a local cluster (2 brokers, 2 backups, a stream of 4 streamlets at R=2), produces one
record every `--interval-ms` to every streamlet and consumes them from a second thread, then
kill -9s the broker that owns streamlet 0. Prints, for the streamlets that move, the time from
the kill to the first acknowledgement and to the first record read of a record sent after the
kill, and the coordinator's failure-detection time for comparison. Run it once per commit to
compare (single absolute times on this machine are noise: compare runs made back to back).

    python -m kera.bench.failover_stall --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.cli.local import LocalCluster
from kera.producer import Producer

STREAM = "failover"
STREAMLETS = 4
WARMUP_S = 2.0           # steady producing before the kill
AFTER_KILL_S = 20.0      # how long to wait for the moved streamlets to come back
POLL_TIMEOUT_S = 0.1


class Watch:
    """Acknowledged and consumed records per streamlet, with the time each was seen."""

    def __init__(self):
        self.lock = threading.Lock()
        self.acked: dict[int, list[tuple[float, float]]] = {}    # streamlet -> (sent, acked)
        self.read: dict[int, list[tuple[float, float]]] = {}     # streamlet -> (sent, read)

    def note(self, table: dict, streamlet: int, sent: float) -> None:
        with self.lock:
            table.setdefault(streamlet, []).append((sent, time.monotonic()))

    def first_after(self, table: dict, streamlets: list[int], kill_at: float) -> float | None:
        """Seconds from the kill to the first record sent after it seen on every streamlet."""
        with self.lock:
            firsts = [min((seen for sent, seen in table.get(sl, []) if sent > kill_at),
                          default=None) for sl in streamlets]
        return None if None in firsts else max(firsts) - kill_at


def produce(cluster: LocalCluster, watch: Watch, stop: threading.Event, interval_s: float) -> None:
    with Producer(cluster.bootstrap, linger_ms=0) as p:
        while not stop.is_set():
            sent = time.monotonic()
            for sl in range(STREAMLETS):
                value = b"%d %.6f" % (sl, sent)
                p.send(STREAM, value, streamlet=sl,
                       on_delivery=lambda err, md, sl=sl, sent=sent:
                       err is None and watch.note(watch.acked, sl, sent))
            time.sleep(interval_s)


def consume(cluster: LocalCluster, watch: Watch, stop: threading.Event) -> None:
    c = Consumer(cluster.bootstrap, STREAM, start="latest")
    try:
        while not stop.is_set():
            r = c.poll(timeout_s=POLL_TIMEOUT_S)
            if r is not None:
                watch.note(watch.read, r.streamlet, float(r.value.split()[1]))
    finally:
        c.close()


def one_run(interval_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kera-failover-") as d, \
            LocalCluster(d, brokers=2, backups=2) as cluster:
        cluster.wait_registered()
        with Admin(cluster.bootstrap) as admin:
            admin.create_stream(STREAM, streamlets=STREAMLETS, replication=2)
        with Producer(cluster.bootstrap) as p:
            info = p.stream_info(STREAM)
            owner = {sl: p._meta.address_of(info.id, sl) for sl in range(STREAMLETS)}
        moved = [sl for sl in range(STREAMLETS) if owner[sl] == owner[0]]
        victim = next(i for i, b in enumerate(cluster.brokers) if b.address == owner[0])
        watch, stop = Watch(), threading.Event()
        threads = [threading.Thread(target=produce, args=(cluster, watch, stop, interval_s)),
                   threading.Thread(target=consume, args=(cluster, watch, stop))]
        for t in threads:
            t.start()
        time.sleep(WARMUP_S)
        kill_at = time.monotonic()
        cluster.kill_broker(victim)
        deadline = kill_at + AFTER_KILL_S
        while time.monotonic() < deadline and watch.first_after(watch.read, moved, kill_at) is None:
            time.sleep(POLL_TIMEOUT_S)
        stop.set()
        for t in threads:
            t.join()
        return {"ack_s": watch.first_after(watch.acked, moved, kill_at),
                "read_s": watch.first_after(watch.read, moved, kill_at)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="clusters to start, one kill each (default 3)")
    ap.add_argument("--interval-ms", type=float, default=10.0,
                    help="pause between rounds of one record per streamlet (default 10)")
    args = ap.parse_args(argv)
    results = []
    for i in range(args.runs):
        r = one_run(args.interval_ms / 1000)
        results.append(r)
        print(f"run {i + 1}: first ack after the kill {fmt(r['ack_s'])}, "
              f"first record read {fmt(r['read_s'])}", flush=True)
    for key, what in (("ack_s", "ack"), ("read_s", "read")):
        values = [r[key] for r in results if r[key] is not None]
        if values:
            print(f"median stall to first {what}: {statistics.median(values):.2f} s "
                  f"({len(values)}/{len(results)} runs recovered within {AFTER_KILL_S:.0f} s)")


def fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
