"""kill -9 of a broker while it compacts (docs/COMPACTION.md, "Crash at any point"): its passes
run as the writes go on, so a kill at a random moment after them lands before, during or after
a pass's replication and swap; the broker taking over rebuilds each segment wholly original or
wholly rewritten from the backups, compacts on, and a consumer from the beginning then reads
exactly one record per key, its latest value, in number order. A backup killed so (the pass's
replication then goes on without it) and restarted gives the same answer, read from the broker
and then, with the broker killed too, from the backups. An R=1 broker with a data dir killed
so is restarted from its --dir instead, with the same answer. The delay prints with the
failure and reproduces the round."""

from __future__ import annotations

import random
import time

import pytest

from kera import Producer
from kera.net import rpc

from faultkit import wait_for
from tests.integration.test_compaction_passes import read_until

KiB = 1024
KEYS = 400
UPDATES = 30
WAIT_S = 90.0


def write(cluster, stream) -> dict:
    latest: dict = {}
    with Producer(cluster.bootstrap) as p:
        for u in range(UPDATES):
            keys = [b"k%04d" % k for k in range(KEYS)]
            values = [b"%d:" % u + b"v" * 60 for _ in keys]
            if u == UPDATES - 1:
                values[::40] = [None] * len(values[::40])   # some keys end deleted
            for key, value in zip(keys, values):
                p.send(stream, value, key=key)
            latest.update(zip(keys, values))
        pad = [b"pad%05d" % i for i in range(1200)]   # keys once each: the updates finish
        p.send_batch(stream, [b"p" * 60] * len(pad), keys=pad)
        latest.update((k, b"p" * 60) for k in pad)
        p.flush()
    return latest


def kill_owner_then_read(cluster, stream: str, owner: str, latest: dict) -> None:
    """kill -9 of the owner; the stream, failed over, gives each key's latest value once."""
    cluster.kill_broker([d.address for d in cluster.brokers].index(owner))
    with cluster.admin() as admin:
        admin.wait_ready(stream, 30.0)
    got = read_until(cluster, stream, latest, time.monotonic() + WAIT_S)
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    assert [r.number for r in got] == sorted(r.number for r in got)


def compacted_stream(cluster, stream: str) -> tuple[dict, str]:
    """An R=2 compacted stream written with `write`: (each key's latest value, its owner)."""
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=1, replication=2, segment_size_bytes=32 * KiB,
                            group_segments=2, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01)
    latest = write(cluster, stream)
    with Producer(cluster.bootstrap) as p:
        return latest, p._meta.address_of(p.stream_info(stream).id, 0)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_kill_9_while_compacting_keeps_each_key_latest_value(fresh_cluster, seed):
    delay_s = random.Random(seed).uniform(0.0, 2.5)   # passes run every second
    print(f"seed {seed}: kill {delay_s:.2f} s after the writes")
    cluster = fresh_cluster(brokers=2, backups=2, log_level="WARNING")
    stream = f"compact-kill-{seed}"
    latest, owner = compacted_stream(cluster, stream)
    time.sleep(delay_s)
    passes = rpc.call(owner, "stats", timeout_s=5.0)[0]["stats"]["compaction_passes"]
    print(f"passes before the kill: {passes}")
    kill_owner_then_read(cluster, stream, owner, latest)


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kill_9_of_a_backup_while_compacting_keeps_each_key_latest_value(fresh_cluster, seed):
    delay_s = random.Random(seed).uniform(0.0, 2.5)
    print(f"seed {seed}: backup killed {delay_s:.2f} s after the writes")
    cluster = fresh_cluster(brokers=2, backups=2, log_level="WARNING", heartbeat_interval_ms=100,
                            extra_coordinator_args=["--heartbeat-missed-max", "30"])
    stream = f"compact-backup-kill-{seed}"
    latest, owner = compacted_stream(cluster, stream)
    time.sleep(delay_s)
    victim = random.Random(seed).randrange(len(cluster.backups))
    cluster.kill_backup(victim)
    # Declared dead, its replicas are re-replicated (passes go on meanwhile); back, it serves
    # again: then the broker's kill below is a second, separate fault.
    wait_for(lambda: not rpc.call(cluster.bootstrap, "cluster", timeout_s=2.0)[0]["backups"]
             [victim]["alive"], f"backup {victim} to be declared dead")
    cluster.restart_backup(victim)
    got = read_until(cluster, stream, latest, time.monotonic() + WAIT_S)
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    passes = rpc.call(owner, "stats", timeout_s=5.0)[0]["stats"]["compaction_passes"]
    print(f"passes before the broker kill: {passes}")
    kill_owner_then_read(cluster, stream, owner, latest)


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_9_of_an_r1_broker_while_compacting_restarts_from_its_dir(fresh_cluster, seed):
    """R=1 with a data dir: the passes replace segment files (`.cleaned`, `.swap`, rename); a
    kill at a seeded moment lands before, during or after one, and the restart from the same
    --dir finishes or drops each rewrite whole (kera.broker.tier_files)."""
    delay_s = random.Random(seed).uniform(0.0, 2.5)
    print(f"seed {seed}: kill {delay_s:.2f} s after the writes")
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    stream = f"compact-r1-kill-{seed}"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=1, replication=1, segment_size_bytes=32 * KiB,
                            group_segments=2, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01)
    latest = write(cluster, stream)
    time.sleep(delay_s)
    cluster.kill_broker(0)
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready(stream, 30.0)
    got = read_until(cluster, stream, latest, time.monotonic() + WAIT_S)
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    assert [r.number for r in got] == sorted(r.number for r in got)
