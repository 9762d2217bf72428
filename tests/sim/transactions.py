"""Transactions in the simulation (issue 39): what a seed draws, and the all-or-nothing checks.

In one seed in TXN_ONE_IN (`draw_transactions`, a generator of its own: every other draw of
every seed stays as it was) the run gains two streams written only by transactional producers
(tests/sim/txn_producer.py: the real Producer's transaction state, chunks and request thread,
its blocking calls made as events), each transaction writing records to every streamlet of
both and, in some, a consumer group's position; some commit, some abort, and one producer may
be killed inside a transaction, its transaction then left to the fence of its next instance
(same transactional id) or to the coordinator's timeout (kera.coordinator.transactions
`expire`, on the coordinator's heartbeat tick), whichever comes first. A read_committed
consumer reads each stream from the earliest.

`TxnLedger` checks, where each could first break:

- a read_committed reader never sees a record of a transaction that is open (its producer has
  not asked to commit it) or aborted, and never one twice;
- after healing (every transactional producer ends with a committed transaction that writes to
  every streamlet, so the readers have gone past every earlier one, and the coordinator holds
  nothing open or prepared): each committed transaction's records were all read, each aborted
  or never-ended one's none, and one whose commit went unanswered all or none;
- the group position each transaction carried is the group's committed one iff it committed:
  the group ends at the last committed transaction's position (or a later unanswered one's).

A transaction all of whose records were read while it was open, or a stuck one that is never
aborted (the readers then never pass it, and the run does not settle), fails the run.
"""

from __future__ import annotations

import random
from collections import defaultdict

from tests.sim.checker import InvariantBroken

TXN_ONE_IN = 4
STREAMS = ("t0", "t1")
TXN_CLIENT_BASE = 200     # transactional producers' client numbers: apart from the others'
GROUP_PREFIX = "txg"      # the consumer group whose positions producer i's transactions carry

OPEN, COMMITTING, COMMITTED, ABORTED, UNKNOWN = "open", "committing", "committed", "aborted", "unknown"
# The coordinator's states (kera.coordinator.transactions) of a transaction not done yet.
ONGOING_STATES = ("Ongoing", "PrepareCommit", "PrepareAbort")


def draw_transactions(seed: int, duration_s: float, always: bool = False) -> dict | None:
    """The seed's transactional streams and producers, or None (most seeds)."""
    rng = random.Random(f"{seed}/txn")
    if rng.randrange(TXN_ONE_IN) and not always:
        return None
    streams = [{"name": name, "streamlets": rng.randint(1, 2), "active_groups": 1,
                "replication": rng.choice([2, 2, 3]), "group_segments": rng.randint(1, 3),
                "segment_size_bytes": rng.choice([4096, 16384]), "durability": "memory"}
               for name in STREAMS]
    producers = rng.choice([1, 2, 2])
    kill = None
    if rng.random() < 0.5:
        # (producer, when, how long it stays down): past the transaction timeout, the
        # coordinator aborts its transaction first; before it, the next instance's fence does.
        kill = (rng.randrange(producers), rng.uniform(0.6, duration_s),
                rng.choice([0.05, 0.5, 3.0]))
    return {"streams": streams, "producers": producers,
            "timeout_ms": rng.choice([1000, 2000, 5000]), "abort_rate": rng.choice([0.0, 0.3, 0.5]),
            "records_max": rng.choice([1, 3, 6]), "positions_rate": rng.choice([0.0, 0.5, 1.0]),
            "interval_s": rng.choice([0.02, 0.1]), "txns_max": rng.choice([10, 30]),
            "kill": kill}


def txn_value(client: int, k: int, sid: int, sl: int, i: int) -> bytes:
    return b"txn/%d/%d/%d/%d/%d|" % (client, k, sid, sl, i)


def parse_txn_value(value: bytes) -> tuple[int, int, int, int, int]:
    _, client, k, sid, sl, i = bytes(value).split(b"|", 1)[0].split(b"/")
    return int(client), int(k), int(sid), int(sl), int(i)


class TxnLedger:
    """Transactions as their producers ran them, and what read_committed readers saw."""

    def __init__(self, clock=lambda: 0.0):
        self.clock = clock     # simulated seconds: when transactions commit and are read whole
        self.committed_at: dict[tuple[int, int], float] = {}
        self.read_whole_at: dict[tuple[int, int], float] = {}
        self.status: dict[tuple[int, int], str] = {}          # (client, k) -> OPEN, ...
        self.sent: dict[tuple[int, int], set] = defaultdict(set)   # (client, k) -> records
        self.positions: dict[tuple[int, int], int] = {}       # (client, k) -> position carried
        self.read: dict[str, set] = defaultdict(set)          # consumer -> records read
        self.read_txns: dict[tuple[int, int], set] = defaultdict(set)   # (client, k) -> read
        self._last_k: dict[str, dict] = defaultdict(dict)   # consumer -> (client, sid, sl) -> k
        self.counts: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------------ producers
    def begun(self, client: int, k: int) -> None:
        self.status[(client, k)] = OPEN
        self.counts["txns"] += 1

    def sending(self, client: int, k: int, record: tuple) -> None:
        self.sent[(client, k)].add(record)

    def positions_joined(self, client: int, k: int, position: int) -> None:
        self.positions[(client, k)] = position

    def outcome(self, client: int, k: int, status: str) -> None:
        """What the producer knows of transaction k now: COMMITTING (txn_end commit sent),
        COMMITTED (answered), ABORTED (it will never commit: an abort asked, a fence, a
        timeout), UNKNOWN (a commit asked, then its producer died or gave up)."""
        before = self.status[(client, k)]
        if before in (COMMITTED, ABORTED, UNKNOWN):
            return
        if status == ABORTED and before == COMMITTING:
            status = UNKNOWN     # the commit may have been decided before the abort
        self.status[(client, k)] = status
        if status == COMMITTED:
            self.committed_at[(client, k)] = self.clock()
        if status in (COMMITTED, ABORTED, UNKNOWN):
            self.counts[f"txns_{status}"] += 1

    def killed(self, client: int) -> None:
        """The producer was killed: its open transaction will never commit."""
        for (c, k), status in self.status.items():
            if c == client and status in (OPEN, COMMITTING):
                self.outcome(c, k, ABORTED)

    # ------------------------------------------------------------------ readers
    def consumed(self, consumer: str, sid: int, sl: int, values) -> None:
        for v in values:
            client, k, vsid, vsl, i = parse_txn_value(v)
            record = (vsid, vsl, i)
            status = self.status.get((client, k))
            if (vsid, vsl) != (sid, sl):
                raise InvariantBroken(f"{consumer} read transactional record {v!r:.40} from "
                                      f"stream {sid} streamlet {sl}")
            if status in (None, OPEN, ABORTED):
                raise InvariantBroken(f"{consumer} (read_committed) read record {record} of "
                                      f"transaction {k} of producer {client}, which is "
                                      f"{status or 'unknown to its producer'}: only committed "
                                      f"records may be visible")
            key = (client, k, *record)
            if key in self.read[consumer]:
                raise InvariantBroken(f"{consumer} read record {record} of transaction {k} of "
                                      f"producer {client} twice")
            self._check_passed(consumer, client, k, vsid, vsl)
            self.read[consumer].add(key)
            self.read_txns[(client, k)].add(record)
            if self.read_txns[(client, k)] == self.sent[(client, k)]:
                self.read_whole_at[(client, k)] = self.clock()
            self.counts["txn_records_read"] += 1

    def _check_passed(self, consumer: str, client: int, k: int, sid: int, sl: int) -> None:
        """A reader at transaction k of a producer in a streamlet went past its earlier ones
        there (each began after the one before it ended, so its records lie after theirs):
        every record the committed ones wrote there must have been read."""
        last = self._last_k[consumer].get((client, sid, sl), 0)
        if k <= last:
            return
        read = self.read[consumer]
        for j in range(last, k):
            if self.status.get((client, j)) != COMMITTED:
                continue
            for record in self.sent[(client, j)]:
                if record[:2] == (sid, sl) and (client, j, *record) not in read:
                    raise InvariantBroken(
                        f"{consumer} read transaction {k} of producer {client} in stream {sid} "
                        f"streamlet {sl} past committed transaction {j}, whose record {record} "
                        f"it never read (a committed transaction must be visible whole)")
        self._last_k[consumer][(client, sid, sl)] = k

    def read_lag_s(self, client: int, after_s: float, before_s: float) -> float:
        """The longest a committed transaction of `client`, committed between the two times,
        waited to be read whole (how long a stuck transaction held the readers back)."""
        lags = [self.read_whole_at.get(t, float("inf")) - at for t, at in self.committed_at.items()
                if t[0] == client and after_s <= at <= before_s]
        return max(lags, default=0.0)

    # ------------------------------------------------------------------ after healing
    def unread(self) -> int:
        """Records of committed transactions not read yet."""
        return sum(len(self.sent[t] - self.read_txns[t]) for t, s in self.status.items()
                   if s == COMMITTED)

    def check(self, committed_positions: dict) -> None:
        """All or nothing per transaction; `committed_positions`: client -> the position its
        group holds (None: none)."""
        for t, status in sorted(self.status.items()):
            sent, read = self.sent[t], self.read_txns[t]
            if status == COMMITTED and read != sent:
                raise InvariantBroken(f"committed transaction {t[1]} of producer {t[0]}: "
                                      f"{len(sent - read)} of its {len(sent)} records never read")
            if status in (ABORTED, OPEN) and read:
                raise InvariantBroken(f"transaction {t[1]} of producer {t[0]} ({status}): "
                                      f"{len(read)} of its records were read")
            if status in (UNKNOWN, COMMITTING) and read and read != sent:
                raise InvariantBroken(f"transaction {t[1]} of producer {t[0]}: {len(read)} of "
                                      f"its {len(sent)} records read (all or nothing)")
        for client, held in sorted(committed_positions.items()):
            self._check_position(client, held)

    def _check_position(self, client: int, held: int | None) -> None:
        carried = sorted((k, pos) for (c, k), pos in self.positions.items() if c == client)
        done = [pos for k, pos in carried if self.status[(client, k)] == COMMITTED]
        expect = done[-1] if done else None
        # A later transaction whose commit went unanswered may have committed.
        maybe = {pos for k, pos in carried if self.status[(client, k)] in (UNKNOWN, COMMITTING)
                 and (expect is None or pos > expect)}
        if held != expect and held not in maybe:
            raise InvariantBroken(f"group {GROUP_PREFIX}{client} holds position {held}, but its "
                                  f"last committed transaction carried {expect} (positions are "
                                  f"committed iff their transaction commits)")
        self.counts["txn_positions_checked"] += 1
