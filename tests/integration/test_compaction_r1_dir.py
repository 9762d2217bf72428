"""An R=1 compacted stream on a broker with a data dir (docs/COMPACTION.md): its segments live in
their files (written before each ack), so its passes replace those files (`.cleaned`, the
`.swap` commit, the rename); a kill -9 of the broker right after a pass swapped, with later
passes possibly under way, then a restart from the same --dir: the broker serves exactly each
key's latest value once, in number order, and no temporary file of a rewrite is left."""

from __future__ import annotations

import time

from kera.net import rpc

from tests.integration.test_compaction_passes import (WAIT_S, KiB, assert_latest_once_in_order,
                                                      read_until, write)

POLL_S = 0.05


def wait_for_pass(address: str, deadline: float) -> int:
    while True:
        passes = rpc.call(address, "stats", timeout_s=5.0)[0]["stats"]["compaction_passes"]
        if passes or time.monotonic() > deadline:
            return passes
        time.sleep(POLL_S)


def test_an_r1_broker_killed_after_its_passes_restarts_compacted(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    stream = "compacted-r1"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=1, replication=1, segment_size_bytes=32 * KiB,
                            group_segments=2, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01)
    latest = write(cluster, stream)
    deadline = time.monotonic() + WAIT_S
    assert wait_for_pass(cluster.brokers[0].address, deadline), "no pass ran"
    cluster.kill_broker(0)
    segments = cluster.data_dir / "broker-0" / "segments"
    # A swap follows its rewrite's commit (`.swap`), then the rename gives it a `.meta` (an R=1
    # segment gets none otherwise here: no memory limit, no orderly stop).
    committed = [p for p in segments.rglob("*") if p.suffix in (".swap", ".meta")]
    assert committed, "a pass swapped, yet no rewrite of a segment file was committed"
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready(stream, 30.0)
    got = read_until(cluster, stream, latest, deadline)
    assert_latest_once_in_order(got, latest)
    assert not [p for p in segments.rglob("*") if p.suffix in (".cleaned", ".swap", ".tmp")]
