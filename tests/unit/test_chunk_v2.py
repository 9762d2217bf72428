"""Chunk format version 2: tombstones, headers and compression round-trip; version 1 stays
readable; checksums cover the stored (compressed) bytes."""

import random

import pytest

from kera import chunk
from kera.errors import CorruptChunk

# Enough random cases to mix every flag combination many times over, still well under a second.
CASES = 200


def _random_records(rng: random.Random, n: int):
    values = [None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 40)) for _ in range(n)]
    keys = [None if rng.random() < 0.3 else rng.randbytes(rng.randrange(0, 8)) for _ in range(n)]
    headers = [[(f"k{rng.randrange(5)}é", rng.randbytes(rng.randrange(0, 6)))
                for _ in range(rng.randrange(0, 4))] for _ in range(n)]
    return values, keys, headers


@pytest.mark.parametrize("seed", range(CASES))
def test_random_records_round_trip_through_every_compression(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 30)
    values, keys, headers = _random_records(rng, n)
    compression = rng.choice([None, "lz4", "zstd"])
    buf = chunk.encode(7, 3, 11, 2, values, keys, timestamps=list(range(n)), headers=headers,
                       compression=compression)
    chunk.check_columns(buf, chunk.verify(buf))
    c = chunk.Chunk(buf)
    assert c.values() == values
    assert c.keys() == keys
    assert c.headers() == [list(h) for h in headers]
    assert c.timestamps.tolist() == list(range(n))
    assert c.to_arrow().column("value").to_pylist() == values


def test_tombstone_is_none_and_distinct_from_empty_value():
    c = chunk.Chunk(chunk.encode(1, 0, 1, 0, [None, b"", b"x"]))
    assert c.values() == [None, b"", b"x"]


def test_plain_chunks_stay_version_1_and_new_features_write_version_2():
    plain = chunk.encode(1, 0, 1, 0, [b"a"], [b"k"])
    assert plain[2] == chunk.VERSION
    assert chunk.encode(1, 0, 1, 0, [None])[2] == chunk.VERSION_2
    assert chunk.encode(1, 0, 1, 0, [b"a"], headers=[[("h", b"v")]])[2] == chunk.VERSION_2
    assert chunk.encode(1, 0, 1, 0, [b"a"], compression="zstd")[2] == chunk.VERSION_2


def test_compression_shrinks_repetitive_values_and_checksums_cover_stored_bytes():
    values = [b"the same forty bytes of text, many times" for _ in range(1000)]
    plain = chunk.encode(1, 0, 1, 0, values)
    for codec in ("lz4", "zstd"):
        packed = chunk.encode(1, 0, 1, 0, values, compression=codec)
        assert len(packed) < len(plain) // 5
        h = chunk.verify(packed)  # what a broker or backup runs: no decompression needed
        assert chunk.crc32c(packed[chunk.HEADER_SIZE:]) == h.body_crc
        assert chunk.Chunk(packed).values() == values


def test_corrupt_compressed_chunk_is_refused():
    good = bytearray(chunk.encode(1, 0, 1, 0, [b"x" * 100] * 50, compression="lz4"))
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF
    with pytest.raises(CorruptChunk):
        chunk.Chunk(flipped)
    # a frame that passes its checksum (re-sealed) but does not decompress is refused too
    body = bytes(flipped[chunk.HEADER_SIZE:])
    h = chunk.read_header(good)
    resealed = chunk.seal(h.flags, body, 1, 0, 1, 0, h.record_count)
    with pytest.raises(CorruptChunk):
        chunk.Chunk(resealed)


def test_unknown_flag_in_version_1_chunk_is_refused():
    buf = bytearray(chunk.encode(1, 0, 1, 0, [b"a"]))
    buf[3] |= chunk.FLAG_HEADERS
    buf[4:8] = chunk.header_crc(buf).to_bytes(4, "little")
    with pytest.raises(CorruptChunk, match="unknown flags"):
        chunk.read_header(buf)


def test_unknown_compression_is_refused_at_encode():
    with pytest.raises(ValueError, match="compression must be"):
        chunk.encode(1, 0, 1, 0, [b"a"], compression="snappy")
