"""A closed segment rewritten in memory (kera.broker.rewrite, docs/COMPACTION.md) and the broker's
read paths over the gaps it leaves: fetch, seek by number and by time, the streamlet's span,
Kafka Fetch's batches; a second rewrite drops expired tombstones."""

import numpy as np
from kafka.record.default_records import DefaultRecordBatch

from kera.broker import compaction, rewrite
from kera.broker.kafka.fetch import as_batch
from kera.codec import chunk

from tests.unit.test_retention_core import broker, desc

KiB = 1024
KEYS = 12
DAY_MS = 86_400_000


def setup(chunks=40):
    """A compacted stream of 4 KiB segments, 4 per group: keys updated over and over, key
    "gone" written then deleted in group 0; returns (broker, every record as (number, key, value, ts))."""
    b = broker({**desc(G=4, seg=4 * KiB), "cleanup_policy": "compact"})
    written, n = [], 0
    for seq in range(chunks):
        keys = [b"k%02d" % ((seq * 7 + i) % KEYS) for i in range(8)]
        values = [b"%d-%d" % (seq, i) + b"x" * 90 for i in range(8)]
        if seq == 3:
            keys[-1] = b"gone"
        if seq == 14:
            values[-1], keys[-1] = None, b"gone"
        ts = [1000 * (n + i) for i in range(8)]
        r = b.produce(seq, [chunk.encode(1, seq, 1, 0, values, keys=keys, timestamps=ts)], 0.0)
        assert not isinstance(r[0][0], str), r
        written += [(n + i, keys[i], values[i], ts[i]) for i in range(8)]
        n += 8
    return b, written


def group(b, g):
    return b.streams[1].streamlets[0].group(g)


def compact_group(b, g, now_ms):
    grp = group(b, g)
    rewrites, _ = compaction.plan_pass(rewrite.closed_segments(grp), grp.number_base, now_ms,
                                       DAY_MS)
    for w in rewrites:
        rewrite.swap(grp, w.index, rewrite.build_segment(grp, w.index, w.pieces))
    return rewrites


def read(b, low=0, offsets=None):
    """Every durable record from a cursor, numbered from its chunk (gaps skipped)."""
    out, offsets = [], dict(offsets or {})
    for _ in range(1000):
        results, frames = b.reads.fetch([[1, 0, {"low": low, "offsets": dict(offsets)}, 1 << 20]])
        err, _, groups = results[0]
        assert err is None, err
        got = False
        for view in (c for f in frames for c in chunk.frame_chunks(f)):
            c = chunk.Chunk(view)
            h = c.header
            start = offsets.get(h.group, 0)
            for off, k, v, ts in zip((h.base_offset + c.record_offsets()).tolist(), c.keys(),
                                     c.values(), c.timestamps.tolist()):
                if off >= start:
                    out.append((h.number - h.base_offset + off, k, v, ts))
            offsets[h.group] = h.base_offset + c.span
            got = True
        if not got:
            done = [g for g in groups if g[4] and offsets.get(g[0], 0) >= g[3]]
            if not done or done[0][0] != low:
                return out
            low += 1
    raise AssertionError("read did not finish")


def latest_in(records, lo, hi):
    last = {}
    for r in records:
        if lo <= r[0] < hi:
            last[r[1]] = r
    return sorted(last.values())


def test_rewrite_keeps_the_latest_of_each_key_with_its_number():
    b, written = setup()
    g0 = group(b, 0)
    end0 = g0.number_base + g0.head
    span = b.reads.number_span(1, 0)
    bytes_before = g0.durable_bytes_from(0)
    assert read(b) == written
    rewrites = compact_group(b, 0, now_ms=5)
    assert rewrites and sum(w.bytes_after for w in rewrites) < sum(w.bytes_before for w in rewrites)
    want = latest_in(written, 0, end0) + [r for r in written if r[0] >= end0]
    assert read(b) == want
    assert b.reads.number_span(1, 0) == span and g0.head == end0 - g0.number_base
    assert g0.durable_bytes_from(0) < bytes_before
    tomb = [r for r in read(b) if r[2] is None]
    assert [r[1] for r in tomb] == [b"gone"]     # the delete survives its first pass


def test_seeks_by_number_and_time_land_on_the_next_survivor():
    b, written = setup()
    compact_group(b, 0, now_ms=5)
    kept = [r for r in read(b)]
    numbers = [r[0] for r in kept]
    gaps = sorted(set(range(numbers[-1])) - set(numbers))
    assert gaps
    for n in gaps[:: max(1, len(gaps) // 20)]:
        low, offsets = b.reads.cursor_at_number(1, 0, n)
        nxt = next(r for r in kept if r[0] >= n)
        assert read(b, low, offsets)[0] == nxt
        ts = written[n][3]                       # the time of a record compaction removed
        assert b.reads.number_at_time(1, 0, ts) == (nxt[0], nxt[3])


def test_kafka_batches_keep_offsets_and_cover_the_range():
    b, written = setup()
    compact_group(b, 0, now_ms=5)
    g0 = group(b, 0)
    seen, covered = [], []
    for seg in g0.segments:
        for i in range(len(seg)):
            batch = as_batch(seg.view(i))
            c = chunk.Chunk(seg.view(i))
            covered.append((c.header.number, c.header.number + c.span))
            kb = DefaultRecordBatch(batch)
            assert kb.base_offset == c.header.number
            seen += [(r.offset, r.key, r.value) for r in kb]
            assert kb.next_offset == c.header.number + c.span
    assert seen == [(r[0], r[1], r[2]) for r in latest_in(written, 0, g0.head)]
    assert all(a[1] == b_[0] for a, b_ in zip(covered, covered[1:]))
    assert covered[0][0] == 0 and covered[-1][1] == g0.head


def test_a_second_pass_drops_expired_tombstones():
    b, written = setup()
    compact_group(b, 0, now_ms=5)
    g0 = group(b, 0)
    assert {rewrite.generation(s) for s in g0.segments} <= {0, 1}
    assert not compact_group(b, 0, now_ms=5 + DAY_MS - 1)   # nothing to do yet
    assert compact_group(b, 0, now_ms=5 + DAY_MS)
    assert [r for r in read(b) if r[2] is None] == []
    assert 2 in {rewrite.generation(s) for s in g0.segments}
    live = [r for r in latest_in(written, 0, g0.head) if r[2] is not None]
    assert [r for r in read(b) if r[0] < g0.head] == live


def test_segment_records_round_trip_a_rewrite():
    b, _ = setup()
    compact_group(b, 0, now_ms=5)
    g0 = group(b, 0)
    recs = [r for s in rewrite.closed_segments(g0) for r in s.records]
    assert [r.cleaned_ms for r in recs if r.value is None] == [5]
    assert np.all(np.diff([r.number for r in recs]) > 0)


def test_a_range_with_no_survivor_is_an_empty_kafka_batch_consumers_step_over():
    buf = bytearray(chunk.encode_sparse(1, 0, (1, 0, True), [], [], [], None, [], 40, None))
    chunk.stamp(buf, 0, 0, 10, 110)
    kb = DefaultRecordBatch(as_batch(memoryview(buf)))
    assert kb.validate_crc() and list(kb) == []
    assert (kb.base_offset, kb.next_offset) == (110, 150)
