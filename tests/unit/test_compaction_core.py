"""The compactor's pure core (kera.broker.compaction, docs/COMPACTION.md): the last record of
each key survives with its number, timestamp and headers; tombstones survive until
delete.retention.ms after the pass that first kept them; a bounded offset map only splits the
work over more passes; pieces cover their segment's numbers exactly; when a streamlet is due."""

import random

import pytest

from kera.broker import compaction as cp
from kera.broker.compaction import Record, Segment

DAY_MS = 86_400_000


def workload(keys=1000, updates=100, deletes=300, seed=38):
    """Every key updated `updates` times in a shuffled order, then `deletes` of them deleted
    (a tombstone each), numbered densely: the issue's test at a unit test's size."""
    rng = random.Random(seed)
    writes = [k for k in range(keys) for _ in range(updates)]
    rng.shuffle(writes)
    records, version = [], {}
    for n, k in enumerate(writes):
        version[k] = version.get(k, 0) + 1
        records.append(Record(n, b"k%05d" % k, b"v%d-%d" % (k, version[k]), 1000 * n,
                              (("h", b"%d" % n),)))
    for k in rng.sample(range(keys), deletes):
        records.append(Record(len(records), b"k%05d" % k, None, 1000 * len(records)))
    return records


def segments_of(records, per=5000):
    return [Segment(i, min(i + per, len(records)), records[i:i + per])
            for i in range(0, len(records), per)]


def run(segments, clean_end, now_ms, retention_ms=DAY_MS, map_bytes_max=cp.OFFSET_MAP_BYTES_MAX):
    """A pass applied the way the broker applies it: each rewritten segment becomes its
    pieces' records (the shell turns pieces into chunks)."""
    rewrites, clean_end = cp.plan_pass(segments, clean_end, now_ms, retention_ms, map_bytes_max)
    segments = list(segments)
    for w in rewrites:
        seg = segments[w.index]
        covered = [p for p in w.pieces]
        assert covered[0].first == seg.first and \
            covered[-1].first + covered[-1].span == seg.end, "pieces cover the segment"
        for a, b in zip(covered, covered[1:]):
            assert a.first + a.span == b.first, "pieces are back to back"
        segments[w.index] = Segment(seg.first, seg.end,
                                    [r for p in w.pieces for r in p.records])
    return segments, clean_end, rewrites


def expected_latest(records):
    last = {}
    for r in records:
        last[r.key] = r
    return sorted(last.values(), key=lambda r: r.number)


def flat(segments):
    return [r for s in segments for r in s.records]


def test_last_value_of_each_key_in_number_order_then_tombstones_expire():
    records = workload()
    segs, clean, _ = run(segments_of(records), 0, now_ms=0)
    got = flat(segs)
    want = expected_latest(records)
    assert [(r.number, r.key, r.value, r.timestamp_us, r.headers) for r in got] == \
        [(r.number, r.key, r.value, r.timestamp_us, r.headers) for r in want]
    assert clean == len(records)
    tombstones = [r for r in got if r.value is None]
    assert len(tombstones) == 300 and all(r.cleaned_ms == 0 for r in tombstones)
    assert sum(1 for r in got if r.value is not None) == 700
    # Before delete.retention.ms the tombstones stay; from it on they go, and nothing else.
    segs2, _, rewrites = run(segs, clean, now_ms=DAY_MS - 1)
    assert flat(segs2) == got and not rewrites
    segs3, _, rewrites = run(segs, clean, now_ms=DAY_MS)
    assert [r for r in flat(segs3)] == [r for r in got if r.value is not None]
    assert sum(w.bytes_after for w in rewrites) < sum(w.bytes_before for w in rewrites)


def test_passes_over_growing_data_equal_one_pass():
    records = workload(keys=200, updates=20, deletes=50)
    segs_all = segments_of(records, per=700)
    once = flat(run(segs_all, 0, now_ms=5)[0])
    segs, clean = [], 0
    for seg in segs_all:                        # a pass after each segment closes
        segs, clean, _ = run(segs + [seg], clean, now_ms=5)
    assert flat(segs) == once


def test_a_bounded_offset_map_takes_more_passes_to_the_same_result():
    records = workload(keys=300, updates=10, deletes=40)
    segs = segments_of(records, per=400)
    want = flat(run(segs, 0, now_ms=1)[0])
    small = 50 * (cp.OFFSET_MAP_ENTRY_OVERHEAD_BYTES + 6)     # 50 keys per pass
    clean, passes = 0, 0
    while clean < len(records):
        segs, clean, _ = run(segs, clean, now_ms=1, map_bytes_max=small)
        passes += 1
        assert passes < 100
    assert passes > 1
    segs, clean, _ = run(segs, clean, now_ms=1)   # a last pass with the clean part whole
    assert [(r.number, r.value) for r in flat(segs)] == [(r.number, r.value) for r in want]


def test_keyless_records_are_removed_and_headers_kept():
    rs = [Record(0, None, b"old", 1), Record(1, b"a", b"x", 2, (("h", b"1"),)),
          Record(2, b"a", b"y", 3, (("h", b"2"), ("i", None)))]
    segs, _, _ = run([Segment(0, 3, rs)], 0, now_ms=0)
    assert flat(segs) == [rs[2]]


def test_a_tombstone_keeps_its_time_when_its_segment_is_rewritten_again():
    rs = [Record(0, b"a", None, 1), Record(1, b"b", b"1", 2)]
    segs, clean, _ = run([Segment(0, 2, rs)], 0, now_ms=100)
    assert flat(segs)[0].cleaned_ms == 100
    more = Segment(2, 3, [Record(2, b"b", b"2", 3)])
    segs, clean, _ = run(segs + [more], clean, now_ms=200)    # rewrites segment 0 for b
    assert flat(segs)[0] == Record(0, b"a", None, 1, (), 100)
    segs, clean, _ = run(segs, clean, now_ms=100 + DAY_MS)
    assert flat(segs) == [Record(2, b"b", b"2", 3)]


def test_a_later_write_of_a_deleted_key_brings_it_back():
    rs = [Record(0, b"a", b"1", 1), Record(1, b"a", None, 2), Record(2, b"a", b"3", 3)]
    segs, _, _ = run([Segment(0, 3, rs)], 0, now_ms=0)
    assert flat(segs) == [rs[2]]


def test_pack_covers_the_range_and_bounds_pieces():
    rs = [Record(n, b"k%02d" % n, b"v" * 100, n) for n in (3, 5, 6, 20)]
    pieces = cp.pack(rs, 0, 30, piece_bytes_max=2 * rs[0].size())
    assert [(p.first, p.span, [r.number for r in p.records]) for p in pieces] == \
        [(0, 6, [3, 5]), (6, 24, [6, 20])]
    assert cp.pack([], 10, 20) == [cp.Piece(10, 10, ())]
    big = [Record(0, b"k", b"v" * 1000, 0), Record(1, b"j", b"w", 0)]
    assert [len(p.records) for p in cp.pack(big, 0, 2, piece_bytes_max=100)] == [1, 1]
    with pytest.raises(AssertionError):
        cp.pack(rs, 4, 30)


def test_delete_horizon_is_the_latest_tombstone_time():
    p = cp.Piece(0, 3, (Record(0, b"a", None, 0, (), 5), Record(1, b"b", b"x", 0),
                        Record(2, b"c", None, 0, (), 9)))
    assert cp.delete_horizon_ms(p) == 9
    assert cp.delete_horizon_ms(cp.Piece(0, 1, (Record(0, b"a", b"x", 0),))) is None


def test_due_by_ratio_or_by_max_lag():
    assert cp.dirty_ratio(0, 0) == 0.0 and cp.dirty_ratio(300, 100) == 0.25
    assert not cp.due(100, 0, None, 0, 0.5, 0)
    assert cp.due(100, 100, 0, 0, 0.5, 0)
    assert not cp.due(300, 100, 0, 10, 0.5, 0)
    assert cp.due(300, 100, 0, 10, 0.5, 10)                 # waited max.compaction.lag.ms
    assert not cp.due(300, 100, 0, 9, 0.5, 10)


def test_cleanable_end_respects_min_lag():
    closed = [(100, 0), (200, 50), (300, 90)]
    assert cp.cleanable_end(closed, 100, 0) == 300
    assert cp.cleanable_end(closed, 100, 20) == 200
    assert cp.cleanable_end(closed, 100, 200) is None
