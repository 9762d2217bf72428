"""The duplicate-detection table: produce rules and its LRU bound."""

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
    t = ProducerTable(max_entries=3)
    for p in range(3):
        t.put((p, 1, 0), entry(0))
    assert t.get((0, 1, 0)) is not None    # touch 0: 1 is now least recently used
    t.put((3, 1, 0), entry(0))
    assert len(t) == 3 and t.evictions == 1
    assert t.get((1, 1, 0)) is None
    assert t.get((0, 1, 0)) is not None and t.get((3, 1, 0)) is not None
    t.put((0, 1, 0), entry(1))             # update in place, no eviction
    assert t.evictions == 1 and t.get((0, 1, 0)).sequence == 1


def test_drop_stream():
    t = ProducerTable(10)
    t.put((1, 5, 0), entry(0))
    t.put((1, 6, 0), entry(0))
    t.drop_stream(5)
    assert t.get((1, 5, 0)) is None and t.get((1, 6, 0)) is not None
