"""The seeded broker simulation (tests/unit/test_broker_simulation.py) with a transactional
producer beside the plain ones: its first chunk of each transaction waits for a verification
the simulated coordinator answers late, its decision is written by markers that are delayed and
sent twice. Checked throughout: a read_committed reader never sees a record of an aborted or
undecided transaction, and the slot's last stable position never moves back; once healed, it
reads exactly the committed transactions' records, in order."""

from __future__ import annotations

import pytest

from kera.codec import chunk, txn
from kera.codec.chunk import offsets_covered

from tests.unit.test_broker_simulation import STREAMS, Sim

TPID = 77            # the coordinator's producer id of the transactional producer
SID, SL = 11, 0      # its stream (R=2) and streamlet
CHUNKS_MAX = 4       # chunks per transaction


class TxnSim(Sim):
    def __init__(self, seed: int):
        super().__init__(seed)
        self.number = 1          # the open transaction's number
        self.epoch = 0
        self.seq = 0             # next sequence of the current (producer id, epoch)
        self.sent = 0            # chunks of this transaction acknowledged
        self.want = self.rng.randint(1, CHUNKS_MAX)
        self.busy = False
        self.marker_due: list = []       # markers the coordinator has yet to send
        self.deciding = None             # the decision being marked: (number, commit)
        self.verifies: list = []         # txn_verify asked, not answered
        self.committed: set = set()
        self.aborted: set = set()
        self.lso_seen: dict = {}   # slot -> its last stable position at the last check

    @property
    def kpid(self) -> int:
        return txn.kera_producer_id(TPID, self.epoch)

    # ------------------------------------------------------------------ the producer
    def txn_produce(self):
        if self.busy or self.deciding is not None:
            return
        if self.sent == self.want:    # every chunk acknowledged: decide
            commit = self.rng.random() < 0.6
            self.deciding = (self.number, commit)
            self.marker_due = [["t", TPID, self.epoch, self.number, commit, f"s{SID}", SL]] * 2
            return
        value = b"T%d:%d" % (self.number, self.seq)
        frame = chunk.encode(self.kpid, txn.txn_sequence(self.seq), SID, SL, [value] * 3)
        self.busy = True
        result = self.b.produce(("txn", self.seq), [frame], self.now)
        if result is not None:
            self.txn_answer(result)

    def txn_answer(self, result):
        self.busy = False
        if isinstance(result, Exception):
            assert result.retriable, result
            return
        [res] = result
        if isinstance(res[0], str):
            assert res[2], res      # retriable: sent again
            return
        self.seq += 1
        self.sent += 1

    def send_marker(self):
        m = self.marker_due.pop(0)
        reply = self.b.txn_markers(("marker", len(self.marker_due)), [m], self.now)
        if reply is not None:
            self.marker_answer(reply)

    def marker_answer(self, reply):
        if isinstance(reply, Exception) or not reply["written"] or self.deciding is None:
            if isinstance(reply, Exception) and self.deciding is not None:
                number, commit = self.deciding
                self.marker_due.append(["t", TPID, self.epoch, number, commit, f"s{SID}", SL])
            return
        number, commit = self.deciding
        (self.committed if commit else self.aborted).add(number)
        self.deciding = None
        self.number += 1
        self.sent, self.want = 0, self.rng.randint(1, CHUNKS_MAX)
        if not commit and self.rng.random() < 0.5:   # a new instance: a new epoch
            self.epoch += 1
            self.seq = 0

    # ------------------------------------------------------------------ the loop
    def step(self):
        r = self.rng.random()
        if r < 0.15:
            self.txn_produce()
        elif r < 0.2 and self.marker_due:
            self.send_marker()
        elif r < 0.25 and self.verifies:
            key = self.verifies.pop(0)
            self.b.txn_verified(key, {"txn": self.number}, None)
        else:
            super().step()
        self.verifies += [key for key, _ in self.b.take_txn_verifies()]
        self.route(self.b.take_replies())

    def answer(self, token, result):
        """Every deferred reply (the base loop takes them): the plain producers' to Sim."""
        if isinstance(token, tuple) and token[0] == "txn":
            self.txn_answer(result)
        elif isinstance(token, tuple) and token[0] == "marker":
            self.marker_answer(result)
        else:
            super().answer(token, result)

    def route(self, replies):
        for token, result in replies:
            self.answer(token, result)

    def check(self):
        super().check()
        values = read_committed(self.b)
        for v in values:
            number = int(v[1:].split(b":")[0])
            assert number in self.committed or self.deciding == (number, True), \
                f"transaction {number} read before its commit"
        idx = self.b.txn.indexes.get((SID, SL))
        streamlet = self.b.streams[SID].streamlets.get(SL)
        if idx is None or streamlet is None:
            return
        for slot in range(2):
            lso = idx.lso(slot)
            stable = streamlet.next_number(slot) if lso is None else lso
            assert stable >= self.lso_seen.get(slot, 0), "the last stable position moved back"
            self.lso_seen[slot] = stable

    def heal(self):
        for _ in range(4000):
            if self.deciding is None and self.sent == 0 and not self.busy and self.number > 3:
                break
            if self.verifies:
                self.b.txn_verified(self.verifies.pop(0), {"txn": self.number}, None)
            if self.marker_due:
                self.send_marker()
            self.txn_produce()
            self.network.extend(self.b.sync(self.now))
            while self.network:
                self.deliver(self.network.pop(0))
            self.now += 0.1
            self.b.tick(self.now)
            self.verifies += [key for key, _ in self.b.take_txn_verifies()]
            self.route(self.b.take_replies())
        super().heal()


def read_committed(b) -> list:
    """Every transactional value a read_committed reader of (SID, SL) gets, as a consumer reads:
    cursor per group, stepping over gap chunks by their span."""
    low, offsets, out = 0, {}, []
    for _ in range(10_000):
        results, frames = b.reads.fetch([[SID, SL, {"low": low, "offsets": dict(offsets)}, 4096]],
                                  isolation="read_committed")
        err, n, groups = results[0]
        assert err is None, err
        for f in (c for fr in frames for c in chunk.frame_chunks(fr)):
            h = chunk.read_header(f)
            assert h.base_offset == offsets.get(h.group, 0), "a gap or a duplicate in a group"
            offsets[h.group] = h.base_offset + offsets_covered(h)
            out += [v for v in chunk.Chunk(f).values() if v.startswith(b"T")]
        described = {g[0]: g for g in groups}
        while low in described and described[low][4] and offsets.get(low, 0) == described[low][3]:
            offsets.pop(low, None)
            low += 1
        if not frames:
            return out
    raise AssertionError("reading never ended")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_transactional_simulation(seed):
    sim = TxnSim(seed)
    try:
        for i in range(1500):
            sim.step()
            if i % 25 == 0:
                sim.check()
        sim.heal()
        sim.check()
    except AssertionError:
        print(f"transactional simulation seed {seed} failed at t={sim.now:.2f}")
        raise
    assert sim.committed and sim.aborted, (sim.committed, sim.aborted)
    values = read_committed(sim.b)
    numbers = [int(v[1:].split(b":")[0]) for v in values]
    assert set(numbers) == sim.committed
    assert numbers == sorted(numbers), "transactions read out of order"
    assert STREAMS[SID] == 2
