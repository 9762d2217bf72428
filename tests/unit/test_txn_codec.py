"""kera.codec.txn: the transactional sequence bit, kera producer ids and control chunks."""

from __future__ import annotations

import pytest
from kio.records.readers import read_batch

from kera.codec import kafka_batch, txn
from kera.codec.chunk import (COMPACTED_PRODUCER_ID, FLAG_KAFKA, MARKER_PRODUCER_ID, Chunk, reseal,
                              verify, wrap)
from kera.errors import CorruptChunk

NOW_MS = 1_764_000_000_000


def test_sequence_bit_round_trips_and_is_stripped():
    s = txn.txn_sequence(41)
    assert s >= 2**63 and txn.is_transactional(s)
    assert txn.plain_sequence(s) == 41
    assert not txn.is_transactional(41) and txn.plain_sequence(41) == 41
    with pytest.raises(ValueError):
        txn.txn_sequence(2**63)


def test_kera_producer_id_packs_epoch_below_the_id():
    k = txn.kera_producer_id(12345, 7)
    assert k == 12345 << 8 | 7
    assert txn.split_producer_id(k) == (12345, 7)
    assert txn.kera_producer_id(5, 0) != txn.kera_producer_id(5, 1)
    assert txn.kera_producer_id(-1, -1) == txn.ANONYMOUS_PRODUCER_ID


def test_the_marker_producer_id_is_reserved_beside_compaction():
    assert MARKER_PRODUCER_ID == 2**64 - 3 != COMPACTED_PRODUCER_ID


@pytest.mark.parametrize("commit", [True, False])
def test_control_chunk_round_trips(commit):
    marker = txn.Marker(producer_id=99, epoch=3, txn=17, commit=commit)
    buf = txn.build_marker(marker, stream_id=5, streamlet=2, timestamp_ms=NOW_MS)
    h = verify(buf)
    assert h.flags == FLAG_KAFKA and h.producer_id == MARKER_PRODUCER_ID
    assert h.sequence == 17 and h.record_count == 1 and (h.stream_id, h.streamlet) == (5, 2)
    assert txn.is_marker(h)
    assert txn.read_marker(buf, h) == marker


def test_kafka_parser_kio_reads_the_control_batch():
    buf = txn.build_marker(txn.Marker(99, 3, 17, True), 5, 2, NOW_MS)
    h = verify(buf)
    batch, size = read_batch(bytes(buf[h.header_size:h.size]), 0)
    assert size == h.size - h.header_size
    assert batch.attributes == kafka_batch.TRANSACTIONAL | kafka_batch.CONTROL
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (99, 3, -1)
    (record,) = batch.records
    assert record.key == b"\x00\x00\x00\x01"            # version 0, type 1 (commit)
    assert record.value == b"\x00\x00\x00\x00\x00\x11"  # version 0, coordinator_epoch 17


def test_kafka_batch_check_still_refuses_a_produced_control_batch():
    buf = txn.build_marker(txn.Marker(99, 3, 17, False), 5, 2, NOW_MS)
    batch = bytes(buf[verify(buf).header_size:])
    with pytest.raises(CorruptChunk, match="control"):
        kafka_batch.check(batch)
    assert kafka_batch.check(batch, control=True).control


def test_build_refuses_codec_bits_in_attributes():
    with pytest.raises(ValueError):
        kafka_batch.build([(NOW_MS, None, b"v", ())], attributes=1)


def test_read_marker_refuses_a_data_chunk():
    data = kafka_batch.build([(NOW_MS, None, b"v", ())], producer_id=1, producer_epoch=0,
                             base_sequence=0)
    buf = wrap(data, 7, 0, 5, 2)
    with pytest.raises(CorruptChunk):
        txn.read_marker(buf, verify(buf))


def test_read_marker_refuses_a_number_that_disagrees_with_the_header():
    buf = txn.build_marker(txn.Marker(99, 3, 17, True), 5, 2, NOW_MS)
    forged = reseal(buf, MARKER_PRODUCER_ID, 18)
    with pytest.raises(CorruptChunk, match="does not match"):
        txn.read_marker(forged, verify(forged))


def test_a_control_chunk_is_a_chunk_whose_header_readers_can_skip():
    buf = txn.build_marker(txn.Marker(99, 3, 17, True), 5, 2, NOW_MS)
    assert len(Chunk(buf)) == 1
