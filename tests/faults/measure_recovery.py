"""Recovery time of a broker holding about 1 GiB of acknowledged data with R=3 (not a test).

    python tests/faults/measure_recovery.py [--gib 1.0] [--brokers 3] [--dir DIR]

Starts a local cluster (brokers, 3 backups), fills the streamlets of broker 0 with `--gib` of
acknowledged records (R=3), kills broker 0 with SIGKILL and times, on the machine's monotonic
clock (shared by every process here):

* detection: kill -> the coordinator declares it dead and moves its streamlets;
* reading replicas: the new owners wait for the backups (listing, then paged reads), i.e. the
  reading phase's wall time minus the loop time spent replaying;
* replay: the new owners' loop time verifying and placing the recovered chunks and installing
  the streamlets (kera.broker.recovery_service `recovery_replay_s`);
* serving reads again: kill -> every one of the dead broker's streamlets answers a fetch;
* re-replication: until the recovered data is on R-1 backups under the new owners and the
  coordinator has cleared every recovery marker.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np

from kera import Producer

from kera.net import rpc
from kera.errors import KeraError
from kera.cli.local import LocalCluster

VALUE_BYTES = 1000
STREAM = "big"


def call(address, op, fields=None, timeout_s=5.0):
    return rpc.call(address, op, fields, timeout_s=timeout_s)[0]


def wait(pred, what, timeout_s=600.0, poll_s=0.005):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            v = pred()
            if v:
                return v
        except KeraError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(poll_s)


def fill(cluster, streamlets, total_bytes):
    """Acknowledged records into `streamlets`, `total_bytes` of values in all."""
    per = total_bytes // len(streamlets)
    batch = 4096                                      # records per send (about 4 MiB)
    block = np.random.default_rng(1).integers(0, 255, (batch, VALUE_BYTES), dtype=np.uint8)
    started = time.monotonic()
    sent = {sl: 0 for sl in streamlets}

    def one(sl):
        with Producer(cluster.bootstrap, request_timeout_s=30.0, in_flight_per_broker=8) as p:
            seq = 0
            while sent[sl] * VALUE_BYTES < per:
                seq = p.send_batch_as(STREAM, sl, block, producer_id=1000 + sl, sequence_start=seq)
                sent[sl] += batch
            p.flush(600)

    threads = [threading.Thread(target=one, args=(sl,)) for sl in streamlets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    nbytes = sum(sent.values()) * VALUE_BYTES
    print(f"loaded {nbytes / 2**30:.2f} GiB ({sum(sent.values())} records) into streamlets "
          f"{streamlets} in {took:.1f} s ({nbytes / took / 2**20:.0f} MiB/s, R=3)")
    return sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--brokers", type=int, default=3)
    ap.add_argument("--streamlets-per-broker", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    data_dir = args.dir or tempfile.mkdtemp(prefix="kera-measure-")
    n = args.brokers
    with LocalCluster(data_dir, brokers=n, backups=3, heartbeat_interval_ms=100,
                      log_level="WARNING") as cluster:
        with cluster.admin(timeout_s=30) as admin:
            d = admin.create_stream(STREAM, streamlets=n * args.streamlets_per_broker,
                                    replication=3)
        victim = 0
        mine = [sl for sl, b in enumerate(d["placement"]) if b == victim]
        sent = fill(cluster, mine, int(args.gib * 2**30))
        held = call(cluster.brokers[victim].address, "stats")["stats"]
        print(f"broker {victim} holds {held['bytes_appended'] / 2**30:.2f} GiB in "
              f"{held['chunks_appended']} chunks")
        time.sleep(2.0)   # let the backups' flushers settle

        print(f"load average before the kill: {os.getloadavg()[0]:.1f} (2 cores)")
        t_kill = time.monotonic()
        cluster.kill_broker(victim)
        st = wait(lambda: (s := call(cluster.bootstrap, "recovery_status"))["last_failover"]
                  .get("broker_id") == victim and s, "the failover")
        t_detect = st["last_failover"]["at_s"]
        desc = call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]
        owners = {sl: desc["brokers"][str(desc["placement"][sl])] for sl in mine}

        def serving():
            for sl, address in owners.items():
                header = call(address, "fetch", {"reads": [[desc["id"], sl, {}, 1]]})
                if header["results"][0][0] is not None:
                    return False
            return True

        wait(serving, "the recovered streamlets to serve reads")
        t_serving = time.monotonic()
        wait(lambda: call(cluster.bootstrap, "recovery_status")["recovering"] == [],
             "re-replication and the recovered reports")
        t_done = time.monotonic()

        jobs = []
        for address in sorted(set(owners.values())):
            s = call(address, "stats")["stats"]
            jobs.append((address, s))
        # Completeness: every record of the dead broker's streamlets is on its new owner.
        for sl, address in owners.items():
            groups = call(address, "offsets", {"sid": desc["id"], "sl": sl})["groups"]
            assert sum(g[3] for g in groups) == sent[sl], (sl, groups, sent[sl])

        print(f"\nkill -> declared dead and streamlets moved (detection): {t_detect - t_kill:6.2f} s")
        for address, s in jobs:
            start, listed, read = (s["recovery_last_started_s"], s["recovery_last_listed_s"],
                                   s["recovery_last_read_s"])
            replay = s["recovery_replay_s"]
            replay_cpu = s["recovery_replay_cpu_s"]
            print(f"new owner {address}: {s['recovery_bytes'] / 2**30:.2f} GiB, "
                  f"{s['recovery_chunks']} chunks")
            print(f"  metadata reaches it:              {start - t_detect:6.2f} s")
            print(f"  listing replicas:                 {listed - start:6.2f} s")
            print(f"  reading replicas (waiting):       {read - listed - replay:6.2f} s")
            print(f"  replay (verify, place, install):  {replay:6.2f} s "
                  f"({replay_cpu:.2f} s of CPU, {replay_cpu / s['recovery_chunks'] * 1e6:.0f} µs "
                  f"per chunk)")
        print(f"kill -> every streamlet serving reads again:           {t_serving - t_kill:6.2f} s")
        print(f"kill -> re-replicated to R copies, markers cleared:     {t_done - t_kill:6.2f} s")
    print(f"(data and logs in {data_dir})")


if __name__ == "__main__":
    main()
