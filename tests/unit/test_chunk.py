import random
import struct

import numpy as np
import pyarrow as pa
import pytest

from kera.codec import chunk
from kera.errors import CorruptChunk, RecordTooLarge


def make(values, keys=None, ts=None, producer=7, seq=3, sid=11, sl=2):
    return chunk.encode(producer, seq, sid, sl, values, keys=keys, timestamps=ts)


def test_round_trip_values_keys_timestamps():
    values = [b"", b"a", b"hello" * 50, bytes(range(256))]
    keys = [None, b"k1", b"", b"\x00"]
    ts = [1, 2, 3, 2**62]
    c = chunk.Chunk(make(values, keys, ts))
    assert c.values() == values
    assert c.keys() == keys
    assert c.timestamps.tolist() == ts
    h = c.header
    assert (h.producer_id, h.sequence, h.stream_id, h.streamlet, h.record_count) == (7, 3, 11, 2, 4)
    assert list(c.records()) == list(zip(keys, values, ts))


def test_keyless_chunk_has_no_key_columns():
    raw = make([b"x", b"y"])
    c = chunk.Chunk(raw)
    assert not c.header.has_keys
    assert c.keys() == [None, None]
    assert len(raw) == chunk.HEADER_SIZE + 2 * 8 + 3 * 4 + 2


def test_attributes_unset_until_stamped_and_stamp_keeps_checksums_valid():
    raw = bytearray(make([b"v"] * 10))
    h = chunk.verify(raw)
    assert (h.group, h.segment, h.base_offset) == (chunk.UNSET_U32, chunk.UNSET_U32, chunk.UNSET_U64)
    body_crc = h.body_crc
    chunk.stamp(raw, 5, 2, 12345)
    h2 = chunk.verify(raw)
    assert (h2.group, h2.segment, h2.base_offset) == (5, 2, 12345)
    assert h2.body_crc == body_crc


@pytest.mark.parametrize("where", ["header", "body"])
def test_any_flipped_bit_is_caught(where):
    raw = bytearray(make([b"abc" * 30] * 20, keys=[b"k"] * 20))
    rng = random.Random(1)
    for _ in range(200):
        damaged = bytearray(raw)
        lo, hi = (0, chunk.HEADER_SIZE) if where == "header" else (chunk.HEADER_SIZE, len(raw))
        i = rng.randrange(lo, hi)
        damaged[i] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptChunk):
            chunk.verify(damaged)


def test_truncated_and_garbage_chunks_are_refused():
    raw = make([b"x"] * 5)
    for cut in (0, 10, chunk.HEADER_SIZE - 1, chunk.HEADER_SIZE, len(raw) - 1):
        with pytest.raises(CorruptChunk):
            chunk.verify(raw[:cut])
    with pytest.raises(CorruptChunk):
        chunk.verify(b"\xff" * 200)


def test_layout_lies_are_refused_even_with_valid_checksums():
    # A record count that claims more than the body holds.
    raw = bytearray(make([b"x"] * 5))
    struct.pack_into("<I", raw, 44, 10_000)
    struct.pack_into("<I", raw, 4, chunk.header_crc(raw))
    with pytest.raises(CorruptChunk):
        chunk.Chunk(raw)
    # Offsets that run backwards, re-sealed so both checksums pass.
    good = chunk.Chunk(make([b"ab", b"cd", b"ef"]))
    body = bytearray(good.buf[chunk.HEADER_SIZE:])
    struct.pack_into("<I", body, 8 * 3 + 4, 5)  # value_offsets[1] = 5 > offsets[2] = 4
    resealed = chunk.seal(0, bytes(body), 1, 0, 1, 0, 3)
    with pytest.raises(CorruptChunk):
        chunk.Chunk(resealed)


@pytest.mark.parametrize("records", [3, 64, 100])   # checked as a list, and with numpy
@pytest.mark.parametrize("damage", ["backwards", "not from 0", "ends early", "ends late"])
def test_value_offsets_that_run_backwards_start_late_or_miss_the_end_are_refused(records, damage):
    good = chunk.Chunk(make([b"ab"] * records))
    body = bytearray(good.buf[chunk.HEADER_SIZE:])
    at = 8 * records                                  # value_offsets, after the timestamps
    if damage == "backwards":
        struct.pack_into("<I", body, at + 4 * (records - 1), 2 * records + 1)  # > the last
    elif damage.startswith("ends"):   # the last offset is not where the values' bytes end
        last = 2 * records + (1 if damage == "ends late" else -1)
        struct.pack_into("<I", body, at + 4 * records, last)
    else:
        struct.pack_into("<I", body, at, 1)
    resealed = chunk.seal(0, bytes(body), 1, 0, 1, 0, records)
    with pytest.raises(CorruptChunk, match="columns do not match"):
        chunk.Chunk(resealed)


def test_numpy_inputs():
    fixed = np.frombuffer(bytes(range(40)), dtype=np.uint8).reshape(4, 10)
    assert chunk.Chunk(make(fixed)).values() == [bytes(r) for r in fixed]
    s = np.array([b"abc", b"de", b""], dtype="S3")
    assert chunk.Chunk(make(s)).values() == [b"abc", b"de", b""]
    full = np.array([b"abc", b"xyz"], dtype="S3")
    assert chunk.Chunk(make(full)).values() == [b"abc", b"xyz"]
    with pytest.raises(TypeError):
        make(np.zeros(3, dtype=np.float64))


def test_arrow_inputs_including_sliced_and_large_binary():
    arr = pa.array([b"q", b"rr", b"sss", b"tttt"]).slice(1, 2)
    assert chunk.Chunk(make(arr)).values() == [b"rr", b"sss"]
    large = pa.array([b"a", b"bb"], type=pa.large_binary())
    assert chunk.Chunk(make(large)).values() == [b"a", b"bb"]
    strings = pa.array(["x", "yz"])
    assert chunk.Chunk(make(strings)).values() == [b"x", b"yz"]
    with pytest.raises(TypeError):
        make(pa.array([b"a", None]))


def test_to_arrow_matches_python_view():
    values = [b"v%d" % i for i in range(100)]
    keys = [None if i % 3 == 0 else b"k%d" % i for i in range(100)]
    c = chunk.Chunk(make(values, keys, list(range(100))))
    batch = c.to_arrow()
    assert batch.schema.names == ["key", "value", "timestamp"]
    assert batch.column("value").to_pylist() == values
    assert batch.column("key").to_pylist() == keys
    assert batch.column("timestamp").to_pylist() == list(range(100))


def test_empty_chunk_and_mismatched_lengths():
    c = chunk.Chunk(make([]))
    assert len(c) == 0 and c.values() == [] and c.to_arrow().num_rows == 0
    with pytest.raises(ValueError):
        make([b"a", b"b"], keys=[b"k"])
    with pytest.raises(ValueError):
        make([b"a", b"b"], ts=[1])


def test_oversized_chunk_is_refused(monkeypatch):
    monkeypatch.setattr(chunk, "MAX_CHUNK_BYTES", 1000)
    with pytest.raises(RecordTooLarge):
        make([b"x" * 2000])


def test_reseal_changes_identity_only():
    raw = make([b"a", b"b"], producer=1, seq=0)
    again = chunk.reseal(raw, 99, 5)
    h = chunk.verify(again)
    assert (h.producer_id, h.sequence) == (99, 5)
    assert chunk.Chunk(again).values() == [b"a", b"b"]
    assert chunk.chunk_size(again) == len(raw)


@pytest.mark.parametrize("shape", [(0, 5), (1, 0), (35, 100), (4, 10)])
def test_rows_encode_to_the_bytes_their_values_make_as_a_list(shape):
    """2-D rows take cached offsets and a repeated timestamp; the chunk must be the very one
    the same values make through the general path."""
    grid = np.random.default_rng(sum(shape)).integers(0, 255, size=shape, dtype=np.uint8)
    for _ in range(2):   # the second time from the offsets cache
        assert make(grid, ts=1234) == make([bytes(r) for r in grid], ts=np.full(shape[0], 1234))
    offsets = chunk.values_columns(grid)[1]
    assert not offsets.flags.writeable   # shared by every chunk of this shape
    assert offsets.tolist() == [i * shape[1] for i in range(shape[0] + 1)]


def test_one_timestamp_for_all_records_and_its_range():
    before = chunk.time.time_ns() // 1000
    stamped = chunk.Chunk(make([b"a", b"b", b"c"])).timestamps.tolist()
    assert len(set(stamped)) == 1 and before <= stamped[0] <= chunk.time.time_ns() // 1000
    assert chunk.Chunk(make([b"a", b"b"], ts=-5)).timestamps.tolist() == [-5, -5]
    assert chunk.Chunk(make([b"a"], ts=np.int64(9))).timestamps.tolist() == [9]
    with pytest.raises(ValueError, match="does not fit a signed 64-bit integer"):
        make([b"a"], ts=1 << 63)


@pytest.mark.parametrize("cuts", [[], [0], [3], [0, 5, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_a_chunk_sealed_from_parts_is_the_chunk_sealed_from_their_join(cuts):
    body = bytes(chunk.encode(1, 0, 1, 0, [b"ab", b"", b"cdefg"]))[chunk.HEADER_SIZE:]
    parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    sealed = chunk.seal_parts(0, [memoryview(p) for p in parts], 9, 8, 7, 6, 3)
    assert sealed == chunk.seal(0, body, 9, 8, 7, 6, 3)
    h = chunk.verify(sealed)
    assert (h.producer_id, h.sequence, h.stream_id, h.streamlet, h.record_count) == (9, 8, 7, 6, 3)
    assert (h.group, h.segment, h.base_offset, h.number) == (
        chunk.UNSET_U32, chunk.UNSET_U32, chunk.UNSET_U64, None)
    assert chunk.Chunk(sealed).values() == [b"ab", b"", b"cdefg"]


@pytest.mark.parametrize("shape", [(1, 1), (35, 100), (3, 0), (100, 7)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_rows_encode_to_the_same_bytes_as_the_general_columns_path(shape, layout):
    rows = np.random.default_rng(3).integers(0, 256, size=shape, dtype=np.uint8)
    if layout == "strided":
        rows = np.repeat(rows, 2, axis=1)[:, ::2]     # the same values, not C-contiguous
    got = chunk.encode(1, 2, 3, 4, rows, timestamps=123)
    blob, offsets = chunk.values_columns(np.ascontiguousarray(rows))
    assert got == chunk.encode_columns(1, 2, 3, 4, blob, offsets, None, 123)
    assert chunk.Chunk(got).values() == [bytes(r) for r in rows]
