"""The duplicate-detection index: produce rules, its bounds, and its O(1) cost with a million
producers (counted in hash-table operations, never timed)."""

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.broker.producers import APPEND, DUPLICATE, GAP, Entry, ProducerTable, classify


def entry(seq):
    return Entry(seq, 0, 0, seq, seq + 1)


def test_produce_rules():
    assert classify(None, 0) == APPEND
    assert classify(None, 1) == GAP        # a new producer starts at 0
    assert classify(entry(4), 5) == APPEND
    assert classify(entry(4), 4) == DUPLICATE
    assert classify(entry(4), 0) == DUPLICATE
    assert classify(entry(4), 6) == GAP


def test_bounded_lru():
    t = ProducerTable(max_entries=3, retained_max=0)   # nothing kept past the hot table
    for p in range(3):
        t.put((p, 1, 0), entry(0))
    assert t.get((0, 1, 0)) is not None    # touch 0: 1 is now least recently used
    t.put((3, 1, 0), entry(0))
    assert len(t) == 3 and t.evictions == 1 and t.forgotten == 1
    assert t.get((1, 1, 0)) is None
    assert t.get((0, 1, 0)) is not None and t.get((3, 1, 0)) is not None
    t.put((0, 1, 0), entry(1))             # update in place, no eviction
    assert t.evictions == 1 and t.get((0, 1, 0)).sequence == 1


def test_drop_stream():
    t = ProducerTable(1)
    t.put((1, 5, 0), entry(0))
    t.put((1, 6, 0), entry(0))             # (1, 5, 0) moves to the retained table
    t.put((2, 5, 0), entry(0))
    t.drop_stream(5)
    assert t.get((1, 5, 0)) is None and t.get((2, 5, 0)) is None
    assert t.get((1, 6, 0)) is not None


def test_evicted_entries_are_retained_then_forgotten_oldest_first():
    t = ProducerTable(max_entries=2, retained_max=3)
    for p in range(6):
        t.put((p, 1, 0), entry(p))
    assert len(t) == 2 and t.retained_count == 3 and t.forgotten == 1
    assert t.get((0, 1, 0)) is None                      # the oldest evicted: forgotten
    assert t.get((1, 1, 0)).sequence == 1                # evicted, still known ...
    assert t.retained_count == 3 and len(t) == 2         # ... and back in the hot table


MILLION = 1_000_000


def test_a_million_producers_cost_constant_operations_per_lookup():
    t = ProducerTable()                                  # the default bounds
    for p in range(MILLION):
        t.put((p, 1, 0), entry(0))
        if p == 999:
            before = t.probes
            t.get((500, 1, 0))
            small = t.probes - before
    assert t.evictions == MILLION - t.max_entries and t.forgotten == 0
    before = t.probes
    found = t.get((0, 1, 0))                             # evicted long ago
    assert found is not None and classify(found, 0) == DUPLICATE
    assert t.probes - before <= small + 3                # a hash lookup, a move: no scan
    before = t.probes
    t.get((MILLION - 1, 1, 0))
    assert t.probes - before <= small + 3


ME = 7


def test_broker_recognises_a_retried_first_chunk_of_an_evicted_producer():
    desc = {"name": "s", "id": 1, "streamlets": 1, "active_groups": 1, "replication": 1,
            "group_segments": 64, "segment_size_bytes": 1 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [ME], "brokers": {str(ME): "h:1"},
            "version": 1, "ready": True}
    b = Broker("n", BrokerConfig(producer_table_max=10), broker_id=ME)
    b.apply_metadata([desc], 1)
    producers = 5000
    for p in range(producers):
        b.produce(p, [chunk.encode(p, 0, 1, 0, [b"v"])], 0.0)
    assert b.producers.evictions == producers - 10
    appended = b.stats()["chunks_appended"]
    before = b.producers.probes
    for p in range(producers):                 # every producer retries its first chunk
        [res] = b.produce(p, [chunk.encode(p, 0, 1, 0, [b"v"])], 0.0)
        assert isinstance(res[0], int)       # acknowledged ...
    assert b.stats()["chunks_appended"] == appended     # ... and stored once
    assert b.duplicates == producers
    assert (b.producers.probes - before) / producers <= 6   # O(1) per chunk, no header scan
    # A producer that goes on after its evicted first chunk is not a gap.
    [res] = b.produce("n", [chunk.encode(3, 1, 1, 0, [b"v"])], 0.0)
    assert isinstance(res[0], int) and b.stats()["chunks_appended"] == appended + 1
