"""Retention against a real local cluster: groups deleted by time and by size, backups freeing
the replicas nothing references any more, a consumer behind retention getting a clear error,
an `earliest` consumer starting at what is kept, and `alter_stream` / `kera stream alter`."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kera import Consumer, Producer

from kera.net import rpc
from kera.errors import OffsetOutOfRange
from kera.codec.position import Position

from tests.integration.test_produce_consume import identities, values_for
from tests.integration.test_tiering import drain_idle

KiB = 1024
_names = iter(range(10**6))


@pytest.fixture(scope="module")
def cluster(local_cluster):
    # Small virtual segments, so a stream's data spans several (each dropped on its own).
    return local_cluster(brokers=1, backups=1, log_level="WARNING",
                         extra_broker_args=["--virtual-segment-bytes", str(256 * KiB)])



def new_stream(cluster, **kw):
    name = f"ret-{next(_names)}"
    kw.setdefault("segment_size_bytes", 64 * KiB)
    kw.setdefault("group_segments", 1)
    kw.setdefault("replication", 2)
    with cluster.admin() as admin:
        return admin.create_stream(name, **kw)


def produce(cluster, stream, n, producer_id=0, start=0):
    with Producer(cluster.bootstrap, producer_id=producer_id) as p:
        p.send_batch(stream, values_for(producer_id, start, n))
        p.flush()
        assert p.stats["acked"] == n


def call(address, op, **fields):
    header, _ = rpc.call(address, op, fields, timeout_s=5.0)
    return header


def retention_passes(cluster) -> int:
    with cluster.admin() as admin:
        return sum(s.get("retention_passes", 0) for s in admin.stats()["brokers"].values())


def passes_done(cluster, n: int) -> None:
    """Wait until the brokers ran `n` more retention passes (each sees every stream)."""
    start = retention_passes(cluster)
    wait_for(lambda: retention_passes(cluster) >= start + n, f"{n} retention passes")


def offsets(cluster, desc, sl=0):
    return call(cluster.brokers[0].address, "offsets", sid=desc["id"], sl=sl)


def wait_for(cond, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def backup_replicas(cluster) -> list:
    return call(cluster.backups[0].address, "list_replicas", broker_id=0)["replicas"]


def test_time_retention_deletes_groups_and_frees_backup_replicas(cluster):
    desc = new_stream(cluster, retention_ms=1500)
    name = desc["name"]
    produce(cluster, name, 20_000)                      # ~2 MiB: ~30 groups of 64 KiB
    before = offsets(cluster, desc)
    assert before["first_group"] == 0 and len(before["groups"]) > 10
    held = len(backup_replicas(cluster))
    assert held > 0
    # After the retention time every group (the open one closed by time) is deleted...
    after = wait_for(lambda: (o := offsets(cluster, desc)) and not o["groups"] and o,
                     "every group to expire")
    assert after["first_group"] == len(before["groups"])
    # ... and the backups free the replicas that referenced them.
    wait_for(lambda: len(backup_replicas(cluster)) < held, "backup replicas to be dropped")
    stats = call(cluster.backups[0].address, "stats")["stats"]
    assert stats["replicas_dropped"] > 0
    # New data goes to new groups, numbered after the deleted ones; `earliest` starts there.
    produce(cluster, name, 1_000, producer_id=1)
    with Consumer(cluster.bootstrap, name, start="earliest") as c:
        recs = identities(drain_idle(c, idle_s=1.0))
    assert len(recs) == 1_000 and (recs["p"] == 1).all()
    assert recs["g"].min() >= after["first_group"]


def test_consumer_behind_retention_gets_a_clear_error(cluster):
    desc = new_stream(cluster, retention_ms=1000)
    name = desc["name"]
    produce(cluster, name, 5_000)
    wait_for(lambda: offsets(cluster, desc)["first_group"] > 0, "the first groups to expire")
    with Consumer(cluster.bootstrap, name, start=[Position(name, 0, 0, 0)]) as c:
        with pytest.raises(OffsetOutOfRange) as info:
            for _ in range(100):
                c.poll_batch(timeout_s=0.2)
    message = str(info.value)
    assert "no longer available" in message and "retention" in message and name in message


def test_size_retention_keeps_about_the_limit(cluster):
    desc = new_stream(cluster, retention_bytes=256 * KiB)
    name = desc["name"]
    produce(cluster, name, 30_000)                      # ~3 MiB
    # 64 KiB groups: at least the limit is kept, and not more than one group beyond it (once
    # every group is durable and closed: a pass deletes only finished groups).
    o = wait_for(lambda: (o := offsets(cluster, desc))["first_group"] > 0
                 and len(o["groups"]) <= 6 and o, "size retention")
    assert len(o["groups"]) >= 4, o

    with Consumer(cluster.bootstrap, name) as c:
        recs = identities(drain_idle(c, idle_s=1.0))
    # What is read is the newest records, contiguous, ending with the last one sent.
    seqs = np.sort(recs["s"])
    assert seqs[-1] == 29_999 and (np.diff(seqs.astype(np.int64)) == 1).all()
    assert 2_000 <= len(recs) <= 4_000


def test_alter_stream_applies_retention_to_a_stream(cluster):
    desc = new_stream(cluster)
    name = desc["name"]
    assert desc["retention_ms"] == 0 and desc["retention_bytes"] == 0
    produce(cluster, name, 10_000)
    passes = retention_passes(cluster)
    wait_for(lambda: retention_passes(cluster) >= passes + 2, "two retention passes")
    assert offsets(cluster, desc)["first_group"] == 0    # nothing deleted without retention
    from kera.cli.main import main
    assert main(["stream", "alter", name, "--retention-bytes", "128KiB",
                 "--bootstrap", cluster.bootstrap]) == 0
    with cluster.admin() as admin:
        assert admin.describe_stream(name)["retention_bytes"] == 128 * KiB
    wait_for(lambda: offsets(cluster, desc)["first_group"] > 0, "the altered retention")


def test_retain_until_consumed_keeps_what_a_group_has_not_committed(cluster):
    """Pravega's consumption-based retention: with retention_ms set, groups past their age
    stay until every consumer group of the stream committed past them; then they go."""
    desc = new_stream(cluster, retention_ms=500, retain_until_consumed=True, streamlets=1)
    name = desc["name"]
    produce(cluster, name, 10_000)                      # ~1 MiB: ~15 groups of 64 KiB
    groups = offsets(cluster, desc)["groups"]
    assert len(groups) > 5
    with cluster.admin() as admin:                      # a consumer group that read nothing
        admin._call("group_reset", {"group": "slow-readers", "streams": [name],
                                    "positions": [[name, 0, [[0, 0, 0]]]]})
    time.sleep(0.6)                                     # every group now past retention_ms
    passes_done(cluster, 2)                             # ...and retention has looked twice since
    assert offsets(cluster, desc)["first_group"] == 0, "deleted before it was consumed"
    # The group commits half-way: the groups below its position go, the rest stay.
    half = len(groups) // 2
    with cluster.admin() as admin:
        admin._call("group_reset", {"group": "slow-readers", "streams": [name],
                                    "positions": [[name, 0, [[half, 0, 0]]]]})
    kept = wait_for(lambda: (o := offsets(cluster, desc))["first_group"] == half and o,
                    "the consumed groups to be deleted")
    passes_done(cluster, 2)
    assert offsets(cluster, desc)["first_group"] == half, "deleted what was not consumed"
    assert len(kept["groups"]) >= len(groups) - half - 1
