"""Kafka record batches (kera.codec.kafka_batch) and the chunk that carries one (FLAG_KAFKA):
built, checked and decoded as Kafka's wire has them, proved against kafka-python's own
reader and writer."""

import gzip
import random
import struct
import types

import cramjam
import crc32c
import kafka.codec
import lz4.frame
import pytest
import zstandard
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from kera.codec import chunk
from kera.codec import kafka_batch as kb
from kera.errors import CorruptChunk

CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
# Past kafka_batch.MAX_PLAIN_BYTES (64 MiB): what a hostile block decompresses to.
BOMB_BYTES = kb.MAX_PLAIN_BYTES + 1
# kafka-python's builder: a batch of up to this many bytes (its own limit argument).
BUILDER_BYTES = 1 << 22


def _rows(rng: random.Random, n: int) -> list:
    """Random build() rows: null keys and values, empty ones, headers with null values and
    non-ASCII keys, timestamps before the first (negative deltas), some values long enough
    that their lengths pass the precomputed varints (8191)."""
    rows = []
    for _ in range(n):
        key = None if rng.random() < 0.3 else rng.randbytes(rng.randrange(0, 12))
        size = rng.randrange(9000, 20000) if rng.random() < 0.05 else rng.randrange(0, 200)
        value = None if rng.random() < 0.2 else _repeating(rng, size)
        headers = [(f"h{rng.randrange(4)}é",
                    None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 9)))
                   for _ in range(rng.randrange(0, 3))]
        rows.append((1_700_000_000_000 + rng.randrange(-5000, 5000), key, value, headers))
    return rows


def _repeating(rng: random.Random, size: int) -> bytes:
    """`size` random bytes that repeat every 8 (so that every codec finds a gain: kafka-python
    sends a batch plain when compressing it does not pay)."""
    return (rng.randbytes(8) * (size // 8 + 1))[:size]


def _as_rows(records) -> list:
    return [(r.timestamp_ms, r.key, r.value, r.headers) for r in records]


def _reseal(buf: bytearray) -> bytes:
    """`buf` with its batch length and CRC made right again after an edit."""
    struct.pack_into(">i", buf, 8, len(buf) - kb.LENGTH_AFTER)
    struct.pack_into(">I", buf, kb.CRC_AT, crc32c.crc32c(bytes(buf[kb.CRC_FROM:])))
    return bytes(buf)


def _recompressed(batch: bytes, codec: int, block: bytes) -> bytes:
    """`batch` (uncompressed) with `block` as its records section under `codec`."""
    buf = bytearray(batch[:kb.HEADER_SIZE]) + block
    attributes, = struct.unpack_from(">h", buf, 21)
    struct.pack_into(">h", buf, 21, attributes & ~kb.CODEC_MASK | codec)
    return _reseal(buf)


@pytest.fixture
def snappy_for_kafka_python(monkeypatch):
    """kafka-python's snappy codec needs python-snappy; cramjam's raw snappy stands in for it
    (its writer frames the blocks as Java clients do, xerial's way)."""
    shim = types.SimpleNamespace(compress=lambda b: bytes(cramjam.snappy.compress_raw(bytes(b))),
                                 decompress=lambda b: bytes(cramjam.snappy.decompress_raw(bytes(b))))
    monkeypatch.setattr(kafka.codec, "snappy", shim)


def _kafka_python_batch(codec: int, rows: list) -> bytes:
    builder = DefaultRecordBatchBuilder(2, codec, False, -1, -1, -1, BUILDER_BYTES)
    for i, (ts, key, value, headers) in enumerate(rows):
        assert builder.append(i, ts, key, value, headers) is not None
    return bytes(builder.build())


# --------------------------------------------------------------------------- build and read

@pytest.mark.parametrize("seed", range(20))
def test_build_then_records_round_trip(seed):
    rng = random.Random(seed)
    rows = _rows(rng, rng.randrange(1, 60))
    batch = kb.build(rows, base_offset=rng.randrange(1 << 40))
    got = kb.records(batch)
    assert _as_rows(got) == [(t, k, v, list(h)) for t, k, v, h in rows]
    assert [r.offset_delta for r in got] == list(range(len(rows)))
    h = kb.check(batch)
    assert (h.count, h.last_offset_delta, h.codec) == (len(rows), len(rows) - 1, 0)
    assert h.base_timestamp_ms == rows[0][0] and h.max_timestamp_ms == max(r[0] for r in rows)


def test_build_offset_deltas_past_the_varint_table():
    rows = [(5, None, b"v", [])] * (kb.VARINT_TABLE_SIZE + 10)
    got = kb.records(kb.build(rows))
    assert [r.offset_delta for r in got] == list(range(len(rows)))


def test_build_refuses_no_rows():
    with pytest.raises(ValueError):
        kb.build([])


@pytest.mark.parametrize("base_offset", [0, 100, 2**40])
def test_built_batch_parses_in_kafka_python_with_its_offsets(base_offset):
    rows = _rows(random.Random(base_offset), 30)
    batch = DefaultRecordBatch(bytearray(kb.build(rows, base_offset=base_offset, producer_id=7,
                                                  producer_epoch=2, base_sequence=40)))
    assert batch.validate_crc()
    assert (batch.base_offset, batch.producer_id, batch.producer_epoch, batch.base_sequence) == \
        (base_offset, 7, 2, 40)
    got = list(batch)
    assert [r.offset for r in got] == [base_offset + i for i in range(len(rows))]
    assert [(r.timestamp, r.key, r.value, r.headers) for r in got] == \
        [(t, k, v, list(h)) for t, k, v, h in rows]


@pytest.mark.parametrize("codec", list(CODECS))
def test_kafka_python_batches_of_every_codec_decode(codec, snappy_for_kafka_python):
    rows = _rows(random.Random(codec), 200)
    batch = _kafka_python_batch(CODECS[codec], rows)
    h = kb.check(batch)
    assert h.codec == CODECS[codec]   # compressed, not sent plain for want of a gain
    assert _as_rows(kb.records(batch)) == [(t, k, v, list(h)) for t, k, v, h in rows]


def test_xerial_snappy_of_several_blocks_decodes(snappy_for_kafka_python):
    rows = [(9, b"k", bytes([i % 251]) * 1000, []) for i in range(100)]   # past 3 32 KiB blocks
    batch = _kafka_python_batch(CODECS["snappy"], rows)
    assert batch[kb.HEADER_SIZE:kb.HEADER_SIZE + 8] == kb.XERIAL_MAGIC
    assert _as_rows(kb.records(batch)) == [(t, k, v, []) for t, k, v, _ in rows]


def test_raw_snappy_decodes():
    """librdkafka's snappy: one raw block, no framing."""
    rows = _rows(random.Random(3), 50)
    plain = kb.build(rows)
    block = bytes(cramjam.snappy.compress_raw(plain[kb.HEADER_SIZE:]))
    assert _as_rows(kb.records(_recompressed(plain, 2, block))) == [(t, k, v, list(h)) for t, k, v, h in rows]


def test_log_append_time_gives_every_record_the_max_timestamp():
    buf = bytearray(kb.build([(10, None, b"a", []), (30, None, b"b", [])]))
    struct.pack_into(">h", buf, 21, kb.LOG_APPEND_TIME)
    struct.pack_into(">q", buf, 35, 99)
    assert [r.timestamp_ms for r in kb.records(_reseal(buf))] == [99, 99]


# --------------------------------------------------------------------------- check refuses

def _good() -> bytes:
    return kb.build([(1, b"k", b"v" * 10, [("h", b"x")]), (2, None, None, [])])


def test_check_accepts_a_good_batch():
    assert kb.check(_good()).count == 2


def test_check_refuses_a_flipped_crc_byte():
    buf = bytearray(_good())
    buf[kb.CRC_AT] ^= 0x01
    with pytest.raises(CorruptChunk, match="CRC"):
        kb.check(bytes(buf))


def test_check_refuses_a_flipped_body_byte():
    buf = bytearray(_good())
    buf[-3] ^= 0x40
    with pytest.raises(CorruptChunk, match="CRC"):
        kb.check(bytes(buf))


def test_check_refuses_a_wrong_length():
    with pytest.raises(CorruptChunk, match="length"):
        kb.check(_good() + b"\x00")
    buf = bytearray(_good())
    struct.pack_into(">i", buf, 8, len(buf))
    with pytest.raises(CorruptChunk, match="length"):
        kb.check(bytes(buf))


def test_check_refuses_a_wrong_magic():
    buf = bytearray(_good())
    buf[16] = 1   # outside the CRC: only the magic check can catch it
    with pytest.raises(CorruptChunk, match="magic"):
        kb.check(bytes(buf))


@pytest.mark.parametrize("count,last_delta", [(3, 1), (2, 2), (0, -1)])
def test_check_refuses_a_count_that_disagrees(count, last_delta):
    buf = bytearray(_good())
    struct.pack_into(">i", buf, 57, count)
    struct.pack_into(">i", buf, 23, last_delta)
    with pytest.raises(CorruptChunk, match="records"):
        kb.check(_reseal(buf))


def test_check_refuses_more_records_than_the_bytes_can_hold():
    buf = bytearray(_good())
    struct.pack_into(">i", buf, 57, 1000)
    struct.pack_into(">i", buf, 23, 999)
    with pytest.raises(CorruptChunk, match="cannot fit"):
        kb.check(_reseal(buf))


def test_check_refuses_a_control_batch():
    buf = bytearray(_good())
    struct.pack_into(">h", buf, 21, kb.CONTROL)
    with pytest.raises(CorruptChunk, match="control"):
        kb.check(_reseal(buf))


def test_check_refuses_an_unknown_codec():
    buf = bytearray(_good())
    struct.pack_into(">h", buf, 21, 5)
    with pytest.raises(CorruptChunk, match="codec"):
        kb.check(_reseal(buf))


@pytest.mark.parametrize("cut", [0, 20, kb.HEADER_SIZE - 1, kb.HEADER_SIZE, -1])
def test_check_refuses_truncated_input(cut):
    good = _good()
    with pytest.raises(CorruptChunk):
        kb.check(good[:cut])


def _bomb(codec: str) -> bytes:
    """A batch of one record whose compressed block decompresses past MAX_PLAIN_BYTES."""
    zeros = bytes(BOMB_BYTES)
    block = {"gzip": lambda: gzip.compress(zeros, compresslevel=1),
             "lz4": lambda: lz4.frame.compress(zeros),
             "zstd": lambda: zstandard.ZstdCompressor().compress(zeros),
             # a raw block whose length preamble claims 1 GiB: refused before decompressing
             "snappy": lambda: b"\x80\x80\x80\x80\x04" + b"\x00" * 32}[codec]()
    return _recompressed(kb.build([(0, None, b"v", [])]), CODECS[codec], block)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_records_refuse_a_huge_decompressed_size(codec):
    batch = _bomb(codec)
    assert kb.check(batch).count == 1   # per-batch work cannot see it: decoding must
    with pytest.raises(CorruptChunk, match=str(kb.MAX_PLAIN_BYTES)):
        kb.records(batch)


def test_records_refuse_a_huge_xerial_snappy_claim():
    block = b"\x80\x80\x80\x80\x04" + b"\x00" * 32
    framed = kb.XERIAL_MAGIC + struct.pack(">ii", 1, 1) + struct.pack(">i", len(block)) + block
    with pytest.raises(CorruptChunk, match=str(kb.MAX_PLAIN_BYTES)):
        kb.records(_recompressed(kb.build([(0, None, b"v", [])]), 2, framed))


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_records_refuse_a_block_that_does_not_decompress(codec):
    batch = _recompressed(kb.build([(0, None, b"v", [])]), CODECS[codec], b"\x01garbage" * 4)
    with pytest.raises(CorruptChunk):
        kb.records(batch)


def test_records_refuse_a_truncated_compressed_block():
    plain = kb.build(_rows(random.Random(5), 40))
    block = zstandard.ZstdCompressor().compress(plain[kb.HEADER_SIZE:])
    with pytest.raises(CorruptChunk):
        kb.records(_recompressed(plain, CODECS["zstd"], block[:len(block) // 2]))


def _one_record(body: bytes) -> bytes:
    """A batch of one record with `body` (after its length) as written, length set to fit."""
    return _recompressed(kb.build([(0, None, None, [])]), 0, kb._encode_varint(len(body)) + body)


@pytest.mark.parametrize("body,refusal", [
    (b"\x00\x00\x00\x03\x01\x00", "key length -2"),
    (b"\x00\x00\x00\x01\x03\x00", "value length -2"),
    (b"\x00\x00\x00\x01\x01\x02\x00", "claims 1 headers in 1 bytes"),
    (b"\x00" + b"\xff" * 11 + b"\x00\x00\x01\x01\x00", "runs past 10 bytes"),   # a varlong
    (b"\x00\x00\x00\x01\x01\x02\x02\xff\xfe\x00", "not UTF-8"),
    (b"\x00\x00\x00\x01\x01\x00\x00", "ends at byte 7, its length says 8"),
    (b"\x00\x00\x00\x10ab\x01\x00", "end inside a record"),   # a key past its record
])
def test_records_refuse_malformed_records(body, refusal):
    with pytest.raises(CorruptChunk, match=refusal):
        kb.records(_one_record(body))


def test_records_refuse_stray_bytes_after_the_records():
    plain = kb.build([(0, b"k", b"v", [])])
    with pytest.raises(CorruptChunk, match="stray"):
        kb.records(_recompressed(plain, 0, plain[kb.HEADER_SIZE:] + b"\x00"))


# --------------------------------------------------------------------------- with_offset

def test_with_offset_keeps_the_crc_and_sets_offsets_and_epoch(snappy_for_kafka_python):
    for codec in CODECS.values():
        stored = _kafka_python_batch(codec, _rows(random.Random(codec), 20))
        served = kb.with_offset(memoryview(stored), 12345, leader_epoch=7)
        batch = DefaultRecordBatch(bytearray(served))
        assert batch.validate_crc()
        assert (batch.base_offset, batch.leader_epoch) == (12345, 7)
        assert [r.offset for r in batch] == list(range(12345, 12365))
        assert served[16:] == stored[16:] and kb.check(served).base_offset == 12345


# --------------------------------------------------------------------------- the chunk

def _wrapped(rows, **kw) -> bytes:
    return chunk.wrap(kb.build(rows), producer_id=9, sequence=4, stream_id=3, streamlet=1, **kw)


def test_a_wrapped_batch_is_a_checked_chunk_that_reads_like_any_other():
    rows = [(1000, b"k0", b"v0", [("a", b"1")]), (1001, None, b"v1", []),
            (999, b"k2", None, [("b", None), ("c", b"3")]), (1002, b"", b"", [])]
    buf = _wrapped(rows)
    h = chunk.verify(buf)
    chunk.check_columns(buf, h)
    assert (h.flags, h.record_count, h.producer_id, h.sequence, h.stream_id, h.streamlet) == \
        (chunk.FLAG_KAFKA, 4, 9, 4, 3, 1)
    c = chunk.Chunk(buf)
    assert len(c) == 4
    assert c.values() == [b"v0", b"v1", None, b""]
    assert c.keys() == [b"k0", None, b"k2", b""]
    assert c.key_nulls.tolist() == [0, 1, 0, 0] and c.value_nulls.tolist() == [0, 0, 1, 0]
    assert c.headers() == [[("a", b"1")], [], [("b", b""), ("c", b"3")], []]   # a null is b""
    assert c.timestamps.tolist() == [1_000_000, 1_001_000, 999_000, 1_002_000]
    assert list(c.records()) == list(zip(c.keys(), c.values(), c.timestamps.tolist()))
    table = c.to_arrow().to_pydict()
    assert table == {"key": c.keys(), "value": c.values(), "timestamp": c.timestamps.tolist()}
    assert c.headers_arrow().to_pylist() == [
        [{"key": k, "value": v} for k, v in pairs] for pairs in c.headers()]


def test_a_wrapped_chunk_of_no_keys_nulls_or_headers():
    c = chunk.Chunk(_wrapped([(5, None, b"a", []), (6, None, b"bc", [])]))
    assert (c.keys(), c.values(), c.key_nulls, c.value_nulls, c.has_headers) == \
        ([None, None], [b"a", b"bc"], None, None, False)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_a_wrapped_compressed_batch_is_stored_as_produced_and_read(codec, snappy_for_kafka_python):
    rows = _rows(random.Random(11), 100)
    batch = _kafka_python_batch(CODECS[codec], rows)
    buf = chunk.wrap(batch, 1, 0, 2, 0)
    chunk.check_columns(buf, chunk.verify(buf))
    assert buf[chunk.HEADER_SIZE:] == batch
    c = chunk.Chunk(buf)
    assert c.values() == [v for _, _, v, _ in rows]
    assert c.keys() == [k for _, k, _, _ in rows]


def test_a_wrapped_chunk_takes_the_brokers_stamp_and_number():
    buf = bytearray(_wrapped([(5, None, b"a", []), (6, None, b"b", [])]))
    chunk.stamp(buf, 2, 3, 4096, number=500)
    c = chunk.Chunk(bytes(buf))
    assert c.first_number == 500 and c.header.base_offset == 4096
    assert c.values() == [b"a", b"b"]


def test_a_kafka_chunk_decodes_on_first_use():
    """A batch whose records are malformed (its CRC right): the header is read, the records
    are refused only when asked for."""
    bad = _one_record(b"\x00\x00\x00\x03\x01\x00")
    c = chunk.Chunk(chunk.seal(chunk.FLAG_KAFKA, bad, 1, 0, 2, 0, 1))
    assert len(c) == 1 and c.first_number is None and isinstance(c, chunk.Chunk)
    with pytest.raises(CorruptChunk):
        c.values()
    with pytest.raises(CorruptChunk):
        c.timestamps


def test_wrap_refuses_what_is_not_one_batch():
    with pytest.raises(CorruptChunk):
        chunk.wrap(_good() + b"\x00", 1, 0, 2, 0)


def test_check_columns_refuses_a_batch_count_unlike_the_chunks():
    buf = chunk.seal(chunk.FLAG_KAFKA, _good(), 1, 0, 2, 0, 3)   # the batch holds 2
    with pytest.raises(CorruptChunk, match="2 records"):
        chunk.check_columns(buf, chunk.verify(buf))


def test_check_columns_refuses_a_damaged_batch_under_a_good_chunk_checksum():
    bad = bytearray(_good())
    bad[-2] ^= 0x01
    buf = chunk.seal(chunk.FLAG_KAFKA, bytes(bad), 1, 0, 2, 0, 2)
    h = chunk.verify(buf)   # the chunk's own checksums are over the damaged bytes
    with pytest.raises(CorruptChunk, match="CRC"):
        chunk.check_columns(buf, h)


@pytest.mark.parametrize("extra", [chunk.FLAG_KEYS, chunk.FLAG_HEADERS, chunk.FLAG_CONDITION,
                                   1 << chunk.COMPRESSION_SHIFT])
def test_a_kafka_chunk_with_another_flag_is_refused(extra):
    buf = chunk.seal(chunk.FLAG_KAFKA | extra, _good(), 1, 0, 2, 0, 2)
    with pytest.raises(CorruptChunk, match="flag"):
        chunk.verify(buf)


def test_a_kafka_chunk_body_shorter_than_a_batch_header_is_refused():
    with pytest.raises(CorruptChunk, match="header"):
        chunk.verify(chunk.seal(chunk.FLAG_KAFKA, b"\x00" * 20, 1, 0, 2, 0, 1))


def test_kafka_timestamps_past_what_microseconds_hold_are_clamped():
    c = chunk.Chunk(_wrapped([(2**62, None, b"a", []), (-(2**62), None, b"b", [])]))
    limit = (2**63 - 1) // 1000 * 1000
    assert c.timestamps.tolist() == [limit, -limit]
    # A base timestamp at the i64 maximum and a positive delta: past what an i64 of ms holds.
    buf = bytearray(kb.build([(0, None, b"a", []), (5, None, b"b", [])]))
    struct.pack_into(">q", buf, 27, 2**63 - 1)
    batch = _reseal(buf)
    assert [r.timestamp_ms for r in kb.records(batch)] == [2**63 - 1, 2**63 + 4]
    assert chunk.Chunk(chunk.wrap(batch, 1, 0, 2, 0)).timestamps.tolist() == [limit, limit]


# --------------------------------------------------------------------------- kafka_rows

def test_kafka_rows_of_a_native_chunk_build_the_same_records():
    values = [b"a", None, b"ccc", b""]
    keys = [b"k", None, b"kk", None]
    headers = [[("x", b"1")], None, [], [("y", b""), ("z", b"2")]]
    native = chunk.Chunk(chunk.encode(1, 0, 2, 0, values, keys, timestamps=[1_500, 2_999, -1, 7_000_000],
                                      headers=headers))
    rows = chunk.kafka_rows(native)
    assert rows == [(1, b"k", b"a", [("x", b"1")]), (2, None, None, []), (-1, b"kk", b"ccc", []),
                    (7000, None, b"", [("y", b""), ("z", b"2")])]
    got = kb.records(kb.build(rows))
    assert _as_rows(got) == [(t, k, v, list(h)) for t, k, v, h in rows]


def test_kafka_rows_of_a_chunk_without_headers():
    native = chunk.Chunk(chunk.encode(1, 0, 2, 0, [b"a", b"b"], timestamps=5_000))
    assert [r[:3] for r in chunk.kafka_rows(native)] == [(5, None, b"a"), (5, None, b"b")]
    assert [list(r[3]) for r in chunk.kafka_rows(native)] == [[], []]
    assert len(kb.records(kb.build(chunk.kafka_rows(native)))) == 2
