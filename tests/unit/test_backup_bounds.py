"""Bounds of the backup's sans-IO core: empty writes create nothing, replica counts per broker
and in all, bytes on disk (--disk-limit). A refused write stores nothing."""

import pytest

from kera.codec import chunk
from kera.backup.store import REPLICA_OVERHEAD_BYTES, ReplicaStore, StoreConfig
from kera.errors import StorageError


def make_chunk(seq: int, size: int = 100) -> bytes:
    return chunk.encode(1, seq, 5, 0, [b"x" * size])


def test_empty_writes_with_fresh_keys_create_nothing():
    store = ReplicaStore()
    for vseg in range(10_000):
        for durability in ("memory", "disk"):
            assert store.replicate((3, 0, vseg), 0, [], durability, vseg % 2 == 0, None, 0.0) == 0
    assert store.replicas == {} and store.replicas_per_broker == {} and store.disk_bytes == 0
    assert store.take_flush_jobs(0.0) == []      # nothing for the flusher to create on disk
    assert store.stats()["empty_writes"] == 20_000


def test_replicas_per_broker_bounded_and_refusal_stores_nothing():
    store = ReplicaStore(StoreConfig(replicas_per_broker_max=3, replicas_max=100))
    for vseg in range(3):
        store.replicate((1, 0, vseg), 0, [make_chunk(vseg)], "memory", False, None, 0.0)
    with pytest.raises(StorageError, match="replicas of broker 1.*place .* elsewhere"):
        store.replicate((1, 0, 9), 0, [make_chunk(9)], "memory", False, None, 0.0)
    assert (1, 0, 9) not in store.replicas and store.replicas_per_broker == {1: 3}
    # Another broker id is not limited by broker 1's count; appending to a held replica is fine.
    store.replicate((2, 0, 0), 0, [make_chunk(0)], "memory", False, None, 0.0)
    length = store.replicas[(1, 0, 0)].length
    assert store.replicate((1, 0, 0), length, [make_chunk(5)], "memory", False, None, 0.0) > length
    # A dropped replica frees its place.
    store.drop((1, 0, 1))
    store.replicate((1, 0, 9), 0, [make_chunk(9)], "memory", False, None, 0.0)
    assert store.replicas_per_broker == {1: 3, 2: 1}


def test_replicas_in_all_bounded():
    store = ReplicaStore(StoreConfig(replicas_max=2))
    store.replicate((1, 0, 0), 0, [make_chunk(0)], "memory", False, None, 0.0)
    store.replicate((2, 0, 0), 0, [make_chunk(0)], "memory", False, None, 0.0)
    with pytest.raises(StorageError, match="holds 2 replicas, the most it may"):
        store.replicate((3, 0, 0), 0, [make_chunk(0)], "memory", False, None, 0.0)
    assert len(store.replicas) == 2 and store.stats()["replicas_refused"] == 1


def test_per_broker_bound_cannot_exceed_what_list_replicas_answers():
    from kera.backup.store import REPLICAS_PER_BROKER_MAX
    with pytest.raises(ValueError, match="list_replicas"):
        StoreConfig(replicas_per_broker_max=REPLICAS_PER_BROKER_MAX + 1).check()


def test_list_replicas_reply_at_the_per_broker_bound_fits_the_header_limit():
    from kera.codec import wire
    from kera.backup.store import REPLICAS_PER_BROKER_MAX
    store = ReplicaStore()
    big = 2**63 - 1
    for n in range(REPLICAS_PER_BROKER_MAX):
        store.replicate((2**32 - 1, 2**32 - 1, big - n), 0, [make_chunk(n, 1)], "memory", True,
                        None, 0.0)
    reply = wire.ok_reply(2**63 - 1, {"replicas": store.list_replicas(2**32 - 1)})
    assert len(reply) < wire.MAX_HEADER_BYTES


def test_disk_limit_refuses_whole_writes_and_frees_on_drop():
    one = make_chunk(0, 1000)
    limit = 2 * (REPLICA_OVERHEAD_BYTES + len(one)) + len(one) // 2
    store = ReplicaStore(StoreConfig(disk_limit_bytes=limit))
    store.replicate((1, 0, 0), 0, [one], "memory", False, None, 0.0)
    store.replicate((1, 0, 1), 0, [one], "memory", False, None, 0.0)
    used = store.disk_bytes
    with pytest.raises(StorageError, match="--disk-limit"):
        store.replicate((1, 0, 0), len(one), [make_chunk(1, 1000)], "memory", False, None, 0.0)
    with pytest.raises(StorageError, match="--disk-limit"):
        store.replicate((1, 0, 2), 0, [one], "memory", False, None, 0.0)
    # Nothing of the refused writes is stored: no partial replica, lengths unchanged.
    assert store.disk_bytes == used and (1, 0, 2) not in store.replicas
    assert store.replicas[(1, 0, 0)].length == len(one)
    store.drop((1, 0, 1))
    store.replicate((1, 0, 2), 0, [one], "memory", False, None, 0.0)
    assert store.disk_bytes == used


def test_disk_bytes_count_loaded_replicas():
    from kera.backup.meta import Meta
    store = ReplicaStore()
    store.load(Meta(4, 0, 7, 5000, True))
    assert store.disk_bytes == 5000 + REPLICA_OVERHEAD_BYTES and store.replicas_per_broker == {4: 1}
