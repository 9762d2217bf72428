"""A backup's cut of replication frames into verified chunks (kera.backup.frames.split_chunks):
every chunk of a frame checked wherever it sits, errors naming the frame and the chunk's byte."""

import random

import pytest

from kera.codec import chunk
from kera.backup.frames import split_chunks
from kera.errors import CorruptChunk


def _legacy_v1(buf: bytes) -> bytes:
    """The chunk as kera wrote it before record numbers: a 64-byte header."""
    out = bytearray(buf[:chunk.HEADER_SIZE_V1]) + buf[chunk.HEADER_SIZE:]
    out[2] = chunk.VERSION
    out[4:8] = chunk.header_crc(out).to_bytes(4, "little")
    return bytes(out)


def _chunks() -> list[bytes]:
    return [chunk.encode(1, 0, 7, 0, [b"a" * 100] * 8),
            _legacy_v1(chunk.encode(1, 1, 7, 0, [b"b", b"c"], keys=[b"k", None])),
            chunk.encode(1, 2, 7, 0, [b"z" * 50] * 30, compression="lz4"),
            chunk.encode(1, 3, 7, 0, [b"d"], headers=[[("h", b"v")]])]


def test_frames_of_chunks_back_to_back_split_into_exactly_those_chunks():
    parts = _chunks()
    frames = [b"".join(parts), parts[0], bytearray(b"".join(parts[1:]))]
    got = [bytes(c) for c in split_chunks(frames)]
    assert got == parts + [parts[0]] + parts[1:]


@pytest.mark.parametrize("index", range(4))
def test_a_flipped_bit_in_any_chunk_of_a_frame_is_refused_naming_its_byte(index):
    parts = _chunks()
    start = sum(map(len, parts[:index]))
    rng = random.Random(index)
    for _ in range(100):
        frame = bytearray(b"".join(parts))
        frame[start + rng.randrange(len(parts[index]))] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptChunk, match=f"^frame 1, byte {start}: "):
            split_chunks([parts[0], frame])


def test_truncated_stray_and_empty_frames_are_refused():
    parts = _chunks()
    whole = b"".join(parts)
    last = len(whole) - len(parts[-1])
    with pytest.raises(CorruptChunk, match=f"frame 0, byte {last}: chunk body .* truncated"):
        split_chunks([whole[:-1]])
    with pytest.raises(CorruptChunk, match=f"frame 0, byte {len(whole)}: chunk of 3 bytes"):
        split_chunks([whole + b"xyz"])
    with pytest.raises(CorruptChunk, match="frame 1 is empty"):
        split_chunks([whole, b""])
