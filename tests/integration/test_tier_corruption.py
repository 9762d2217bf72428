"""A damaged broker segment file against a real local cluster: one byte flipped on disk in a
tiered segment. With R=2 the broker reads the damaged chunk back from the backup's replica and
the consumer reads every acknowledged record exactly once; with R=1 the consumer gets a clear,
non-retriable corrupt_chunk naming the file, instead of refetching the bad bytes forever."""

from __future__ import annotations

import time

import pytest

from kera import Consumer, KeraError, Producer

from kera.net import rpc
from kera.codec.chunk import HEADER_SIZE, chunk_size

from tests.integration.test_produce_consume import (check_exactly_once_in_order, drain,
                                                    identities, values_for)

MiB = 1 << 20
KiB = 1 << 10
N = 30_000                       # 100-byte values: ~3 MiB per stream, three times the limit


def broker_stats(cluster) -> dict:
    header, _ = rpc.call(cluster.brokers[0].address, "stats", timeout_s=5.0)
    return header["stats"]


def make_stream(cluster, name: str, replication: int) -> int:
    with cluster.admin() as admin:
        admin.create_stream(name, streamlets=1, replication=replication,
                            segment_size_bytes=256 * KiB, group_segments=4)
        return admin.wait_ready(name)["id"]


def produce(cluster, name: str, producer_id: int) -> None:
    with Producer(cluster.bootstrap, producer_id=producer_id) as p:
        p.send_batch(name, values_for(producer_id, 0, N))
        p.flush()
        assert p.stats["acked"] == N and p.stats["records_failed"] == 0


def first_segment_file(cluster, sid: int):
    """The file of the stream's first segment once the broker's memory no longer holds it:
    tiered (its `.meta` committed) or, at R=1, settled (read from its file from then on)."""
    directory = cluster.data_dir / "broker-0" / "segments" / f"{sid:020d}-{0:06d}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        path = directory / f"{0:010d}-{0:06d}.seg"
        left_memory = (path.with_suffix(".meta").exists()
                       or broker_stats(cluster).get("tier_r1_settled", 0) > 0)
        if path.exists() and left_memory:
            return path
        time.sleep(0.1)
    raise AssertionError(f"no tiered segment under {directory}")


def flip_a_byte(path) -> None:
    """Damage the body of the file's second chunk (the page cache, as a failing disk would)."""
    with open(path, "r+b") as f:
        head = f.read(HEADER_SIZE)
        at = chunk_size(head, 0) + HEADER_SIZE + 10
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def cluster(fresh_cluster):
    return fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                         extra_broker_args=["--memory-limit", str(1 * MiB)])


def test_damaged_tier_file_is_served_from_the_backup_with_r2(cluster):
    sid = make_stream(cluster, "r2", 2)
    produce(cluster, "r2", 1)
    flip_a_byte(first_segment_file(cluster, sid))
    with Consumer(cluster.bootstrap, "r2") as c:
        check_exactly_once_in_order(identities(drain(c, N)), {1: N})
    s = broker_stats(cluster)
    assert s["tier_corrupt_chunks"] >= 1 and s["tier_chunks_repaired"] >= 1


def test_damaged_tier_file_is_reported_with_r1(cluster):
    sid = make_stream(cluster, "r1", 1)
    produce(cluster, "r1", 2)
    path = first_segment_file(cluster, sid)
    flip_a_byte(path)
    fetches_before = broker_stats(cluster).get("fetch_requests", 0)
    with Consumer(cluster.bootstrap, "r1") as c:
        with pytest.raises(KeraError) as err:
            drain(c, N, timeout_s=30)
    assert err.value.code == "corrupt_chunk" and not err.value.retriable
    assert str(path) in err.value.message
    s = broker_stats(cluster)
    assert s["tier_corrupt_chunks"] >= 1
    # The consumer stopped on the error: it did not refetch the damaged chunk over and over.
    assert s.get("refused_fetch", 0) == 0 and s["fetch_requests"] - fetches_before < 50
