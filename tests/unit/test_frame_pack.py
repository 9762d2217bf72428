"""Several whole chunks to a frame: how frames are cut back into chunks, how a producer packs
its requests, how a broker stores a packed request (one result per chunk, a bad chunk refused
alone) and packs its fetch replies, which readers cut back into exactly the chunks stored."""

import pytest

from kera.codec import chunk

from kera.codec import frame_pack
from kera.errors import CorruptChunk
from kera.producer.pipeline import Outgoing, PendingChunk

from tests.unit.test_broker_core import broker, cursor, desc, make


def test_a_frame_is_cut_into_its_chunks_and_a_bad_cut_is_refused():
    a, b = make(seq=0, n=2), make(seq=1, n=5)
    assert [bytes(c) for c in chunk.frame_chunks(a + b)] == [a, b]
    for bad, why in [(b"", "empty frame"), (a + b[:-1], "inside its last chunk"),
                     (a + b"\0" * 5, "stray bytes")]:
        with pytest.raises(CorruptChunk, match=why):
            list(chunk.frame_chunks(bad))


def test_a_producer_packs_short_chunks_and_sends_long_ones_as_they_are():
    short = [make(seq=i) for i in range(3)]
    long_ = make(seq=3, n=1, value=b"x" * frame_pack.PACK_RUN_BYTES_MAX)
    out = Outgoing("b", [PendingChunk(c, None, i, 3, i) for i, c in enumerate(short + [long_])])
    frames = out.frames
    assert len(frames) == 2 and frames[1] is long_
    assert [bytes(c) for f in frames for c in chunk.frame_chunks(f)] == short + [long_]


def test_a_packed_produce_gets_a_result_per_chunk_and_a_bad_chunk_is_refused_alone():
    b = broker()
    good0, good2 = make(seq=0, n=2), make(seq=0, sl=1, n=4)
    bad = bytearray(make(producer=2, seq=0, n=3))
    bad[60] ^= 0x10                             # a body bit: its header still cuts the frame
    results = b.produce("r", [good0 + bytes(bad) + good2], 0.0)
    assert results[0] == [0, 0, 0, 0] and results[2] == [0, 0, 0, 0]
    assert results[1][0] == "corrupt_chunk" and b.stats()["chunks_appended"] == 2


def test_a_frame_that_does_not_cut_stands_as_one_refused_chunk_beside_good_frames():
    b = broker()
    results = b.produce("r", [make(seq=0), make(producer=2, seq=0)[:-1]], 0.0)
    assert results[0] == [0, 0, 0, 0] and results[1][0] == "corrupt_chunk"
    assert len(results) == 2 and b.stats()["chunks_appended"] == 1


def test_a_fetch_reply_packs_the_short_runs_of_several_groups():
    b = broker(desc(streamlets=1, Q=4))
    for producer in range(1, 5):                # one group per slot
        for seq in range(2):
            b.produce("p", [make(producer=producer, seq=seq)], 0.0)
    results, frames = b.reads.fetch([[1, 0, cursor(), 1 << 20]])
    err, n, groups = results[0]
    chunks = [chunk.Chunk(c) for f in frames for c in chunk.frame_chunks(f)]
    assert err is None and n == len(frames) == 1 and len(groups) == 4
    assert sorted((c.header.producer_id, c.header.sequence) for c in chunks) == \
        [(p, s) for p in range(1, 5) for s in range(2)]
    assert b.stats()["fetch_chunks"] == 8
