"""kera's readers over compacted chunks (FLAG_SPARSE, docs/COMPACTION.md), whose records lie at
offset deltas with gaps between them: the consumer's fetch cursor ends a chunk at its span and
skips by offset, not index; its cache items, polls, Batches and positions number each record
by its delta; a position after a partly read chunk is the next record's, after a whole one the
chunk's end; resuming and seeking into a gap go on at the next survivor; the Spark source's
rows likewise. Sans-IO: chunks built by the codec, and a broker core compacted in memory read
through the consumer's FetchState; ordinary chunks keep their numbering."""

import pytest

from kera.codec import chunk
from kera.codec.position import Position
from kera.consumer.batch import Batch
from kera.consumer.cache import Cache
from kera.consumer.consumer import Consumer
from kera.consumer.cursor import (ChunkItem, ConsumedCursor, FetchCursor, cursors_with_epochs)
from kera.consumer.fetching import FetchState

from tests.unit.test_compaction_rewrite import compact_group, group, read, setup

SID = 3
PART = ("s", 0)
# One compacted chunk: offsets 100, 104, 109 of 100 .. 111 (span 12), numbers 5100 on.
BASE, NUMBER, DELTAS, SPAN = 100, 5100, [0, 4, 9], 12


def sparse(base=BASE, deltas=DELTAS, span=SPAN, group=0, number=NUMBER):
    n = len(deltas)
    buf = bytearray(chunk.encode_sparse(
        SID, 0, (1, 0, True), [b"k%d" % i for i in range(n)], [b"v%d" % d for d in deltas],
        [10 * d for d in deltas], None, deltas, span, None))
    chunk.stamp(buf, group, 0, base, number)
    return chunk.Chunk(bytes(buf))


def dense(base, n, group=0, number=None):
    buf = bytearray(chunk.encode(1, 0, SID, 0, [b"d%d" % (base + i) for i in range(n)],
                                 keys=[b"k"] * n))
    chunk.stamp(buf, group, 0, base, base if number is None else number)
    return chunk.Chunk(bytes(buf))


# --------------------------------------------------------------------------- FetchCursor

@pytest.mark.parametrize("at, skip", [(0, 0), (100, 0), (101, 1), (104, 1), (105, 2),
                                      (109, 2), (110, 3), (111, 3)])
def test_fetch_cursor_skips_by_offset_and_ends_a_compacted_chunk_at_its_span(at, skip):
    c = sparse()
    cursor = FetchCursor(0, 0, {0: at})
    assert cursor.on_chunk(c.header, c) == skip
    assert cursor.offsets == {0: BASE + SPAN}          # past the trailing gap too
    assert cursor.on_chunk(c.header, c) is None        # nothing new in it any more


def test_a_chunk_of_no_record_moves_the_cursor_over_its_range():
    c = sparse(deltas=[], span=40)
    cursor = FetchCursor(0, 0, {0: 100})
    assert cursor.on_chunk(c.header, c) == 0
    assert cursor.offsets == {0: 140}
    assert FetchCursor(0, 0, {0: 140}).on_chunk(c.header, c) is None


def test_ordinary_chunks_need_no_chunk_to_skip():
    cursor = FetchCursor(0, 0, {0: 7})
    assert cursor.on_chunk(dense(5, 4).header) == 2 and cursor.offsets == {0: 9}


# --------------------------------------------------------------------------- ChunkItem

def test_chunk_item_numbers_records_by_their_deltas():
    item = ChunkItem(PART, sparse(), 1)
    assert (item.first, item.end, item.count) == (104, 112, 2)
    assert [item.offset_at(i) for i in range(3)] == [104, 109, 112]
    assert item.offsets() == [104, 109] and item.numbers() == [5104, 5109]
    done = ChunkItem(PART, sparse(), 3)                 # every record before the cursor
    assert (done.first, done.end, done.count, done.offsets()) == (112, 112, 0, [])


def test_ordinary_chunk_items_keep_dense_ranges():
    item = ChunkItem(PART, dense(10, 5, number=1010), 2)
    assert (item.first, item.end, item.count) == (12, 15, 3)
    assert item.offsets() == range(12, 15) and item.numbers() == range(1012, 1015)
    assert item.offset_at(3) == 15


# --------------------------------------------------------------------------- Batch

@pytest.mark.parametrize("skip", [0, 1, 2])
def test_batch_columns_of_a_compacted_chunk(skip):
    c = sparse()
    offsets = [BASE + d for d in DELTAS][skip:]
    b = Batch("s", 0, 0, offsets[0], c, skip)
    assert len(b) == 3 - skip and b.offsets.tolist() == offsets
    assert b.first_number == NUMBER + DELTAS[skip]
    assert b.numbers.tolist() == [NUMBER - BASE + o for o in offsets]
    assert b.next_offset == BASE + SPAN
    recs = list(b.records())
    assert [(r.offset, r.number, r.value) for r in recs] == [
        (o, NUMBER - BASE + o, b"v%d" % (o - BASE)) for o in offsets]
    assert b.value_list() == [b"v%d" % d for d in DELTAS][skip:]


def test_batch_of_an_ordinary_chunk_is_unchanged():
    b = Batch("s", 0, 0, 12, dense(10, 5, number=1010), 2)
    assert b.offsets.tolist() == [12, 13, 14] and b.numbers.tolist() == [1012, 1013, 1014]
    assert b.first_number == 1012 and b.next_offset == 15
    assert [(r.offset, r.number) for r in b.records()] == [(12, 1012), (13, 1013), (14, 1014)]


# --------------------------------------------------------------------------- the caller's side

def cache(chunks_and_skips, low=0, offsets=None):
    """A Consumer's caller side (no request thread) holding these fetched chunks."""
    c = caller_side({PART: ConsumedCursor(0, low, offsets)}, 64)
    c._cache.push([ChunkItem(PART, ch, skip) for ch, skip in chunks_and_skips])
    return c


def caller_side(consumed: dict, chunks_max: int) -> Consumer:
    """A Consumer without metadata or request thread: its cache (kera.consumer.cache) only."""
    c = Consumer.__new__(Consumer)
    c.cache_chunks_max = chunks_max
    c._cache = Cache(chunks_max, wake=lambda: None)
    c._cache.consumed = consumed
    return c


def test_poll_numbers_records_across_gaps_and_positions_follow():
    c = cache([(dense(90, 10, number=5090), 0), (sparse(), 0),
               (sparse(112, [], 20, number=5112), 0), (dense(132, 2, number=5132), 0)])
    got = []
    for want_next in [91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 104, 109, 112, 133, 134]:
        r = c.poll(0)
        got.append((r.offset, r.number))
        assert c.positions() == [Position("s", 0, 0, want_next)]
    assert got == [(o, 5000 + o) for o in [*range(90, 101), 104, 109, 132, 133]]
    assert c.poll(0) is None and c.positions() == [Position("s", 0, 0, 134)]
    assert c.records_consumed == 15


def test_poll_batch_hands_whole_compacted_chunks_and_skips_empty_ones():
    c = cache([(sparse(), 1), (sparse(112, [], 20, number=5112), 0),
               (dense(132, 2, number=5132), 0)])
    assert c.poll(0).offset == 104                    # one record, then the rest as a batch
    assert c.positions() == [Position("s", 0, 0, 109)]
    batches = c.poll_batch(0)
    assert [(b.offset, b.offsets.tolist(), b.next_offset) for b in batches] == [
        (109, [109], 112), (132, [132, 133], 134)]
    assert c.positions() == [Position("s", 0, 0, 134)] and c.records_consumed == 4


# --------------------------------------------------------------------------- a compacted broker

def fetch_all(b, cursor, fetch_max=2048):
    """Read a broker core's stream 1 streamlet 0 from `cursor` through a consumer's FetchState
    into its cache, until the broker has nothing more."""
    st = FetchState({"s1": 1}, {("s1", 0): cursor}, fetch_max_bytes=fetch_max,
                    request_timeout_s=1.0, idle_wait_s=0.0)
    c = caller_side({("s1", 0): ConsumedCursor(0, cursor.low, cursor.offsets, cursor.epoch)},
                    1 << 20)
    for req_id in range(1, 10_000):
        (broker, reads, parts), = st.build(float(req_id), lambda sid, sl: "b")
        st.sent(broker, req_id, parts, float(req_id))
        results, frames = b.reads.fetch(reads)
        items = st.on_reply(broker, {"id": req_id, "ok": True, "results": results}, frames,
                            float(req_id))
        if not items:
            return c
        c._cache.push(items)
    raise AssertionError("the read did not end")


def as_rows(records):
    return [(r.number, r.key, r.value, r.timestamp) for r in records]


def drain(c):
    out = []
    while (r := c.poll(0)) is not None:
        out.append(r)
    return out


def compacted():
    b, _ = setup()
    compact_group(b, 0, now_ms=5)
    compact_group(b, 1, now_ms=5)
    want = read(b)   # the broker tests' reader of the chunks themselves
    numbers = [w[0] for w in want]
    assert len(set(range(numbers[-1])) - set(numbers)) > 10, "the setup leaves gaps"
    return b, want


def test_consumer_reads_a_compacted_stream_by_number_and_offset():
    b, want = compacted()
    recs = drain(fetch_all(b, FetchCursor(0, earliest=True)))
    assert as_rows(recs) == want
    for r in recs:
        assert r.offset == r.number - group(b, r.group).number_base
    batches = fetch_all(b, FetchCursor(0, earliest=True)).poll_batch(0, max_chunks=1 << 20)
    rows = [(int(n), k, v) for bt in batches
            for n, k, v in zip(bt.numbers, bt.keys(), bt.value_list())]
    assert rows == [w[:3] for w in want]


@pytest.mark.parametrize("share", [0.0, 0.05, 0.2, 0.33, 0.5, 0.7, 0.95, 1.0])
def test_resume_from_positions_anywhere_reads_the_rest_exactly(share):
    b, want = compacted()
    c = fetch_all(b, FetchCursor(0, earliest=True))
    head = [c.poll(0) for _ in range(int(share * len(want)))]
    positions = c.positions()
    (low, offsets, epoch), = cursors_with_epochs(positions, "s1").values()
    rest = drain(fetch_all(b, FetchCursor(0, low, offsets, epoch=epoch)))
    assert as_rows(head + rest) == want


def test_seek_by_number_into_a_gap_starts_at_the_next_survivor():
    b, want = compacted()
    numbers = [w[0] for w in want]
    gaps = sorted(set(range(numbers[-1])) - set(numbers))
    for n in gaps[::max(1, len(gaps) // 10)]:
        low, offsets = b.reads.cursor_at_number(1, 0, n)
        recs = drain(fetch_all(b, FetchCursor(0, low, offsets)))
        assert as_rows(recs) == [w for w in want if w[0] >= n]


def test_seek_by_time_to_a_removed_record_starts_at_the_next_survivor():
    b, want = compacted()
    numbers = {w[0] for w in want}
    removed = [n for n in range(max(numbers)) if n not in numbers]
    for n in removed[::max(1, len(removed) // 10)]:
        ts = 1000 * n                    # the setup's record n was written at 1000 n us
        low, offsets = b.reads.cursor_at_time(1, 0, ts)
        recs = drain(fetch_all(b, FetchCursor(0, low, offsets)))
        assert as_rows(recs) == [w for w in want if w[3] >= ts]


# --------------------------------------------------------------------------- the Spark source

def test_spark_rows_of_a_compacted_chunk_carry_its_offsets_and_numbers():
    pytest.importorskip("pyspark")
    from kera.spark.columns import chunk_rows
    rows = chunk_rows(sparse(), 1, 3, "s", 0, 0, BASE)
    assert rows.column("offset").to_pylist() == [104, 109]
    assert rows.column("number").to_pylist() == [5104, 5109]
    assert rows.column("value").to_pylist() == [b"v4", b"v9"]


@pytest.mark.parametrize("start, end, offsets", [
    (90, 134, [*range(90, 100), 100, 104, 109, 132, 133]),
    (101, 133, [104, 109, 132]), (105, 110, [109]), (110, 132, []), (112, 134, [132, 133])])
def test_spark_group_reader_reads_a_range_across_gaps(start, end, offsets):
    pytest.importorskip("pyspark")
    from kera.spark.fetch import GroupRange, GroupReader
    frames = [c.buf for c in (dense(90, 10, number=5090), sparse(),
                              sparse(112, [], 20, number=5112), dense(132, 2, number=5132))]
    part = GroupRange("x", "s", SID, 0, 0, start=start, end=end, address="a",
                      fetch_max_bytes=1 << 20, timeout_s=1)
    reader = GroupReader(part)
    rows = reader.on_reply({"ok": True, "results": [[None, len(frames), []]]}, frames)
    got = [] if rows is None else rows.column("offset").to_pylist()
    assert got == [o for o in offsets if start <= o < end]
    if rows is not None:
        assert rows.column("number").to_pylist() == [5000 + o for o in got]
    assert reader.position == end and reader.done
