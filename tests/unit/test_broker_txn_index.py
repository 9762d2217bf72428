"""kera.broker.transactions: the per-slot transaction index, the LSO and its rebuild."""

from __future__ import annotations

import random

from kera.broker.transactions import Aborted, StreamletTxns
from kera.codec import kafka_batch, txn
from kera.codec.chunk import encode, read_header, stamp, wrap

SID, SL = 9, 0
NOW_MS = 1_764_000_000_000


class SlotLog:
    """Chunks appended to one slot (one group per `group_records` records), the live index fed
    as the broker feeds it, and every stamped chunk kept for a rebuild."""

    def __init__(self, group_records: int = 1000):
        self.live = StreamletTxns(1)
        self.chunks: list[bytes] = []
        self.number = 0
        self.group_records = group_records

    def _place(self, buf: bytes, count: int):
        group, offset = divmod(self.number, self.group_records)
        b = bytearray(buf)
        stamp(b, group, 0, offset, self.number)
        self.chunks.append(bytes(b))
        at = self.number
        self.number += count
        return at, group, offset

    def data(self, pid: int, epoch: int, seq: int, count: int = 3, txn_number: int | None = 1,
             transactional: bool = True):
        kpid = txn.kera_producer_id(pid, epoch)
        s = txn.txn_sequence(seq) if transactional else seq
        at, group, offset = self._place(encode(kpid, s, SID, SL, [b"v"] * count), count)
        if transactional:
            self.live.on_data(0, kpid, at, group, offset, txn_number)
        return at

    def marker(self, pid: int, epoch: int, number: int, commit: bool) -> bool:
        m = txn.Marker(pid, epoch, number, commit)
        at, group, offset = self._place(txn.build_marker(m, SID, SL, NOW_MS), 1)
        return self.live.on_marker(0, m, at, group, offset + 1)

    def rebuilt(self) -> StreamletTxns:
        index = StreamletTxns(1)
        for buf in self.chunks:
            index.observe(0, read_header(buf), buf)
        return index


def test_lso_is_the_first_number_of_the_oldest_open_transaction():
    log = SlotLog()
    log.data(1, 0, 0, txn_number=None, transactional=False)   # plain data: not a transaction
    assert log.live.lso(0) is None
    first = log.data(7, 0, 0)
    log.data(8, 0, 0)
    log.data(7, 0, 1)
    assert log.live.lso(0) == first
    assert log.marker(8, 0, 1, True) is False        # not the oldest: the LSO stays
    assert log.live.lso(0) == first
    assert log.marker(7, 0, 1, True) is True
    assert log.live.lso(0) is None


def test_abort_records_a_range_and_skips_its_chunks_only():
    log = SlotLog()
    a = log.data(7, 0, 0)
    b = log.data(7, 0, 1)
    other = log.data(8, 0, 0)
    log.marker(7, 0, 1, False)
    log.marker(8, 0, 1, True)
    s = log.live.slots[0]
    assert s.aborted == [Aborted(7, a, other + 3)]
    headers = [read_header(c) for c in log.chunks]
    skipped = [log.live.skipped(0, h, c) for h, c in zip(headers, log.chunks)]
    # data 7, data 7, data 8, marker, marker: 7's chunks aborted, 8's committed, markers skipped
    assert skipped == [True, True, False, True, True]
    assert a < b and log.live.aborted_between(0, 0, a + 1) == [Aborted(7, a, other + 3)]
    assert log.live.aborted_between(0, other + 4, 10**6) == []


def test_stable_end_per_group():
    log = SlotLog(group_records=10)
    for seq in range(4):                                 # numbers 0..11: groups 0 and 1
        log.data(1, 0, seq, transactional=False)
    first = log.data(7, 0, 0)                            # number 12: group 1, offset 2
    log.data(1, 0, 4, transactional=False)
    idx = log.live
    assert first == 12
    assert idx.stable_end(0, 0, durable=10) == 10        # wholly below the open transaction
    assert idx.stable_end(0, 1, durable=8) == 2          # up to its first chunk
    assert idx.stable_end(0, 1, durable=1) == 1          # never past the durable head
    assert idx.stable_end(0, 2, durable=5) == 0          # later groups: nothing
    log.marker(7, 0, 1, True)
    assert idx.stable_end(0, 2, durable=5) == 5


def test_markers_fence_older_epochs():
    idx = StreamletTxns(2)
    assert not idx.fenced(7, 0)
    idx.on_marker(1, txn.Marker(7, 3, 5, False), 10, 0, 11)
    assert idx.fenced(7, 2) and not idx.fenced(7, 3) and not idx.fenced(7, 4)
    idx.on_marker(1, txn.Marker(7, 1, 4, False), 12, 0, 13)   # a late, lower epoch: kept at 3
    assert idx.fence(7).epoch == 3 and idx.fence(7).txn == 4


def test_fences_are_lru_bounded():
    idx = StreamletTxns(1, fences_max=2)
    for pid in (1, 2, 3):
        idx.on_marker(0, txn.Marker(pid, 1, 1, True), pid, 0, pid + 1)
    assert idx.fence(1) is None and idx.fence(3) is not None


def test_open_slot_finds_the_data_slot():
    idx = StreamletTxns(4)
    idx.on_data(2, txn.kera_producer_id(7, 0), 0, 0, 0, 1)
    assert idx.open_slot(7) == 2 and idx.open_slot(8) is None


def test_aborted_ranges_are_bounded_and_trimmed_by_retention():
    idx = StreamletTxns(1, aborted_max=2)
    for n in range(3):
        idx.on_data(0, txn.kera_producer_id(7, 0), 10 * n, 0, 10 * n, n)
        idx.on_marker(0, txn.Marker(7, 0, n, False), 10 * n + 5, 0, 10 * n + 6)
    assert [a.first for a in idx.slots[0].aborted] == [10, 20] and idx.aborted_forgotten == 1
    idx.trim(0, 16)
    assert [a.first for a in idx.slots[0].aborted] == [20]
    assert not idx.slots[0].aborted_at(7, 12) and idx.slots[0].aborted_at(7, 22)


def test_kafka_transactional_batches_count_as_transactional():
    log = SlotLog()
    batch = kafka_batch.build([(NOW_MS, None, b"v", ())], producer_id=7, producer_epoch=0,
                              base_sequence=0, attributes=kafka_batch.TRANSACTIONAL)
    at, group, offset = log._place(wrap(batch, txn.kera_producer_id(7, 0), 0, SID, SL), 1)
    log.live.on_data(0, txn.kera_producer_id(7, 0), at, group, offset, 1)
    assert log.rebuilt().snapshot() == log.live.snapshot()
    assert log.rebuilt().lso(0) == at


def test_rebuild_from_chunks_equals_the_live_index():
    rng = random.Random(39)
    log = SlotLog(group_records=17)
    seqs: dict = {}
    numbers: dict = {}
    open_: set = set()
    for _ in range(400):
        pid = rng.randrange(1, 6)
        epoch = numbers.get(pid, (0, 0))[0]
        if pid in open_ and rng.random() < 0.3:
            _, n = numbers[pid]
            commit = rng.random() < 0.5
            log.marker(pid, epoch if commit else epoch + rng.randrange(2), n, commit)
            open_.discard(pid)
            if not commit:
                numbers[pid] = (epoch + 1, n + 1)
                seqs.pop(pid, None)
            else:
                numbers[pid] = (epoch, n + 1)
        else:
            numbers.setdefault(pid, (0, 1))
            seq = seqs.get(pid, 0)
            seqs[pid] = seq + 1
            log.data(pid, numbers[pid][0], seq, rng.randrange(1, 5), numbers[pid][1],
                     transactional=rng.random() < 0.8)
            open_.add(pid) if log.live.open_slot(pid) is not None else None
    rebuilt = log.rebuilt()
    assert rebuilt.snapshot() == log.live.snapshot()
    assert rebuilt.lso(0) == log.live.lso(0)
    assert all(o.txn is None for o in rebuilt.slots[0].open.values())
    assert log.live.slots[0].aborted, "the walk aborted something"
