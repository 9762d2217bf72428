"""Issue 38's compaction test on real daemons: a compacted R=2 stream whose keys are each
updated many times, a few hundred then deleted; after the broker's background passes, a
consumer from the beginning reads exactly the last value of each live key, in number order,
the deleted keys gone once past delete.retention.ms (no write after the deletes is needed:
a tombstone's expiry makes a pass due), the broker's memory and the backups' disk shrunk
accordingly, and `kera stats` shows the passes.

The issue's size (10,000 keys x 100 updates: 1,000,000 records) runs under `make test-slow`;
the same body at 500 keys x 20 runs in `make test`."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import pytest

from kera import Producer
from kera.cli.local import free_port
from kera.net import rpc

from tests.integration.test_compaction_passes import read_from_start

KiB = 1024
MiB = 1024 * KiB
DELETE_RETENTION_MS = 3000   # tombstones outlive their first pass by this much
BATCH_RECORDS = 5000         # records per send_batch
STATS_TIMEOUT_S = 5.0
CLI_TIMEOUT_S = 60.0


class Scale:
    def __init__(self, keys, updates, deleted, value_bytes, segment_bytes, wait_s):
        self.keys, self.updates, self.deleted = keys, updates, deleted
        self.value = b"v" * value_bytes
        self.segment_bytes = segment_bytes
        # Keys written once after the deletes, enough to fill a group (2 segments), so the
        # group holding the last updates and the deletes finishes and is compacted.
        self.padding = 3 * segment_bytes // (value_bytes + 40)
        self.wait_s = wait_s

    def key(self, k: int) -> bytes:
        return b"key%06d" % k


SCALES = [
    pytest.param(Scale(500, 20, 50, 80, 32 * KiB, 90.0), id="500x20"),
    pytest.param(Scale(10_000, 100, 300, 16, 512 * KiB, 900.0), id="10000x100",
                 marks=pytest.mark.slow),
]


def write(cluster, stream: str, s: Scale) -> dict:
    """Every update in key order, round after round, then the deletes and the padding;
    returns each live key's latest value."""
    latest: dict = {}
    keys = [s.key(k) for k in range(s.keys)]
    with Producer(cluster.bootstrap) as p:
        for u in range(s.updates):
            values = [b"%d:" % u + s.value for _ in keys]
            for i in range(0, len(keys), BATCH_RECORDS):
                p.send_batch(stream, values[i:i + BATCH_RECORDS], keys=keys[i:i + BATCH_RECORDS])
            latest.update(zip(keys, values))
        for k in range(0, s.keys, s.keys // s.deleted):
            p.send(stream, None, key=s.key(k))
            del latest[s.key(k)]
        pad = [b"pad%07d" % i for i in range(s.padding)]
        for i in range(0, len(pad), BATCH_RECORDS):
            p.send_batch(stream, [s.value] * len(pad[i:i + BATCH_RECORDS]),
                         keys=pad[i:i + BATCH_RECORDS])
        latest.update((k, s.value) for k in pad)
        p.flush()
    return latest


def stats(address: str) -> dict:
    return rpc.call(address, "stats", timeout_s=STATS_TIMEOUT_S)[0]["stats"]


def flushed_disk_bytes(cluster, deadline: float) -> int:
    """The backups' disk use once they hold nothing unflushed."""
    while True:
        per = [stats(b.address) for b in cluster.backups]
        if all(s["unflushed_bytes"] == 0 for s in per) or time.monotonic() > deadline:
            return sum(s["disk_bytes"] for s in per)
        time.sleep(0.2)


@pytest.mark.parametrize("scale", SCALES)
def test_compaction_keeps_the_last_value_of_each_live_key(fresh_cluster, scale):
    # Virtual segments of two stream segments: a backup drops a replica only once every
    # segment it references is released, so the disk shrinks by whole virtual segments.
    vseg_bytes, metrics_port = 2 * scale.segment_bytes, free_port()
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                            extra_broker_args=("--virtual-segment-bytes", str(vseg_bytes),
                                               "--metrics-port", str(metrics_port),
                                               "--metrics-stream-labels"))
    stream = "compacted-scale"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=1, replication=2, group_segments=2,
                            segment_size_bytes=scale.segment_bytes, cleanup_policy="compact",
                            min_cleanable_dirty_ratio=0.01,
                            delete_retention_ms=DELETE_RETENTION_MS)
    broker = cluster.brokers[0].address
    written_at = time.monotonic()
    latest = write(cluster, stream, scale)
    deadline = time.monotonic() + scale.wait_s
    memory_written = stats(broker)["memory_bytes"]
    disk_written = flushed_disk_bytes(cluster, deadline)
    while True:   # passes run meanwhile: until exactly the live keys are left
        got = read_from_start(cluster, stream)
        if len(got) == len(latest) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert {r.key: r.value for r in got} == latest and len(got) == len(latest)
    assert [r.number for r in got] == sorted(r.number for r in got)
    assert time.monotonic() - written_at >= DELETE_RETENTION_MS / 1000   # deletes past it
    after = stats(broker)
    compacted = after["compaction_streams"][stream]
    assert compacted["passes"] >= 2 and compacted["bytes_after"] < compacted["bytes_before"]
    assert after["memory_bytes"] < memory_written / 2
    assert flushed_disk_bytes(cluster, deadline) < disk_written / 2
    shown = kera_stats_row(cluster, stream)
    assert shown[:2] == ["0.000", "0 B"] and int(shown[3]) == compacted["passes"]
    exported = compaction_metrics(metrics_port, stream)
    while exported["passes"] < compacted["passes"] and time.monotonic() < deadline:
        time.sleep(0.2)   # the gauges are refreshed every COMPACTION_CHECK_S
        exported = compaction_metrics(metrics_port, stream)
    assert exported["passes"] == compacted["passes"] and exported["dirty_ratio"] == 0.0
    assert 0 < exported["bytes_after"] < exported["bytes_before"] and exported["seconds"] > 0


def kera_stats_row(cluster, stream: str) -> list[str]:
    """The stream's cells in `kera stats`' compacted streams table, after its name: dirty
    ratio, dirty, clean, passes, bytes before, bytes after, pass time."""
    out = subprocess.run([sys.executable, "-m", "kera", "stats", "--bootstrap", cluster.bootstrap],
                         capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("== compacted streams ==")[1]
    return next(re.split(r"\s{2,}", line.strip())[1:] for line in table.splitlines()
                if line.startswith(stream + " "))


def compaction_metrics(port: int, stream: str) -> dict[str, float]:
    """The broker's per-stream compaction gauges for `stream` (Prometheus text)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^kera_broker_compaction_([a-z_]+)\{stream="%s"\} (\S+)$' % re.escape(stream), text,
        re.M)}
