"""The transaction index of a streamlet: per slot, the open transactions and aborted ranges;
per producer, the fence epoch its markers set. Sans-IO: chunk headers and markers in, read
bounds out (docs/TRANSACTIONS.md, "The broker's transaction index and the last stable position").

- `open`, per slot: coordinator producer id -> OpenTxn (its epoch, its number when known, where
  its first chunk lies: record number, group, offset). At most one per producer and slot.
- `aborted`, per slot: (producer id, first number, marker number) of aborted transactions,
  ascending by marker, for skipping aborted chunks and for Kafka's `aborted_transactions`.
- `fences`, per streamlet: producer id -> the highest marker epoch and the last marker written
  (its number and where it lies, so a retried marker is answered once that one is durable).
  LRU-bounded, like the producer table.

The last stable position (LSO) of a slot is the first record number of its oldest open
transaction (None: nothing open; the durable end applies). For kera's group reads it is a
per-group bound (`stable_end`): a group before the oldest open transaction's first chunk is
readable to its durable head, the group holding that chunk up to it, later groups not at all.

The index is never persisted: `observe` rebuilds it from stamped chunks in append order
(kera.broker.reload, kera.broker.rebuild); a rebuilt open transaction's number is unknown
(None) until a marker or `txn_resolve` names it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from typing import NamedTuple

from kera.codec import kafka_batch, txn
from kera.codec.chunk import FLAG_KAFKA, RESERVED_PRODUCER_IDS, ChunkHeader

# Aborted ranges kept per slot: each is ~100 bytes; a slot with more aborted transactions than
# this within its retention forgets the oldest (`aborted_forgotten` counts them: their records
# become visible to read_committed readers, so the bound is far above any sane abort rate times
# retention — 1000 aborts a day for 100 days).
ABORTED_PER_SLOT_MAX = 100_000
# Producers whose fence epoch and last marker a streamlet remembers: the producer table's order
# of magnitude (kera.config.PRODUCER_TABLE_MAX); a forgotten producer's stale epoch is then
# caught by the coordinator's txn_verify instead.
FENCES_MAX = 100_000


class OpenTxn(NamedTuple):
    epoch: int
    txn: int | None          # None: rebuilt from chunks, which do not carry it
    first_number: int
    first_group: int
    first_offset: int


class Aborted(NamedTuple):
    producer_id: int
    first: int               # record number of its first chunk
    last: int                # record number of its marker


class Fence(NamedTuple):
    epoch: int               # the highest marker epoch: chunks of lower epochs are fenced
    txn: int                 # the number of the last marker written
    group: int               # where that marker lies: durable once group's durable passes end
    end: int


class SlotTxns:
    """One slot's open transactions and aborted ranges."""
    __slots__ = ("open", "aborted", "_by_producer")

    def __init__(self):
        self.open: dict[int, OpenTxn] = {}
        self.aborted: list[Aborted] = []                 # ascending by marker number
        self._by_producer: dict[int, list[Aborted]] = {}  # ascending by first number

    def oldest(self) -> OpenTxn | None:
        if not self.open:
            return None
        return min(self.open.values(), key=lambda o: o.first_number)

    def add_aborted(self, a: Aborted) -> None:
        self.aborted.append(a)
        self._by_producer.setdefault(a.producer_id, []).append(a)

    def drop_oldest_aborted(self) -> None:
        a = self.aborted.pop(0)
        ranges = self._by_producer[a.producer_id]
        ranges.remove(a)
        if not ranges:
            del self._by_producer[a.producer_id]

    def aborted_at(self, producer_id: int, number: int) -> bool:
        """Whether `producer_id`'s chunk at record `number` belongs to an aborted transaction."""
        ranges = self._by_producer.get(producer_id)
        if not ranges:
            return False
        i = bisect_right(ranges, number, key=lambda a: a.first) - 1
        return i >= 0 and ranges[i].first <= number < ranges[i].last


class StreamletTxns:
    """The transaction index of one streamlet of `slots` slots."""
    __slots__ = ("slots", "fences", "fences_max", "aborted_max", "aborted_forgotten")

    def __init__(self, slots: int, fences_max: int = FENCES_MAX,
                 aborted_max: int = ABORTED_PER_SLOT_MAX):
        self.slots = [SlotTxns() for _ in range(slots)]
        self.fences: OrderedDict[int, Fence] = OrderedDict()
        self.fences_max = fences_max
        self.aborted_max = aborted_max
        self.aborted_forgotten = 0

    # ------------------------------------------------------------------ fencing
    def fence(self, producer_id: int) -> Fence | None:
        f = self.fences.get(producer_id)
        if f is not None:
            self.fences.move_to_end(producer_id)
        return f

    def fenced(self, producer_id: int, epoch: int) -> bool:
        """A chunk of `epoch` comes from a zombie: a marker of a later epoch was written."""
        f = self.fence(producer_id)
        return f is not None and epoch < f.epoch

    def _set_fence(self, producer_id: int, fence: Fence) -> None:
        old = self.fences.get(producer_id)
        if old is not None and old.epoch > fence.epoch:
            fence = fence._replace(epoch=old.epoch)
        self.fences[producer_id] = fence
        self.fences.move_to_end(producer_id)
        if len(self.fences) > self.fences_max:
            self.fences.popitem(last=False)

    # ------------------------------------------------------------------ open and close
    def open_slot(self, producer_id: int) -> int | None:
        """The slot holding `producer_id`'s open transaction, if any (a fence's bumped epoch
        hashes to another slot than its data: markers go where the data is)."""
        for i, s in enumerate(self.slots):
            if producer_id in s.open:
                return i
        return None

    def on_data(self, slot: int, kera_producer_id: int, number: int, group: int, offset: int,
                txn_number: int | None = None) -> None:
        """A transactional chunk of `kera_producer_id` (kera.codec.txn.kera_producer_id) was
        appended at record `number` (group, offset): it opens its producer's transaction in the
        slot, or extends the open one."""
        pid, epoch = txn.split_producer_id(kera_producer_id)
        s = self.slots[slot]
        o = s.open.get(pid)
        if o is None:
            s.open[pid] = OpenTxn(epoch, txn_number, number, group, offset)
        elif o.txn is None and txn_number is not None:
            s.open[pid] = o._replace(txn=txn_number)

    def set_number(self, slot: int, producer_id: int, txn_number: int) -> None:
        """The number of a rebuilt open transaction, from the coordinator (txn_resolve)."""
        o = self.slots[slot].open.get(producer_id)
        if o is not None:
            self.slots[slot].open[producer_id] = o._replace(txn=txn_number)

    def on_marker(self, slot: int, marker: txn.Marker, number: int, group: int,
                  end: int) -> bool:
        """The control chunk of `marker` was appended at record `number` of `slot` (group
        `group`, ending at offset `end`): close its producer's transaction there. Returns
        whether the slot's LSO moved."""
        s = self.slots[slot]
        before = s.oldest()
        o = s.open.pop(marker.producer_id, None)
        if o is not None and not marker.commit:
            s.add_aborted(Aborted(marker.producer_id, o.first_number, number))
            if len(s.aborted) > self.aborted_max:
                s.drop_oldest_aborted()
                self.aborted_forgotten += 1
        self._set_fence(marker.producer_id, Fence(marker.epoch, marker.txn, group, end))
        return s.oldest() != before

    # ------------------------------------------------------------------ reads
    def lso(self, slot: int) -> int | None:
        """The first record number of the slot's oldest open transaction; None: none open."""
        o = self.slots[slot].oldest()
        return None if o is None else o.first_number

    def stable_end(self, slot: int, group: int, durable: int) -> int:
        """The offset of group `group` (of `slot`, durable up to `durable`) below which a
        read_committed reader may read."""
        o = self.slots[slot].oldest()
        if o is None or group < o.first_group:
            return durable
        if group == o.first_group:
            return min(durable, o.first_offset)
        return 0

    def skipped(self, slot: int, h: ChunkHeader, buf=None) -> bool:
        """Whether a read_committed reader skips the stamped chunk `h`: a control chunk, or a
        transactional chunk of an aborted transaction."""
        if h.producer_id == txn.MARKER_PRODUCER_ID:
            return True
        if not _transactional(h, buf):
            return False
        pid, _ = txn.split_producer_id(h.producer_id)
        return self.slots[slot].aborted_at(pid, h.number)

    def aborted_between(self, slot: int, lo: int, hi: int) -> list[Aborted]:
        """Aborted transactions of `slot` with records in numbers [lo, hi) (Kafka's Fetch
        `aborted_transactions`). The list is ascending by marker: those ending before `lo`
        are skipped by bisection (a reader near the head scans only the recent ones)."""
        aborted = self.slots[slot].aborted
        start = bisect_left(aborted, lo, key=lambda a: a.last)
        return [a for a in aborted[start:] if a.first < hi]

    # ------------------------------------------------------------------ rebuild, retention
    def observe(self, slot: int, h: ChunkHeader, buf) -> None:
        """Rebuild: a stamped chunk (header `h`, bytes `buf`) of `slot`, in append order."""
        if h.number is None:
            return
        if h.producer_id == txn.MARKER_PRODUCER_ID:
            end = h.base_offset + h.record_count
            self.on_marker(slot, txn.read_marker(buf, h), h.number, h.group, end)
        elif _transactional(h, buf):
            pid, epoch = txn.split_producer_id(h.producer_id)
            if not self.fenced(pid, epoch):
                self.on_data(slot, h.producer_id, h.number, h.group, h.base_offset)

    def trim(self, slot: int, first_number: int) -> None:
        """Retention deleted the slot's records below `first_number`: forget aborted ranges
        whose marker went with them."""
        s = self.slots[slot]
        while s.aborted and s.aborted[0].last < first_number:
            s.drop_oldest_aborted()

    def snapshot(self) -> tuple:
        """What the index holds, the open transactions' numbers aside (a rebuilt index does not
        know them): for tests that a rebuild equals the live index."""
        slots = tuple((tuple(sorted((p, o._replace(txn=None)) for p, o in s.open.items())),
                       tuple(s.aborted)) for s in self.slots)
        return slots, tuple(sorted((p, f.epoch) for p, f in self.fences.items()))


def _transactional(h: ChunkHeader, buf) -> bool:
    """A data chunk of an open transaction: a kera chunk with TXN_SEQUENCE_BIT, or a Kafka
    client's transactional batch (attribute bit 4 of its batch header)."""
    if h.producer_id in RESERVED_PRODUCER_IDS:   # markers; compacted chunks pack their sequence
        return False
    if h.flags & FLAG_KAFKA:
        if buf is None:
            return False
        return kafka_batch.read_header(buf, h.header_size).transactional
    return txn.is_transactional(h.sequence)
