"""A Waltz-style service on kera: bank transfers with optimistic locking, no overdrafts.

Several instances of one service share a ledger stream. Each keeps every account's balance in
memory by applying the stream's transfers in record-number order, and remembers the number of
the last one it applied: its high-water mark. To make a transfer it checks the balance in its
own state, then appends the transfer conditionally, locking both accounts:

    log.append("ledger", [transfer], locks=[src, dst], high_water_mark=applied)

If another instance moved money in or out of either account after `applied`, the broker refuses
the append (LockConflict, nothing stored); the instance reads on, re-executes the transfer
against the new balances (it may no longer be affordable) and tries again. So no account is ever
overdrawn, however the instances race, and every instance ends with the same balances.

    kera local --dir /tmp/kera &            # a cluster at 127.0.0.1:7000
    python examples/ledger_service.py --bootstrap 127.0.0.1:7000 --instances 4 --transfers 50

It prints the balances, then "N transfers by K instances (C conflicts re-executed): every
instance agrees, no account overdrawn, total conserved".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

from kera.client.admin import Admin
from kera.services.conditional import ConditionalAppender
from kera.consumer import Consumer
from kera.errors import LockConflict, StreamExists
from kera.producer import Producer

ACCOUNTS = ["ada", "grace", "edsger", "barbara", "alan"]
OPENING_BALANCE = 100
CATCH_UP_WAIT_S = 30.0       # an instance reads up to a number it was told of within it
POLL_S = 0.05


class Instance:
    """One service instance: its own reader, its own state, its own conditional writer."""

    def __init__(self, bootstrap: str, stream: str, seed: int):
        self.stream = stream
        self.rng = random.Random(seed)
        self.balances = {a: 0 for a in ACCOUNTS}
        self.applied = -1                      # high-water mark: last record number applied
        self.reader = Consumer(bootstrap, stream, start="earliest")
        self.log = ConditionalAppender(bootstrap)
        self.made = self.conflicts = 0

    def apply(self, record) -> None:
        t = json.loads(record.value)
        self.balances[t["from"]] = self.balances.get(t["from"], 0) - t["amount"]
        self.balances[t["to"]] += t["amount"]
        self.applied = record.number

    def catch_up(self, through: int = -1) -> None:
        """Apply what is there (and at least everything up to `through`)."""
        deadline = time.monotonic() + CATCH_UP_WAIT_S
        while True:
            r = self.reader.poll(timeout_s=POLL_S)
            if r is not None:
                self.apply(r)
            elif self.applied >= through:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"read up to {self.applied}, not {through}")

    def transfer(self) -> None:
        """One transfer, re-executed after each conflict until it is stored or unaffordable."""
        src, dst = self.rng.sample(ACCOUNTS, 2)
        amount = self.rng.randrange(10, 60)
        while self.balances[src] >= amount:
            body = json.dumps({"from": src, "to": dst, "amount": amount}).encode()
            try:
                self.log.append(self.stream, [body], locks=[src, dst], high_water_mark=self.applied)
                self.made += 1
                return
            except LockConflict as err:
                self.conflicts += 1
                self.catch_up(err.number)     # someone touched src or dst: read on, re-check

    def run(self, transfers: int) -> None:
        for _ in range(transfers):
            self.catch_up()
            self.transfer()

    def close(self) -> None:
        self.reader.close()
        self.log.close()


def open_accounts(bootstrap: str, stream: str) -> int:
    """Deposits from "bank" to every account; returns the number of the last one."""
    with Producer(bootstrap) as p:
        futures = [p.send(stream, json.dumps({"from": "bank", "to": a, "amount": OPENING_BALANCE}).encode())
                   for a in ACCOUNTS]
    return max(f.result(CATCH_UP_WAIT_S).number for f in futures)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default="127.0.0.1:7000")
    ap.add_argument("--stream", default="ledger")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--transfers", type=int, default=50, help="transfers tried per instance")
    args = ap.parse_args(argv)
    with Admin(args.bootstrap) as admin:
        try:
            admin.create_stream(args.stream, streamlets=1)   # one ordered unit: numbers, locks
        except StreamExists:
            sys.exit(f"stream {args.stream!r} exists: pick a new --stream for a fresh ledger")
    opened = open_accounts(args.bootstrap, args.stream)
    instances = [Instance(args.bootstrap, args.stream, seed) for seed in range(args.instances)]
    threads = [threading.Thread(target=i.run, args=(args.transfers,)) for i in instances]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = max(i.applied for i in instances)
    for i in instances:
        i.catch_up(max(last, opened))
    return report(instances)


def report(instances: list[Instance]) -> int:
    first = instances[0].balances
    for account in ACCOUNTS:
        print(f"{account:10} {first[account]:>6}")
    agree = all(i.balances == first for i in instances)
    overdrawn = [a for a in ACCOUNTS if first[a] < 0]
    conserved = sum(first[a] for a in ACCOUNTS) == OPENING_BALANCE * len(ACCOUNTS)
    made, conflicts = sum(i.made for i in instances), sum(i.conflicts for i in instances)
    for i in instances:
        i.close()
    if not (agree and conserved) or overdrawn:
        print(f"FAILED: agree={agree} overdrawn={overdrawn} conserved={conserved}")
        return 1
    print(f"{made} transfers by {len(instances)} instances ({conflicts} conflicts re-executed): "
          f"every instance agrees, no account overdrawn, total conserved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
