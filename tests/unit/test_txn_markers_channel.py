"""The marker channel's core (kera.coordinator.markers) on a fake clock, against scripted
brokers: requests batched per owner and bounded, drops and timeouts resent after
MARKER_RETRY_S, not_owner resent to the part's new owner, late and duplicated replies changing
nothing, and a seeded walk where every decided transaction completes only once each of its
markers is durable at a broker."""

import random

import pytest

from kera.coordinator import transactions as tx
from kera.coordinator.markers import MARKERS_PER_REQUEST_MAX, MarkerChannel
from kera.coordinator.transactions import MARKER_RETRY_S, Marker, Transactions


class Brokers:
    """Brokers as the design's marker table has them: one writes a marker of a part it owns
    durably once (a repeat is answered written, nothing appended) and answers not_owner for
    the others. `durable[(part, producer_id, txn)]` is the kind written."""

    def __init__(self, owners: dict):
        self.owners = owners                       # part -> address
        self.durable: dict[tuple, bool] = {}
        self.appends = 0

    def answer(self, address: str, request: dict) -> dict:
        written, not_owner = [], []
        for tid, pid, epoch, txn, commit, stream, sl in request["markers"]:
            if self.owners.get((stream, sl)) != address:
                not_owner.append([stream, sl])
                continue
            key = ((stream, sl), pid, txn)
            if key not in self.durable:
                self.durable[key] = commit
                self.appends += 1
            written.append([stream, sl, pid, txn])
        return {"written": written, "not_owner": not_owner}


def setup(parts, owners=None):
    ids = iter(range(1, 10_000))
    txns = Transactions(id_source=lambda: next(ids))
    owners = owners if owners is not None else {p: f"b{p[1] % 2}" for p in parts}
    channel = MarkerChannel(txns, owners.get)
    return txns, channel, Brokers(owners)


def decide(txns: Transactions, parts, commit=True, tid="job", now=0.0) -> tx.Txn:
    t = txns.txns.get(tid)
    if t is None or t.state not in tx.IDLE:
        pid, epoch = txns.init(tid, 60_000, now)
    else:
        pid, epoch = t.producer_id, t.epoch
    txns.add_partitions(tid, pid, epoch, parts, now)
    txns.end(tid, pid, epoch, commit, now)
    return txns.txns[tid]


def test_requests_are_batched_per_owner_and_bounded():
    parts = [("s", i) for i in range(MARKERS_PER_REQUEST_MAX + 10)]
    txns, channel, brokers = setup(parts)
    decide(txns, parts)
    sent = channel.due(0.0)
    assert [(a, len(b)) for a, b in sent] == [("b0", MARKERS_PER_REQUEST_MAX // 2 + 5),
                                              ("b1", MARKERS_PER_REQUEST_MAX // 2 + 5)]
    parts = [("s", 2 * i) for i in range(MARKERS_PER_REQUEST_MAX + 10)]
    txns, channel, brokers = setup(parts)
    decide(txns, parts)
    assert [(a, len(b)) for a, b in channel.due(0.0)] == [("b0", MARKERS_PER_REQUEST_MAX),
                                                          ("b0", 10)]
    wire = MarkerChannel.request(channel.due(10.0)[1][1])["markers"]
    assert wire[0] == ["job", txns.txns["job"].producer_id, 0, 1, True, "s",
                       2 * MARKERS_PER_REQUEST_MAX]


def test_replies_complete_the_transaction_only_once_every_marker_is_durable():
    parts = [("s", 0), ("s", 1)]
    txns, channel, brokers = setup(parts)
    t = decide(txns, parts)
    (a0, batch0), (a1, batch1) = channel.due(0.0)
    assert channel.replied(batch0, brokers.answer(a0, MarkerChannel.request(batch0)), 0.1) == 0
    assert t.state == tx.PREPARE_COMMIT and channel.due(0.2) == []   # nothing due yet
    assert channel.replied(batch1, brokers.answer(a1, MarkerChannel.request(batch1)), 0.3) == 1
    assert t.state == tx.COMPLETE_COMMIT and brokers.appends == 2


def test_a_dropped_request_is_resent_after_the_retry_time():
    txns, channel, brokers = setup([("s", 0)])
    t = decide(txns, [("s", 0)])
    assert len(channel.due(0.0)) == 1                 # dropped: no reply ever comes
    assert channel.due(MARKER_RETRY_S / 2) == []
    channel.failed(None)                              # the shell's timeout
    [(address, batch)] = channel.due(MARKER_RETRY_S)
    channel.replied(batch, brokers.answer(address, MarkerChannel.request(batch)), 1.1)
    assert t.state == tx.COMPLETE_COMMIT


def test_not_owner_is_resent_to_the_new_owner():
    owners = {("s", 0): "b0"}
    txns, channel, brokers = setup([("s", 0)], owners)
    t = decide(txns, [("s", 0)], commit=False)
    [(address, batch)] = channel.due(0.0)
    owners[("s", 0)] = "b7"                           # a failover moved it meanwhile
    reply = brokers.answer(address, MarkerChannel.request(batch))
    assert reply == {"written": [], "not_owner": [["s", 0]]}
    channel.replied(batch, reply, 0.1)
    assert t.state == tx.PREPARE_ABORT and channel.counters["markers_not_owner"] == 1
    [(address, batch)] = channel.due(MARKER_RETRY_S)
    assert address == "b7"
    channel.replied(batch, brokers.answer(address, MarkerChannel.request(batch)), 1.1)
    assert t.state == tx.COMPLETE_ABORT and brokers.durable == {(("s", 0), t.producer_id, 1):
                                                                False}


def test_a_part_without_a_live_owner_waits_for_one():
    owners = {}
    txns, channel, brokers = setup([("s", 0)], owners)
    t = decide(txns, [("s", 0)])
    assert channel.due(0.0) == [] and channel.counters["markers_unplaced"] == 1
    owners[("s", 0)] = "b3"
    assert channel.due(MARKER_RETRY_S / 2) == []
    [(address, batch)] = channel.due(MARKER_RETRY_S)
    channel.replied(batch, brokers.answer(address, MarkerChannel.request(batch)), 1.1)
    assert address == "b3" and t.state == tx.COMPLETE_COMMIT


def test_a_late_duplicate_of_an_earlier_transactions_reply_changes_nothing():
    txns, channel, brokers = setup([("s", 0)])
    t = decide(txns, [("s", 0)], commit=True)
    [(address, first)] = channel.due(0.0)
    reply = brokers.answer(address, MarkerChannel.request(first))
    assert channel.replied(first, reply, 0.1) == 1
    decide(txns, [("s", 0)], commit=False, now=0.2)   # transaction 2 of the same producer
    assert (t.number, t.state) == (2, tx.PREPARE_ABORT)
    assert channel.replied(first, reply, 0.3) == 0    # transaction 1's reply, again
    assert t.state == tx.PREPARE_ABORT and t.written == set()
    [(address, batch)] = channel.due(0.4)
    assert [(m.txn, m.commit) for m in batch] == [(2, False)]


@pytest.mark.parametrize("bad", [None, "x", [["s", 0]], [["s", 0, 1, "2"]], [[0, 0, 1, 1]]])
def test_malformed_replies_acknowledge_nothing(bad):
    txns, channel, brokers = setup([("s", 0)])
    t = decide(txns, [("s", 0)])
    [(_, batch)] = channel.due(0.0)
    assert channel.replied(batch, {"written": bad, "not_owner": bad}, 0.1) == 0
    assert t.state == tx.PREPARE_COMMIT


@pytest.mark.parametrize("seed", range(6))
def test_a_seeded_walk_with_drops_delays_duplicates_and_moves(seed):
    """Each transaction completes, and only with a durable marker of its decided kind on every
    part; no marker is appended twice."""
    rng = random.Random(seed)
    parts = [("s", i) for i in range(6)]
    owners = {p: rng.choice(["b0", "b1", "b2"]) for p in parts}
    txns, channel, brokers = setup(parts, owners)
    in_flight: list[tuple[float, list[Marker], dict]] = []
    decided: list[tuple[str, int, int, bool, frozenset]] = []
    now = 0.0
    for step in range(600):
        now += 0.05
        tid = f"job{rng.randrange(3)}"
        t = txns.txns.get(tid)
        if rng.random() < 0.1 and (t is None or t.state in tx.IDLE):
            chosen = rng.sample(parts, rng.randrange(1, 4))
            t = decide(txns, chosen, rng.random() < 0.5, tid, now)
            decided.append((tid, t.producer_id, t.number, t.committing, frozenset(chosen)))
        if rng.random() < 0.05:
            owners[rng.choice(parts)] = rng.choice(["b0", "b1", "b2"])   # a failover
        for address, batch in channel.due(now):
            fate = rng.random()
            if fate < 0.25:
                continue                                            # dropped
            reply = brokers.answer(address, MarkerChannel.request(batch))
            copies = 2 if fate > 0.85 else 1                        # duplicated
            for _ in range(copies):
                in_flight.append((now + rng.uniform(0, 2.5), batch, reply))   # delayed
        arrived = [r for r in in_flight if r[0] <= now]
        in_flight = [r for r in in_flight if r[0] > now]
        for _, batch, reply in arrived:
            channel.replied(batch, reply, now)
    for _ in range(200):                                   # quiet: no more drops
        now += 0.5
        for address, batch in channel.due(now):
            channel.replied(batch, brokers.answer(address, MarkerChannel.request(batch)), now)
    assert decided and not txns.prepared
    for tid, pid, number, commit, chosen in decided:
        for part in chosen:
            assert brokers.durable[(part, pid, number)] == commit
    assert brokers.appends == sum(len(c) for *_, c in decided)
