"""The broker's bounds on what produce requests can make it hold: a segment's mapped capacity
counts against the memory limit, segments in memory and groups per streamlet are bounded; over
a bound a chunk is refused before anything of it is stored (retriable `throttled`, or
non-retriable when nothing can ever make room); a request none of whose chunks could be stored
is refused whole."""

import pytest

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.broker.tier import TierConfig
from kera.errors import StorageError, Throttled

ME = 5
KiB = 1024


def desc(*, Q=1, G=4, seg=64 * KiB, retention_ms=0):
    return {"name": "s", "id": 1, "streamlets": 1, "active_groups": Q, "replication": 1,
            "group_segments": G, "segment_size_bytes": seg, "durability": "memory",
            "placement": [ME], "brokers": {}, "version": 1, "ready": True,
            "retention_ms": retention_ms}


def broker(stream, limit=0, **cfg):
    b = Broker("n", BrokerConfig(tier=TierConfig(memory_limit_bytes=limit), **cfg), broker_id=ME)
    b.apply_metadata([stream], 1)
    return b


def tiny(producer, seq=0):
    return chunk.encode(producer, seq, 1, 0, [b"x"])


def mapped(b) -> int:
    """What the broker really maps: the capacity of every segment holding a buffer."""
    groups = b.streams[1].streamlets[0].groups
    return sum(s.capacity_bytes for g in groups for s in g.segments if s.buf is not None)


def test_many_tiny_groups_are_throttled_before_mapped_bytes_pass_the_limit():
    limit = 1024 * KiB
    b = broker(desc(Q=64, seg=64 * KiB), limit)          # no data dir: nothing can go to disk
    throttled = 0
    for p in range(64):                                   # one tiny chunk per slot
        try:
            b.produce(p, [tiny(p)], 0.0)
        except Throttled:
            throttled += 1
        assert mapped(b) <= limit and b.tier.memory_bytes == mapped(b)
    assert b.stats()["chunks_appended"] == 16 == limit // (64 * KiB)
    assert throttled == 48
    # Chunks into the open segments still go: they map nothing new.
    assert isinstance(b.produce("more", [tiny(0, 1)], 0.0)[0][0], int)


def test_chunks_over_the_budget_are_refused_and_not_stored():
    b = broker(desc(Q=4, seg=64 * KiB), 128 * KiB)
    b.produce("a", [tiny(0)], 0.0)                        # one segment mapped
    # Into the open segment, into a second new one, and one that would need a third.
    results = b.produce("b", [tiny(0, 1), tiny(1), tiny(2), tiny(1, 1)], 0.0)
    assert [r[0] if isinstance(r[0], str) else "stored" for r in results] == [
        "stored", "stored", "throttled", "stored"]
    assert results[2][2] is True                          # retriable
    assert b.stats()["chunks_appended"] == 4
    assert b.producers.get((2, 1, 0)) is None             # nothing of the refused chunk kept
    with pytest.raises(Throttled):                        # nothing of it fits: refused whole
        b.produce("c", [tiny(2), tiny(3)], 0.0)
    assert b.stats()["chunks_appended"] == 4


def test_a_segment_larger_than_the_memory_limit_is_refused_for_good():
    b = broker(desc(seg=256 * KiB), 128 * KiB)
    [(code, message, retriable)] = b.produce("a", [tiny(0)], 0.0)
    assert code == StorageError.code and not retriable and "--memory-limit" in message


def test_segments_in_memory_are_bounded():
    b = broker(desc(Q=8, seg=4 * KiB))                     # no memory limit at all
    b.tier.segments_max = 3
    for p in range(3):
        b.produce(p, [tiny(p)], 0.0)
    with pytest.raises(Throttled) as err:
        b.produce(3, [tiny(3)], 0.0)
    assert err.value.retriable and "3 of 3 segments" in str(err.value)
    assert len(b.tier.resident) == 3


def fill_groups(b, n, size=3000):
    """Chunks of ~`size` bytes from producer 0: with 4 KiB segments and G=1, one group each."""
    for seq in range(n):
        res = b.produce(seq, [chunk.encode(0, seq, 1, 0, [b"v" * size])], 0.0)
        assert isinstance(res[0][0], int), res


def test_groups_per_streamlet_bound_without_retention_is_final():
    b = broker(desc(G=1, seg=4 * KiB), groups_per_streamlet_max=3)
    fill_groups(b, 3)
    [(code, message, retriable)] = b.produce("x", [chunk.encode(0, 3, 1, 0, [b"v" * 3000])], 0.0)
    assert code == StorageError.code and not retriable and "no retention" in message
    assert len(b.streams[1].streamlets[0].groups) == 3


def test_groups_per_streamlet_bound_with_retention_is_retriable():
    b = broker(desc(G=1, seg=4 * KiB, retention_ms=60_000), groups_per_streamlet_max=3)
    fill_groups(b, 3)
    with pytest.raises(Throttled):
        b.produce("x", [chunk.encode(0, 3, 1, 0, [b"v" * 3000])], 0.0)
    b.enforce_retention(10**9)                            # old groups expire: room again
    assert isinstance(b.produce("y", [chunk.encode(0, 3, 1, 0, [b"v" * 3000])], 0.0)[0][0], int)
