"""Recovery of a compacted streamlet from its replicas (kera.broker.rebuild, docs/COMPACTION.md):
each rewritten segment is its newest whole rewrite whatever else the backups still hold (its
originals, all, some or none of them; an older whole rewrite; a newer partial one), else its
originals; arrival order does not matter; no cut rule mistakes a rewrite's holes for lost
data; the installed streamlet serves the compacted records at their numbers."""

import random

import pytest

from kera.broker.core import Broker, BrokerConfig
from kera.broker.rebuild import StreamletRebuild, install
from kera.codec import chunk

from tests.unit.test_compaction_rewrite import DAY_MS, compact_group, group, read, setup

KiB = 1024


def stored(g) -> list[bytes]:
    """Every chunk of a group as the broker stored it (what its replicas hold)."""
    return [bytes(seg.view(i)) for seg in g.segments for i in range(len(seg))]


def history():
    """(originals, gen-1 rewrite chunks, gen-2 rewrite chunks, records after gen 1, records
    after gen 2, every record written) of a compacted streamlet whose group 0 was rewritten
    twice (the second pass drops the expired tombstone)."""
    b, written = setup()
    originals = [c for g in b.streams[1].streamlets[0].groups for c in stored(g)]
    compact_group(b, 0, now_ms=5)
    gen1 = [c for c in stored(group(b, 0)) if chunk.compacted(chunk.read_header(c))]
    after1 = read(b)
    compact_group(b, 0, now_ms=5 + DAY_MS)
    gen2 = [c for c in stored(group(b, 0)) if
            chunk.compacted(chunk.read_header(c)) and
            chunk.compacted(chunk.read_header(c)).generation == 2]
    return originals, gen1, gen2, after1, read(b), written


def records_of(groups) -> list[tuple]:
    out = []
    for g in groups:
        for seg in g.segments:
            for i in range(len(seg)):
                c = chunk.Chunk(seg.view(i))
                first = g.number_base + seg.bases[i]
                out += [(first + int(o), k, v) for o, k, v in
                        zip(c.record_offsets(), c.keys(), c.values())]
    return out


def rebuilt(chunks, durable=True):
    rb = StreamletRebuild(1, 0, 1, 4, 4 * KiB)
    for c in chunks:
        rb.add(memoryview(c), chunk.read_header(c), durable)
    return rb, rb.finish()


def triples(records):
    return [(r[0], r[1], r[2]) for r in records]


@pytest.fixture(scope="module")
def hist():
    return history()


def test_originals_alone_rebuild_everything(hist):
    originals, _, _, _, _, written = hist
    rb, groups = rebuilt(originals)
    assert records_of(groups) == triples(written) and rb.dropped == rb.superseded == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_whole_rewrite_wins_over_its_originals_in_any_order(hist, seed):
    originals, gen1, _, after1, _, _ = hist
    arrival = originals + gen1 + random.Random(seed).sample(gen1, 2)   # and a few copies
    random.Random(seed).shuffle(arrival)
    print("seed", seed)
    rb, groups = rebuilt(arrival)
    assert records_of(groups) == triples(after1)
    assert rb.pending_bytes == 0 and rb.duplicates == 2


def kept_originals(originals, rewrite):
    """The originals outside the segments `rewrite` (chunks) rewrote."""
    rewritten = {(chunk.read_header(c).group, chunk.read_header(c).segment) for c in rewrite}
    return [c for c in originals
            if (chunk.read_header(c).group, chunk.read_header(c).segment) not in rewritten]


def test_a_rewrite_whose_originals_were_dropped_is_no_hole(hist):
    originals, gen1, _, after1, _, _ = hist
    rb, groups = rebuilt(kept_originals(originals, gen1) + gen1)
    assert records_of(groups) == triples(after1) and rb.dropped == rb.superseded == 0


def test_a_partial_rewrite_is_ignored(hist):
    originals, gen1, _, after1, _, written = hist
    lasts = [c for c in gen1 if chunk.compacted(chunk.read_header(c)).last]
    partial = [c for c in gen1 if c is not lasts[0]]
    rb, groups = rebuilt(originals + partial)
    lost = chunk.read_header(lasts[0])
    seg = [c for c in gen1 if chunk.read_header(c).segment == lost.segment]
    lo = min(chunk.read_header(c).base_offset for c in seg)
    hi = max(chunk.read_header(c).base_offset + chunk.offsets_covered(chunk.read_header(c))
             for c in seg)
    # That segment's numbers come from its originals, every other one from its rewrite.
    want = sorted([r for r in after1 if not lo <= r[0] < hi] +
                  [r for r in written if lo <= r[0] < hi])
    assert records_of(groups) == triples(want)
    assert rb.dropped == 0 and rb.superseded == len(originals) - len(kept_originals(
        originals, [c for c in gen1 if c not in seg])) + len(seg) - 1


def test_the_newest_whole_generation_wins_and_a_newer_partial_one_does_not(hist):
    originals, gen1, gen2, after1, after2, _ = hist
    _, groups = rebuilt(originals + gen1 + gen2)
    assert records_of(groups) == triples(after2)
    partial2 = [c for c in gen2 if not chunk.compacted(chunk.read_header(c)).last]
    _, groups = rebuilt(originals + gen1 + partial2)
    assert records_of(groups) == triples(after1)


def test_installed_streamlet_serves_the_compacted_records(hist):
    originals, gen1, _, after1, _, _ = hist
    b = Broker("node", BrokerConfig(virtual_logs=1), broker_id=4)
    b.set_epoch(7)
    d = {"name": "s", "id": 1, "streamlets": 1, "active_groups": 1, "replication": 1,
         "group_segments": 4, "segment_size_bytes": 4 * KiB, "durability": "memory",
         "replication_capacity": 0, "placement": [4], "brokers": {}, "version": 1,
         "ready": True, "cleanup_policy": "compact"}
    b.apply_metadata([d], 1)
    rb = StreamletRebuild(1, 0, 1, 4, 4 * KiB)
    for c in originals + gen1:
        rb.add(memoryview(c), chunk.read_header(c), True)
    assert install(b, rb) is not None
    assert read(b) == after1
    assert b.reads.number_span(1, 0) == (0, after1[-1][0] + 1)
    # Appends go on after the recovered numbers.
    r = b.produce(0, [chunk.encode(9, 0, 1, 0, [b"new"], keys=[b"k"])], 0.0)[0]
    assert r[0] is not None and not isinstance(r[0], str)
    assert read(b)[-1][:3] == (after1[-1][0] + 1, b"k", b"new")


def test_a_compacted_segment_file_loads_with_its_spans(tmp_path):
    from kera.broker import tier_files
    b, _ = setup()
    compact_group(b, 0, now_ms=5)
    g0 = group(b, 0)
    si = next(i for i, s in enumerate(g0.segments) if chunk.compacted(
        chunk.read_header(s.view(0))))
    seg = g0.segments[si]
    n = len(seg)
    record = tier_files.SegmentRecord(
        1, 0, 0, seg.number, 0, seg.used_bytes, n, seg.bases[0], seg.end_offset(n - 1), 0, 0,
        seg.capacity_bytes, tier_files.chunks_crc(seg.mv, seg.positions, n), True)
    tier_files.write_segment(tmp_path, record, seg.mv)
    loaded = tier_files.load(tmp_path, record)
    assert list(loaded.bases) == list(seg.bases) and list(loaded.counts) == list(seg.counts)
    assert sum(loaded.counts) == record.end_offset - record.base_offset > n
    assert loaded.producers == {}               # a rewrite's sequences are no producer's
