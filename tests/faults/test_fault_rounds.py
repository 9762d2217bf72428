"""Several rounds of kill -9 under continuous produce and consume with R=3: a broker, a backup
or the coordinator, one at a time, at random moments. Afterwards every acknowledged record is
read exactly once and in per-producer order, and nothing unacknowledged is read twice: by the
consumer that ran through the faults, and by a fresh one reading everything back, whose record
numbers are dense per slot (kera.broker.streamlet) however often the streamlets failed over."""

from __future__ import annotations

import time

import pytest

import faultkit as fk
from faultkit import call, wait_for

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = pytest.mark.security_modes

STREAM = "faults"
ROUNDS = ("broker", "backup", "coordinator") * 2


def status(cluster) -> dict:
    return call(cluster.bootstrap, "recovery_status")


def healthy(cluster) -> None:
    """Every daemon registered and alive, no streamlet left recovering."""
    cluster.wait_registered(timeout_s=fk.WAIT_S)
    wait_for(lambda: status(cluster)["recovering"] == [], "every streamlet recovered")


def kill_broker(cluster, i: int, rng) -> str:
    # A broker owning streamlets (failovers concentrate them: a restarted broker is empty).
    placement = call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]["placement"]
    i = rng.choice(sorted(set(placement)))
    epochs = dict(map(tuple, status(cluster)["epochs"]))
    cluster.kill_broker(i)
    if rng.random() < 0.5:
        # Back at once: its registration is what tells the coordinator it died.
        cluster.restart_broker(i)
        how = "restarted at once"
    else:
        wait_for(lambda: [i, epochs[i]] in status(cluster)["failed"],
                 f"broker {i} to be declared dead and failed over")
        cluster.restart_broker(i)
        how = "restarted after its failover"
    return f"broker {i} {how}"


def kill_backup(cluster, i: int, rng) -> str:
    cluster.kill_backup(i)
    wait_for(lambda: not call(cluster.bootstrap, "cluster")["backups"][i]["alive"],
             f"backup {i} to be declared dead")
    time.sleep(rng.uniform(0.0, 1.0))   # brokers re-replicate what it held meanwhile
    cluster.restart_backup(i)
    return f"backup {i} restarted after it was declared dead"


def kill_coordinator(cluster, i: int, rng) -> str:
    cluster.kill_coordinator()
    time.sleep(rng.uniform(0.2, 1.5))
    cluster.restart_coordinator()
    return "coordinator restarted"


def test_kill_nine_rounds_keep_every_acknowledged_record_exactly_once(fresh_cluster):
    rng = fk.seeded("fault rounds")
    cluster = fresh_cluster(
        brokers=3, backups=3, heartbeat_interval_ms=100, virtual_logs=2, log_level="INFO",
        extra_broker_args=["--virtual-segment-bytes", str(128 * 1024)],
        extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=6, active_groups=2, replication=3,
                            segment_size_bytes=64 * 1024, group_segments=4)
    work = fk.Workload(cluster.bootstrap, STREAM, producers=2).start()
    kinds = list(ROUNDS)
    rng.shuffle(kinds)
    kill = {"broker": kill_broker, "backup": kill_backup, "coordinator": kill_coordinator}
    for n, kind in enumerate(kinds):
        time.sleep(rng.uniform(0.3, 1.5))   # a random moment of the workload
        victim = rng.randrange(3)
        started = time.monotonic()
        how = kill[kind](cluster, victim, rng)
        healthy(cluster)
        print(f"round {n}: kill -9, {how}; healthy after "
              f"{time.monotonic() - started:.1f} s; sent {work.sent}, acknowledged {work.acked}")
    time.sleep(0.5)
    work.stop_producing()
    assert not work.errors, work.errors
    assert min(work.acked) > 0
    work.drain()
    assert not work.errors, work.errors
    fk.check_exactly_once(work.read, work.acked, work.uncertain, "consumer through the faults")
    numbered: list = []
    everything = fk.read_everything(cluster.bootstrap, STREAM, sum(work.acked),
                                    numbered=(numbered, 2))
    fk.check_exactly_once(everything, work.acked, work.uncertain, "fresh consumer")
    fk.check_numbers_dense(numbered, "fresh consumer")
    st = status(cluster)
    assert st["failed"] and st["recovering"] == []   # failovers happened, all recovered
