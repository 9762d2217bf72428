"""Transactions in chunk headers: the transactional sequence bit, the producer id of a
transactional producer, and the control chunk (marker) that ends a transaction in a slot.

Brokers read only chunk headers (docs/TRANSACTIONS.md, "Marking records in streamlets"):

- a transactional kera chunk sets TXN_SEQUENCE_BIT in its `sequence` (sequences are dense from 0
  per producer and streamlet and never reach 2**63); its producer id is
  `kera_producer_id(pid, epoch)`, the coordinator's producer id and epoch, as the Kafka listener
  makes a Kafka idempotent producer's;
- a control chunk is a FLAG_KAFKA chunk whose body is a Kafka control batch (attributes
  TRANSACTIONAL | CONTROL, the transaction's producer id and the marker's epoch, base sequence
  -1, one record: key (version 0, type 0 abort / 1 commit), value EndTxnMarker v0 (version 0,
  coordinator_epoch = the transaction's number)). Its chunk header carries MARKER_PRODUCER_ID
  and, as sequence, the transaction's number: a broker rebuilding its index reads the header,
  and the batch header for the producer and epoch, never the records.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kera.codec import kafka_batch
from kera.codec.chunk import FLAG_KAFKA, MARKER_PRODUCER_ID, ChunkHeader, seal
from kera.errors import CorruptChunk

# Bit 63 of a kera chunk's sequence: the chunk belongs to its producer's open transaction.
TXN_SEQUENCE_BIT = 1 << 63
# Bits of a kera producer id below the coordinator's (or a Kafka client's) producer id: its
# epoch, modulo 256. The coordinator issues epochs below 256 (kera.coordinator.transactions
# EPOCH_MAX); a Kafka idempotent producer bumped 256 times would meet its first epoch's entry.
EPOCH_BITS = 8
EPOCH_MASK = (1 << EPOCH_BITS) - 1
# The producer id of a Kafka batch from a producer without idempotence (its producer id -1):
# no duplicate detection, as a Kafka broker has none for it (kera.broker.producers has the same).
ANONYMOUS_PRODUCER_ID = 0
# Kafka batches stored under a kera producer id below this are anonymous too: on a stream with
# several active groups an anonymous batch for slot s is stored under id s, since the core
# appends a chunk to slot `id % Q` (kera.broker.kafka.slots; at most 256 active groups).
ANONYMOUS_PRODUCER_IDS = 256


def is_anonymous_kafka(producer_id: int) -> bool:
    """Whether a Kafka batch stored under `producer_id` has no sequence rule."""
    return producer_id < ANONYMOUS_PRODUCER_IDS
# The control record's key and value (Kafka's ControlRecordType and EndTxnMarker, version 0).
CONTROL_KEY = struct.Struct(">hh")        # version, type
CONTROL_VALUE = struct.Struct(">hi")      # version, coordinator_epoch
CONTROL_VERSION = 0
ABORT, COMMIT = 0, 1
# The transaction's number rides in the i32 coordinator_epoch field.
TXN_NUMBER_MAX = 2**31 - 1


class Marker(NamedTuple):
    """What a control chunk says: `producer_id`'s (the coordinator's, not shifted) transaction
    number `txn` ended, committed or not, written at `epoch`."""
    producer_id: int
    epoch: int
    txn: int
    commit: bool


def kera_producer_id(producer_id: int, epoch: int) -> int:
    """The kera producer id of a (producer id, epoch): a new epoch is a new kera producer,
    whose sequences start afresh as Kafka's do."""
    if producer_id < 0:
        return ANONYMOUS_PRODUCER_ID
    return (producer_id << EPOCH_BITS) | (epoch & EPOCH_MASK)


def split_producer_id(kera_id: int) -> tuple[int, int]:
    """(producer id, epoch) of a kera producer id made by kera_producer_id."""
    return kera_id >> EPOCH_BITS, kera_id & EPOCH_MASK


def is_transactional(sequence: int) -> bool:
    return bool(sequence & TXN_SEQUENCE_BIT)


def plain_sequence(sequence: int) -> int:
    """The sequence without TXN_SEQUENCE_BIT: what duplicate detection compares."""
    return sequence & ~TXN_SEQUENCE_BIT


def txn_sequence(sequence: int) -> int:
    """`sequence` marked transactional."""
    if not 0 <= sequence < TXN_SEQUENCE_BIT:
        raise ValueError(f"sequence {sequence} does not fit below TXN_SEQUENCE_BIT")
    return sequence | TXN_SEQUENCE_BIT


def is_marker(h: ChunkHeader) -> bool:
    return h.producer_id == MARKER_PRODUCER_ID


def build_marker(marker: Marker, stream_id: int, streamlet: int, timestamp_ms: int,
                 slot: int = 0) -> bytes:
    """The control chunk of `marker`, not yet appended (stamped by the broker as any chunk).
    `slot`, the streamlet slot it goes to, rides in the batch's partition leader epoch, a
    field outside the batch CRC that the Kafka listener rewrites when it serves the batch
    (kafka_batch.with_offset): a rebuild places a group by its first chunk's slot, and a
    marker's producer id says none (`marker_slot`)."""
    if not 0 <= marker.txn <= TXN_NUMBER_MAX:
        raise ValueError(f"transaction number {marker.txn} is outside 0..{TXN_NUMBER_MAX}")
    key = CONTROL_KEY.pack(CONTROL_VERSION, COMMIT if marker.commit else ABORT)
    value = CONTROL_VALUE.pack(CONTROL_VERSION, marker.txn)
    batch = kafka_batch.build([(timestamp_ms, key, value, ())], producer_id=marker.producer_id,
                              producer_epoch=marker.epoch, base_sequence=-1, leader_epoch=slot,
                              attributes=kafka_batch.TRANSACTIONAL | kafka_batch.CONTROL)
    return seal(FLAG_KAFKA, batch, MARKER_PRODUCER_ID, marker.txn, stream_id, streamlet, 1)


def marker_slot(buf, h: ChunkHeader) -> int:
    """The slot a control chunk was appended to (build_marker)."""
    return kafka_batch.read_header(buf, h.header_size).leader_epoch


def read_marker(buf, h: ChunkHeader) -> Marker:
    """The marker a control chunk `buf` (header `h`) holds; CorruptChunk if it is not one."""
    if not is_marker(h) or not h.flags & FLAG_KAFKA or h.record_count != 1:
        raise CorruptChunk(f"chunk of producer {h.producer_id} is not a transaction marker")
    batch = memoryview(buf)[h.header_size:h.size]
    bh = kafka_batch.check(batch, control=True)
    if not (bh.control and bh.transactional):
        raise CorruptChunk("marker chunk's Kafka batch is not a transactional control batch")
    (record,) = kafka_batch.records(batch, control=True)
    if record.key is None or len(record.key) != CONTROL_KEY.size or record.value is None \
            or len(record.value) < CONTROL_VALUE.size:
        raise CorruptChunk("marker chunk's control record has a malformed key or value")
    _, kind = CONTROL_KEY.unpack(record.key)
    _, txn = CONTROL_VALUE.unpack_from(record.value)
    if kind not in (ABORT, COMMIT) or txn != h.sequence:
        raise CorruptChunk(f"marker chunk's control record (type {kind}, number {txn}) does "
                           f"not match its header (number {h.sequence})")
    return Marker(bh.producer_id, bh.producer_epoch, txn, kind == COMMIT)
