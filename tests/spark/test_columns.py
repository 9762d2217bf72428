"""Arrow <-> chunk conversions, key hashing and deterministic chunk cutting (no Spark, no sockets)."""

import os
import random

import numpy as np
import pyarrow as pa
import pytest

from kera.codec import chunk as kchunk
from kera.codec.partitioner import streamlet_for_key
from kera.spark.chunking import ChunkPlanner
from kera.spark.columns import (ARROW_SCHEMA, as_binary, chunk_rows, concat, encode_arrow, header_pairs,
                                header_sizes, record_sizes)
from kera.spark.fetch import GroupRange, GroupReader
from kera.spark.hashing import crc32c_column, streamlets_of_keys


def test_encode_arrow_is_byte_identical_to_chunk_encode():
    values = [b"v%d" % i * (i % 5) for i in range(50)]
    keys = [None if i % 7 == 0 else b"k%d" % i for i in range(50)]
    ts = np.arange(50, dtype=np.int64) * 1000
    expected = kchunk.encode(11, 3, 5, 2, values, keys, ts)
    got = encode_arrow(11, 3, 5, 2, pa.array(values, pa.binary()), pa.array(keys, pa.binary()), ts)
    assert got == expected
    # keyless: no key column at all, as encode does
    assert encode_arrow(1, 0, 5, 0, pa.array(values, pa.binary()), None, ts) == kchunk.encode(1, 0, 5, 0, values, None, ts)
    assert encode_arrow(1, 0, 5, 0, pa.array(values, pa.binary()), pa.nulls(50, pa.binary()), ts) == \
        kchunk.encode(1, 0, 5, 0, values, [None] * 50, ts)
    # sliced and string inputs
    sliced = as_binary(pa.array([v.decode() for v in values], pa.string())).slice(10, 20)
    assert encode_arrow(1, 0, 5, 0, sliced, None, ts[10:30]) == kchunk.encode(1, 0, 5, 0, values[10:30], None, ts[10:30])


def test_chunk_rows_slices_and_adds_constant_columns():
    values = [b"value-%d" % i for i in range(10)]
    keys = [b"k%d" % i if i % 2 else None for i in range(10)]
    ts = np.arange(10, dtype=np.int64) + 1_700_000_000_000_000
    c = kchunk.Chunk(kchunk.encode(1, 0, 5, 3, values, keys, ts))
    rows = chunk_rows(c, 2, 7, "clicks", 3, 4, 100)
    assert rows.schema == ARROW_SCHEMA
    d = rows.to_pydict()
    assert d["value"] == values[2:7] and d["key"] == keys[2:7]
    assert d["offset"] == list(range(102, 107))
    assert set(d["stream"]) == {"clicks"} and set(d["streamlet"]) == {3} and set(d["group"]) == {4}
    assert [t.timestamp() for t in rows.column("timestamp").to_pylist()] == pytest.approx(ts[2:7] / 1e6)
    both = concat([rows, chunk_rows(c, 0, 1, "clicks", 3, 4, 100)])
    assert both.num_rows == 6 and both.schema == ARROW_SCHEMA
    assert d["headers"] == [[]] * 5


def test_chunk_rows_carry_each_records_headers_compressed_or_not():
    headers = [[("a", b"1"), ("b", b"")], None, [], [("\u00e9t\u00e9", b"\xff" * 3)]]
    for compression in (None, "lz4", "zstd"):
        c = kchunk.Chunk(kchunk.encode(1, 0, 5, 0, [b"w", b"x", b"y", b"z"], headers=headers,
                                       compression=compression))
        rows = chunk_rows(c, 1, 4, "s", 0, 0, 0).to_pydict()["headers"]
        assert [[(h["key"], h["value"]) for h in hs] for hs in rows] == \
            [list(h or []) for h in headers[1:]] == [[(k, v) for k, v in h] for h in c.headers()[1:]]


def test_vectorized_crc32c_matches_partitioner():
    rnd = random.Random(7)
    keys = [os.urandom(rnd.randint(0, 40)) for _ in range(3000)] + [b""]
    arr = pa.array(keys, pa.binary())
    assert crc32c_column(arr).tolist() == [kchunk.crc32c(k) for k in keys]
    assert crc32c_column(arr.slice(13, 500)).tolist() == [kchunk.crc32c(k) for k in keys[13:513]]
    long = pa.array([os.urandom(1000), b"x"], pa.binary())
    assert crc32c_column(long).tolist() == [kchunk.crc32c(k) for k in long.to_pylist()]
    with_nulls = pa.array([b"a", None, b"bc"], pa.binary())
    assert streamlets_of_keys(with_nulls, 7).tolist() == [streamlet_for_key(b"a", 7), -1, streamlet_for_key(b"bc", 7)]


def _cut(rows, sizes_of_batches, streamlets=4, chunk_size=300, seed=1):
    """Chunks (streamlet, values, keys) for `rows` fed in batches of the given sizes."""
    planner = ChunkPlanner(streamlets, chunk_size, keyless_seed=seed)
    out, i = [], 0
    for n in sizes_of_batches:
        part = rows[i:i + n]
        i += n
        vals = pa.array([v for _, v in part], pa.binary())
        keys = pa.array([k for k, _ in part], pa.binary())
        out += planner.add(vals, keys, np.zeros(len(part), np.int64))
    out += planner.flush()
    return [(c.streamlet, c.values.to_pylist(), None if c.keys is None else c.keys.to_pylist()) for c in out]


def test_chunk_cuts_do_not_depend_on_batching():
    rnd = random.Random(3)
    rows = [(None if rnd.random() < 0.3 else b"key%d" % rnd.randint(0, 20), os.urandom(rnd.randint(1, 60)))
            for _ in range(700)]
    one = _cut(rows, [700])
    many = _cut(rows, [1, 99, 250, 3, 347])
    assert one == many
    # every row exactly once, keyed rows on their key's streamlet, per-key order kept
    flat = [(k, v) for sl, vals, keys in one for k, v in zip(keys or [None] * len(vals), vals)]
    assert sorted(flat, key=repr) == sorted(rows, key=repr)
    for sl, vals, keys in one:
        if keys is not None:
            assert {streamlet_for_key(k, 4) for k in keys} == {sl}
    for key in {k for k, _ in rows if k is not None}:
        want = [v for k, v in rows if k == key]
        got = [v for sl, vals, keys in one if keys for k, v in zip(keys, vals) if k == key]
        assert got == want
    # chunks stay near the target size
    assert all(sum(record_sizes(pa.array(vals, pa.binary()), None)) < 300 + 80 for _, vals, _ in one)


def test_keyless_chunks_rotate_over_streamlets_from_the_seed():
    rows = [(None, b"x" * 50) for _ in range(40)]
    chunks = _cut(rows, [40], streamlets=3, chunk_size=200, seed=2)
    assert [sl for sl, _, _ in chunks][:4] == [2, 0, 1, 2]
    assert all(keys is None for _, _, keys in chunks)


def _reply(chunks, groups=()):
    return {"ok": True, "results": [[None, len(chunks), [list(g) for g in groups]]]}, chunks


def test_group_reader_slices_to_range_and_skips_other_groups():
    def stamped(group, base, values):
        buf = bytearray(kchunk.encode(1, 0, 5, 0, values, None, 0))
        kchunk.stamp(buf, group, 0, base)
        return bytes(buf)

    part = GroupRange("127.0.0.1:1", "s", 5, 0, 2, start=3, end=12, address="a", fetch_max_bytes=1 << 20, timeout_s=1)
    reader = GroupReader(part)
    assert reader.fetch_fields()["reads"] == [[5, 0, {"low": 2, "offsets": {2: 3}}, 1 << 20]]
    header, frames = _reply([stamped(2, 0, [b"a%d" % i for i in range(5)]),
                             stamped(3, 0, [b"other"]),
                             stamped(2, 5, [b"b%d" % i for i in range(5)])],
                            groups=[[2, 0, 0, 20, False], [3, 1, 0, 7, False]])
    rows = reader.on_reply(header, frames)
    assert rows.column("value").to_pylist() == [b"a3", b"a4", b"b0", b"b1", b"b2", b"b3", b"b4"]
    assert rows.column("offset").to_pylist() == list(range(3, 10))
    assert reader.position == 10 and not reader.done
    # the other group is parked at its durable end in the next cursor
    assert reader.fetch_fields()["reads"][0][2] == {"low": 2, "offsets": {3: 7, 2: 10}}
    rows = reader.on_reply(*_reply([stamped(2, 10, [b"c0", b"c1", b"c2"])]))
    assert rows.column("value").to_pylist() == [b"c0", b"c1"] and reader.done


def test_group_reader_reports_errors_and_gaps():
    from kera.errors import NotOwner
    from kera.spark.offsets import DataLoss

    part = GroupRange("x", "s", 5, 0, 0, start=0, end=5, address="a", fetch_max_bytes=100, timeout_s=1)
    reader = GroupReader(part)
    with pytest.raises(NotOwner):
        reader.on_reply({"results": [[["not_owner", "moved", True], 0, []]]}, [])
    buf = bytearray(kchunk.encode(1, 0, 5, 0, [b"a"], None, 0))
    kchunk.stamp(buf, 0, 0, 2)  # starts at 2, reader is at 0
    with pytest.raises(DataLoss):
        reader.on_reply(*_reply([bytes(buf)]))
    # failOnDataLoss=false: skip the lost records, keep the rest
    part.fail_on_data_loss = False
    rows = GroupReader(part).on_reply(*_reply([bytes(buf)]))
    assert rows.column("offset").to_pylist() == [2]


def _cut_with_headers(rows, sizes_of_batches, streamlets=3, chunk_size=250):
    """Encoded chunks (streamlet, bytes) for (key, value, headers) rows fed in batches."""
    planner = ChunkPlanner(streamlets, chunk_size, keyless_seed=0)
    planned, i = [], 0
    for n in sizes_of_batches:
        part = rows[i:i + n]
        i += n
        headers = pa.array([None if h is None else [{"key": k, "value": v} for k, v in h]
                            for _, _, h in part], kchunk.HEADERS_ARROW_TYPE)
        planned += planner.add(pa.array([v for _, v, _ in part], pa.binary()),
                               pa.array([k for k, _, _ in part], pa.binary()),
                               np.arange(i - n, i, dtype=np.int64), headers)
    planned += planner.flush()
    return [(c.streamlet, encode_arrow(5, seq, 1, c.streamlet, c.values, c.keys, c.timestamps,
                                       c.headers)) for seq, c in enumerate(planned)]


def test_sink_headers_travel_with_their_rows_whatever_the_batching():
    rnd = random.Random(11)
    rows = []
    for i in range(300):
        headers = None if i % 7 == 0 else [("h%d" % j, os.urandom(rnd.randint(0, 9)))
                                             for j in range(rnd.randint(0, 3))]
        rows.append((None if i % 3 == 0 else b"k%d" % (i % 11), b"v%d" % i, headers))
    one = _cut_with_headers(rows, [300])
    assert one == _cut_with_headers(rows, [5, 120, 1, 174])
    got = {}
    for _, data in one:
        c = kchunk.Chunk(data)   # a chunk none of whose rows has headers is a plain one
        for value, headers in zip(c.values(), c.headers()):
            got[value] = list(headers)
    assert got == {v: (h or []) for _, v, h in rows}


def test_a_headers_column_counts_in_the_chunk_size_and_null_keys_are_refused():
    t = kchunk.HEADERS_ARROW_TYPE
    headers = pa.array([[{"key": "a", "value": b"xy"}], None, [],
                        [{"key": "bb", "value": b""}, {"key": "c", "value": b"123"}]], t)
    assert header_sizes(headers).tolist() == [11, 0, 0, 22]
    assert header_sizes(headers.slice(1, 3)).tolist() == [0, 0, 22]
    assert header_pairs(pa.array([[], None], t)) is None      # no row has one: v1 chunk
    with pytest.raises(ValueError, match="needs a key"):
        header_pairs(pa.array([[{"key": None, "value": b"x"}]], t))
