"""Chunk format version 2: tombstones, headers and compression round-trip; version 1 stays
readable; checksums cover the stored (compressed) bytes."""

import random

import pytest

from kera.codec import chunk
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


def _legacy(buf: bytes, version: int) -> bytes:
    """The same chunk as kera wrote it before record numbers: a 64-byte header, no number."""
    out = bytearray(buf[:chunk.HEADER_SIZE_V1]) + buf[chunk.HEADER_SIZE:]
    out[2] = version
    out[4:8] = chunk.header_crc(out).to_bytes(4, "little")
    return bytes(out)


def test_new_chunks_are_version_3_with_a_number_slot_left_unset_until_stamped():
    buf = chunk.encode(1, 0, 1, 0, [b"a", b"b"], [b"k", None])
    assert buf[2] == chunk.VERSION_3
    h = chunk.verify(buf)
    assert h.header_size == chunk.HEADER_SIZE == 72 and h.number is None
    stamped = bytearray(buf)
    chunk.stamp(stamped, 4, 0, 10, number=1234)
    h = chunk.verify(stamped)
    assert (h.group, h.base_offset, h.number) == (4, 10, 1234)
    assert chunk.Chunk(stamped).first_number == 1234


def test_the_header_checksum_covers_the_number():
    stamped = bytearray(chunk.encode(1, 0, 1, 0, [b"a"]))
    chunk.stamp(stamped, 0, 0, 0, number=5)
    stamped[chunk.NUMBER_AT] ^= 1
    with pytest.raises(CorruptChunk, match="header checksum"):
        chunk.verify(stamped)


@pytest.mark.parametrize("version,kwargs", [
    (chunk.VERSION, {"keys": [b"k", None]}),
    (chunk.VERSION_2, {"headers": [[("h", b"v")], None], "compression": "zstd"}),
])
def test_chunks_written_before_record_numbers_are_still_read(version, kwargs):
    buf = _legacy(chunk.encode(1, 0, 1, 0, [b"a", None if version == 2 else b"b"], **kwargs),
                  version)
    h = chunk.verify(buf)
    assert (h.version, h.header_size, h.number) == (version, 64, None)
    assert chunk.chunk_size(buf) == len(buf) == h.size
    stamped = bytearray(buf)
    chunk.stamp(stamped, 2, 0, 7, number=99)   # no room for a number: the rest is stamped
    c = chunk.Chunk(stamped)
    assert (c.header.group, c.header.base_offset, c.first_number) == (2, 7, None)
    assert c.values()[0] == b"a"


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
    buf = bytearray(_legacy(chunk.encode(1, 0, 1, 0, [b"a"]), chunk.VERSION))
    buf[3] |= chunk.FLAG_HEADERS
    buf[4:8] = chunk.header_crc(buf).to_bytes(4, "little")
    with pytest.raises(CorruptChunk, match="unknown flags"):
        chunk.read_header(buf)


def test_unknown_compression_is_refused_at_encode():
    with pytest.raises(ValueError, match="compression must be"):
        chunk.encode(1, 0, 1, 0, [b"a"], compression="snappy")


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_compression_flag_the_body_does_not_match_is_refused_at_the_layout_check(codec):
    """A broker stores compressed chunks without decompressing them: a flag set on a plain body
    (or the other codec's frame) must still be refused before it is stored."""
    plain = bytearray(chunk.encode(1, 0, 1, 0, [b"x" * 50] * 20))
    plain[3] |= chunk.COMPRESSIONS[codec] << chunk.COMPRESSION_SHIFT
    plain[4:8] = chunk.header_crc(plain).to_bytes(4, "little")
    other = "zstd" if codec == "lz4" else "lz4"
    packed = bytearray(chunk.encode(1, 0, 1, 0, [b"x" * 50] * 20, compression=other))
    packed[3] = (packed[3] & ~chunk.COMPRESSION_MASK) | (chunk.COMPRESSIONS[codec] << chunk.COMPRESSION_SHIFT)
    packed[4:8] = chunk.header_crc(packed).to_bytes(4, "little")
    for buf in (plain, packed):
        with pytest.raises(CorruptChunk, match="does not hold"):
            chunk.check_columns(buf, chunk.verify(buf))
    good = chunk.encode(1, 0, 1, 0, [b"x" * 50] * 20, compression=codec)
    chunk.check_columns(good, chunk.verify(good))
