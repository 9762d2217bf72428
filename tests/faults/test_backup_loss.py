"""A backup killed with SIGKILL: the broker re-replicates every virtual segment that had a copy
there, closed and open ones alike, until each has R-1 copies on live backups again; the
coordinator's map of which backups hold which virtual segments follows exactly."""

from __future__ import annotations

import pytest

import faultkit as fk
from faultkit import call, wait_for

from kera import Producer

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = pytest.mark.security_modes

STREAM = "lossy"
R = 3


def holdings(cluster, broker: int, epoch: int) -> dict:
    """(vlog, vseg) -> {backup id: (length, closed)} over the running backups."""
    out: dict = {}
    for i, d in enumerate(cluster.backups):
        if not d.running():
            continue
        for r in call(d.address, "list_replicas", {"broker_id": broker})["replicas"]:
            if r["vseg"] >> 32 == epoch:
                out.setdefault((r["vlog"], r["vseg"]), {})[i] = (r["length"], r["closed"])
    return out


def test_backup_loss_restores_r_copies_and_the_coordinators_map(fresh_cluster):
    cluster = fresh_cluster(
        brokers=1, backups=4, heartbeat_interval_ms=100, log_level="INFO",
        extra_broker_args=["--virtual-segment-bytes", str(32 * 1024)],
        extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=2, replication=R, segment_size_bytes=64 * 1024)
    epoch = dict(map(tuple, call(cluster.bootstrap, "recovery_status")["epochs"]))[0]
    with Producer(cluster.bootstrap, request_timeout_s=3.0) as p:
        p.send_batch(STREAM, fk.values(0, 0, 6000))
        p.flush(60)
        before = holdings(cluster, 0, epoch)
        counts = {i: sum(i in h for h in before.values()) for i in range(4)}
        victim = max(counts, key=counts.get)
        assert counts[victim] >= 2, counts
        cluster.kill_backup(victim)
        # More data while it is dead: new virtual segments avoid it, the open one loses it.
        p.send_batch(STREAM, fk.values(0, 6000, 6000))
        p.flush(60)
    wait_for(lambda: not call(cluster.bootstrap, "cluster")["backups"][victim]["alive"],
             "the backup to be declared dead")

    def restored():
        now = holdings(cluster, 0, epoch)
        if not set(before) <= set(now):
            return False
        for key, held in now.items():
            full = max(length for length, _ in held.values())
            copies = [b for b, (length, _) in held.items() if length == full]
            if len(copies) < R - 1:
                return False
        return now

    now = wait_for(restored, "every virtual segment to have R-1 copies on live backups again")
    moved = [key for key, held in before.items() if victim in held]
    print(f"backup {victim} held {len(moved)} of {len(before)} virtual segments; "
          f"{len(now)} now, each on {R - 1} live backups")

    def map_exact():
        with cluster.admin() as admin:
            entries = admin.replicas(broker_id=0)
        reported = {(vlog, vseg): set(backups) for _, vlog, vseg, backups in entries
                    if vseg >> 32 == epoch}
        actual = {}
        for key, held in holdings(cluster, 0, epoch).items():
            full = max(length for length, _ in held.values())
            actual[key] = {b for b, (length, _) in held.items() if length == full}
        return reported == actual and all(victim not in s for s in reported.values())

    wait_for(map_exact, "the coordinator's replica map to match what the backups hold")
    everything = fk.read_everything(cluster.bootstrap, STREAM, 12000)
    fk.check_exactly_once(everything, [12000], [set()], "reader")
