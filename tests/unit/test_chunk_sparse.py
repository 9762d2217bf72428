"""Compacted chunks (FLAG_SPARSE, docs/COMPACTION.md): records at offset deltas within a span,
keys, values, tombstones, timestamps and headers kept, the delete horizon; checked like any
chunk; a range where nothing survived is a chunk of no record; producers cannot send one."""

import numpy as np
import pytest

from kera.codec import chunk
from kera.errors import CorruptChunk

from tests.unit.test_retention_core import broker, desc


def sparse(**kw):
    args = dict(keys=[b"a", b"b", b"c"], values=[b"1", None, b"333"],
                timestamps=[10, 20, 30], headers=[[("h", b"x")], None, [("i", b"")]],
                deltas=[0, 4, 9], span=12, horizon_ms=1234)
    args.update(kw)
    return chunk.encode_sparse(7, 0, (3, 1, False), **args)


def test_round_trip():
    buf = bytearray(sparse())
    chunk.stamp(buf, 2, 1, 100, 5100)
    h = chunk.verify(buf)
    chunk.check_columns(buf, h)
    assert h.flags & chunk.FLAG_SPARSE and h.record_count == 3
    assert h.producer_id == chunk.COMPACTED_PRODUCER_ID
    assert chunk.compacted(h) == (3, 1, False, 12) and chunk.offsets_covered(h) == 12
    c = chunk.Chunk(bytes(buf))
    assert c.keys() == [b"a", b"b", b"c"] and c.values() == [b"1", None, b"333"]
    assert c.timestamps.tolist() == [10, 20, 30]
    assert c.headers() == [[("h", b"x")], [], [("i", b"")]]
    assert c.offset_deltas.tolist() == [0, 4, 9, 12] and c.span == 12
    assert (c.header.base_offset + c.record_offsets()).tolist() == [100, 104, 109]
    assert (c.first_number + c.record_offsets()).tolist() == [5100, 5104, 5109]
    assert c.delete_horizon_ms == 1234


def test_no_tombstone_no_horizon_and_a_first_gap():
    c = chunk.Chunk(sparse(values=[b"1", b"2", b"3"], horizon_ms=None, deltas=[2, 3, 5],
                           span=6, headers=None))
    assert c.delete_horizon_ms is None and c.record_offsets().tolist() == [2, 3, 5]


def test_a_range_with_no_survivor_is_an_empty_chunk():
    buf = sparse(keys=[], values=[], timestamps=[], headers=None, deltas=[], span=40,
                 horizon_ms=None)
    h = chunk.verify(buf)
    chunk.check_columns(buf, h)
    c = chunk.Chunk(buf)
    assert len(c) == 0 and c.span == 40 and c.record_offsets().tolist() == []


def test_dense_chunks_answer_the_same_questions():
    c = chunk.Chunk(chunk.encode(1, 0, 7, 0, [b"a", b"b"], keys=[b"k", b"l"]))
    assert c.offset_deltas is None and c.span == 2 and c.delete_horizon_ms is None
    assert c.record_offsets().dtype == np.int64 and c.record_offsets().tolist() == [0, 1]


@pytest.mark.parametrize("deltas, span", [([0, 4, 4], 12), ([0, 4, 9], 9), ([5, 4, 9], 12)])
def test_bad_deltas_refused_at_encode(deltas, span):
    with pytest.raises((ValueError, CorruptChunk)):
        sparse(deltas=deltas, span=span)


def test_damaged_deltas_refused_at_read():
    buf = bytearray(sparse())
    at = len(buf) - chunk.SPARSE_TRAILER.size - 8   # delta[2] of [0, 4, 9, 12]
    buf[at:at + 4] = (3).to_bytes(4, "little")       # 0, 4, 3: not ascending
    h = chunk.read_header(buf)
    resealed = chunk.seal(h.flags, bytes(buf[h.header_size:]), h.producer_id, h.sequence, 7, 0,
                          h.record_count)
    with pytest.raises(CorruptChunk, match="offset deltas"):
        chunk.Chunk(resealed)


def test_header_and_deltas_must_agree_on_the_span():
    buf = sparse()
    other = chunk.compacted_sequence(3, 1, False, 13)
    with pytest.raises(CorruptChunk, match="13 by its header"):
        chunk.Chunk(chunk.reseal(buf, chunk.COMPACTED_PRODUCER_ID, other))
    with pytest.raises(CorruptChunk, match="producer 5"):
        chunk.Chunk(chunk.reseal(buf, 5, chunk.read_header(buf).sequence))


def test_place_fields_round_trip_and_bounds():
    h = chunk.read_header(sparse(keys=[], values=[], timestamps=[], headers=None, deltas=[],
                                 span=chunk.SPAN_MAX, horizon_ms=None))
    assert chunk.compacted(h) == (3, 1, False, chunk.SPAN_MAX)
    seq = chunk.compacted_sequence(chunk.GENERATION_MAX, chunk.PIECE_MAX, True, 1)
    assert seq < 2**64
    for bad in [(0, 0, False, 1), (1, chunk.PIECE_MAX + 1, False, 1), (1, 0, False, 0),
                (chunk.GENERATION_MAX + 1, 0, False, 1)]:
        with pytest.raises(ValueError):
            chunk.compacted_sequence(*bad)
    dense = chunk.read_header(chunk.encode(1, 0, 7, 0, [b"a", b"b"]))
    assert chunk.compacted(dense) is None and chunk.offsets_covered(dense) == 2


def test_a_producer_cannot_append_a_sparse_chunk():
    b = broker(desc(sid=7))
    r = b.produce(0, [sparse()], 0.0)[0]
    assert r[0] == "bad_request" and "compactor only" in r[1]
