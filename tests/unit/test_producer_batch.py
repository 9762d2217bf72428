"""send_batch's planning: measuring, grouping by streamlet and cutting into chunk-sized pieces."""

import numpy as np
import pyarrow as pa
import pytest
from crc32c import crc32c

from kera.codec import chunk
from kera.errors import RecordTooLarge
from kera.codec.partitioner import streamlet_for_key, streamlets_for_keys
from kera.producer import batch

CAP = 1000


def encode(piece):
    return chunk.Chunk(chunk.encode(1, 0, 1, piece.streamlet or 0, piece.values, piece.keys, piece.timestamps))


def test_split_by_size_fills_pieces_greedily():
    sizes = np.array([400, 400, 300, 1200, 10, 990, 1], dtype=np.int64)
    assert batch.split_by_size(sizes, CAP) == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    assert batch.split_by_size(np.array([], dtype=np.int64), CAP) == []


def greedy(sizes, capacity):
    """The cut split_by_size promises, one record at a time."""
    ranges, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and used + size > capacity:
            ranges.append((start, i))
            start, used = i, 0
        used += size
    if len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


@pytest.mark.parametrize("size", [1, 137, CAP // 4, CAP // 3, CAP - 1, CAP, CAP + 1, 3 * CAP])
@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_records_of_one_size_are_cut_as_the_greedy_loop_cuts_them(n, size):
    sizes = np.full(n, size, dtype=np.int64)
    assert batch.split_by_size(sizes, CAP) == greedy(sizes.tolist(), CAP)


def test_mixed_sizes_still_take_the_greedy_loop():
    rng = np.random.default_rng(3)
    for _ in range(50):
        sizes = rng.integers(1, 2 * CAP, size=rng.integers(1, 60)).astype(np.int64)
        sizes[-1] = sizes[0]      # equal ends, unequal middle: not the uniform case
        assert batch.split_by_size(sizes, CAP) == greedy(sizes.tolist(), CAP)


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy_s", "uint8_2d", "arrow", "arrow_large", "chunked"])
def test_value_containers_plan_to_the_same_records(kind):
    rng = np.random.default_rng(1)
    if kind == "uint8_2d":
        grid = rng.integers(1, 255, size=(500, 37), dtype=np.uint8)
        values = grid
        expect = [bytes(r) for r in grid]
    else:
        expect = [bytes(rng.integers(1, 255, size=rng.integers(0, 60), dtype=np.uint8)) for _ in range(500)]
        values = {
            "list": expect, "tuple": tuple(expect), "numpy_s": np.array(expect, dtype="S60"),
            "arrow": pa.array(expect, pa.binary()), "arrow_large": pa.array(expect, pa.large_binary()),
            "chunked": pa.chunked_array([pa.array(expect[:200], pa.binary()), pa.array(expect[200:], pa.binary())]),
        }[kind]
    n, pieces = batch.plan(values, None, 7, streamlets=4, capacity=CAP, max_record_bytes=1000, keyless_streamlet=0)
    pieces = list(pieces)
    assert n == 500
    assert all(p.streamlet is None for p in pieces)
    decoded = [encode(p) for p in pieces]
    assert [v for c in decoded for v in c.values()] == expect
    for c in decoded:
        assert c.header.body_len <= CAP + 4
        assert set(c.timestamps.tolist()) == {7}


def test_keyed_batch_groups_by_crc32c_streamlet_keeping_input_order():
    values = [f"v{i}".encode() for i in range(1000)]
    keys = [f"k{i % 37}".encode() if i % 10 else None for i in range(1000)]
    ts = np.arange(1000, dtype=np.int64)
    n, pieces = batch.plan(values, keys, ts, streamlets=5, capacity=CAP, max_record_bytes=1000,
                           keyless_streamlet=3)
    got = {}
    for p in pieces:
        c = encode(p)
        got.setdefault(p.streamlet, []).extend(zip(c.keys(), c.values(), c.timestamps.tolist()))
    for sl in range(5):
        want = [(k, v, int(t)) for k, v, t in zip(keys, values, ts)
                if (3 if k is None else crc32c(k) % 5) == sl]
        assert got.get(sl, []) == want


def test_keyed_numpy_and_arrow_keys():
    values = np.array([b"a", b"b", b"c"], dtype="S1")
    for keys in (np.array([b"x", b"y", b"x"]), pa.array([b"x", b"y", b"x"])):
        _, pieces = batch.plan(values, keys, None, streamlets=8, capacity=CAP, max_record_bytes=10,
                               keyless_streamlet=0)
        by = {p.streamlet: encode(p).values() for p in pieces}
        assert by[crc32c(b"x") % 8] == [b"a", b"c"]
        assert by[crc32c(b"y") % 8] == [b"b"]


def test_batch_refused_whole_before_any_piece():
    with pytest.raises(RecordTooLarge):
        batch.plan([b"ok", b"x" * 101], None, None, streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0)
    with pytest.raises(TypeError):
        batch.plan([b"ok", "text"], None, None, streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0)
    with pytest.raises(ValueError):
        batch.plan([b"a", b"b"], [b"k"], None, streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0)
    with pytest.raises(ValueError):
        batch.plan([b"a", b"b"], None, [1, 2, 3], streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0)


def test_large_batch_beyond_the_chunk_limit_is_cut_without_a_giant_blob():
    values = np.zeros((700_000, 100), dtype=np.uint8)  # 70 MB: more than one chunk may hold
    n, pieces = batch.plan(values, None, None, streamlets=1, capacity=16 * 1024, max_record_bytes=1000,
                           keyless_streamlet=0)
    count = 0
    for p in pieces:
        assert p.count <= 16 * 1024 // 112
        count += p.count
    assert count == n == 700_000


def test_partitioner_is_crc32c_mod_streamlets():
    assert streamlet_for_key(b"user-1", 7) == crc32c(b"user-1") % 7
    assert streamlets_for_keys([b"a", None, b"b"], 3).tolist() == [crc32c(b"a") % 3, -1, crc32c(b"b") % 3]


def test_bytes_like_items_of_a_list():
    items = [np.bytes_(b"ab"), bytearray(b"cd"), memoryview(np.array([1, 2], dtype="<u2")), b"e"]
    _, pieces = batch.plan(items, [bytearray(b"k"), None, memoryview(b"m"), np.bytes_(b"n")], None,
                           streamlets=1, capacity=CAP, max_record_bytes=100, keyless_streamlet=0)
    (p,) = list(pieces)
    c = encode(p)
    assert c.values() == [b"ab", b"cd", b"\x01\x00\x02\x00", b"e"]
    assert c.keys() == [b"k", None, b"m", b"n"]


@pytest.mark.parametrize("keyed", [False, True])
def test_headers_follow_their_records_into_pieces_and_count_toward_the_size(keyed):
    n = 300
    values = [b"v%03d" % i for i in range(n)]
    keys = [b"k%d" % (i % 7) for i in range(n)] if keyed else None
    headers = [[("trace", b"t%d" % i), ("n", b"x" * (i % 5))] if i % 3 else None
               for i in range(n)]
    _, plain = batch.plan(values, keys, 7, streamlets=3, capacity=CAP, max_record_bytes=1000,
                          keyless_streamlet=0)
    count, pieces = batch.plan(values, keys, 7, streamlets=3, capacity=CAP,
                               max_record_bytes=1000, keyless_streamlet=0, headers=headers)
    pieces, plain = list(pieces), list(plain)
    assert count == n and len(pieces) > len(plain), "header bytes need more chunks"
    seen = {}
    for p in pieces:
        c = chunk.Chunk(chunk.encode(1, 0, 1, p.streamlet or 0, p.values, p.keys, p.timestamps,
                                     headers=p.headers))
        assert len(c.buf) <= CAP + chunk.HEADER_SIZE + 4 + 64
        for value, hs in zip(c.values(), c.headers()):
            seen[value] = hs
    assert len(seen) == n
    for i, value in enumerate(values):
        assert list(seen[value] or []) == (headers[i] or []), i


def test_bad_headers_refuse_the_whole_batch():
    with pytest.raises(ValueError, match="2 header lists for 3 values"):
        batch.plan([b"a", b"b", b"c"], None, None, streamlets=1, capacity=CAP,
                   max_record_bytes=1000, keyless_streamlet=0, headers=[None, None])
    with pytest.raises(TypeError, match="pairs"):
        batch.plan([b"a"], None, None, streamlets=1, capacity=CAP, max_record_bytes=1000,
                   keyless_streamlet=0, headers=[[("k", b"v", b"extra")]])
    with pytest.raises(RecordTooLarge):
        batch.plan([b"a"], None, None, streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0, headers=[[("big", b"x" * 200)]])


def test_a_header_list_shared_by_many_records_is_copied_once_for_all_of_them():
    value = bytearray(b"v1")
    shared = [("trace", value)]
    n, pieces = batch.plan([b"a"] * 500, None, None, streamlets=1, capacity=CAP,
                           max_record_bytes=1000, keyless_streamlet=0,
                           headers=[shared] * 250 + [None] * 250)
    value[:] = b"XX"                                 # the caller reuses its buffer
    got = [h for p in pieces for h in p.headers]
    assert got[:250] == [[("trace", b"v1")]] * 250 and got[250:] == [None] * 250
    assert len({id(h) for h in got[:250]}) == 1, "normalized once, shared"


@pytest.mark.parametrize("width", [0, 1, 100, CAP - 12, CAP, 3 * CAP])
@pytest.mark.parametrize("n", [0, 1, 35, 500])
def test_rows_are_cut_as_the_same_values_given_as_a_list(n, width):
    """A 2-D uint8 batch skips per-record measuring; its pieces must be the ones its rows
    make as a list of bytes (the measured path): same ranges, same records, same timestamps."""
    grid = np.random.default_rng(n + width).integers(0, 255, size=(n, width), dtype=np.uint8)
    ts = np.arange(n, dtype=np.int64) + 10
    args = dict(streamlets=4, capacity=CAP, max_record_bytes=4 * CAP, keyless_streamlet=0)
    n_rows, rows = batch.plan(grid, None, ts, **args)
    n_list, listed = batch.plan([bytes(r) for r in grid], None, ts, **args)
    rows, listed = list(rows), list(listed)
    assert n_rows == n_list == n
    assert [p.count for p in rows] == [p.count for p in listed]
    assert [encode(p).values() for p in rows] == [encode(p).values() for p in listed]
    assert [encode(p).timestamps.tolist() for p in rows] == [encode(p).timestamps.tolist() for p in listed]


def test_rows_wider_than_the_record_limit_are_refused_whole():
    grid = np.zeros((3, 101), dtype=np.uint8)
    with pytest.raises(RecordTooLarge, match="101 bytes exceeds max_record_bytes=100"):
        batch.plan(grid, None, None, streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0)
    with pytest.raises(ValueError, match="2 timestamps for 3 values"):
        batch.plan(grid[:, :10], None, [1, 2], streamlets=1, capacity=CAP, max_record_bytes=100,
                   keyless_streamlet=0)
