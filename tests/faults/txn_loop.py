"""A read-process-write loop as its own process, for tests/faults/test_txn_faults.py.

    python -m tests.faults.txn_loop BOOTSTRAP TRANSACTIONAL_ID GROUP IDLE_EXIT_S

Consumes stream `A` in GROUP (static membership, so a restart takes its predecessor's
streamlets back at once) and, per batch of up to BATCH_MAX records, runs one transaction that
writes one record to `B` and one to `C` per input (key: the input's value; value: b"B:" or
b"C:" and the input's value) and joins the consumer's positions: Kafka's consume-transform-
produce loop (docs/TRANSACTIONS.md, "What a user writes").

The group metadata sent with the positions is the one the batch was read under, taken
before the poll (Kafka's consumer can only change it inside poll(), so its
`groupMetadata()` after processing is that one). kera's Consumer changes it from its request
thread: a member the coordinator forgot (a coordinator restart or failover) drops its
streamlets and rejoins between a poll and `consumer.group_metadata()`, whose new member and
epoch then carry positions that do not cover the batch, and the transaction commits its
outputs without them (test_txn_faults.py's xfail test shows it). With the metadata of the
poll the coordinator refuses the positions (UnknownMember, StaleMemberEpoch) and the loop
starts again.

The transactional id is taken before the group is joined: its `init` fences the killed
predecessor and ends what it left open (a commit decided completes, anything else aborts),
so the positions the group hands out afterwards are exactly those of the committed outputs.

Prints one JSON line per event: {"ready": true} once it consumes, {"committed": n} after each
commit, {"error": message} before exiting with ERROR_EXIT on any failure (the test restarts
it, as a supervisor would). With IDLE_EXIT_S > 0 it exits 0 after that long with nothing to
read: the input is drained.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kera import Consumer, Producer

SOURCE, SINKS = "A", ("B", "C")
BATCH_MAX = 50                  # records per transaction: a few chunks per output streamlet
POLL_S = 0.2                    # the first record of a batch: how long to wait for it
REQUEST_TIMEOUT_S = 3.0         # per request: a failover is retried through
CALL_TIMEOUT_S = 60.0           # a transactional call, a failover or coordinator restart included
TRANSACTION_TIMEOUT_MS = 10_000 # a predecessor's open transaction, if nobody inits: aborted by then
SESSION_TIMEOUT_MS = 10_000     # the static member's place is kept this long after a kill
ERROR_EXIT = 3


def say(**event) -> None:
    print(json.dumps({"t": round(time.time(), 3), "pid": os.getpid(), **event}), flush=True)


def next_batch(consumer: Consumer) -> list:
    """Up to BATCH_MAX records: waits POLL_S for the first, then takes what is already there."""
    first = consumer.poll(timeout_s=POLL_S)
    if first is None:
        return []
    batch = [first]
    while len(batch) < BATCH_MAX:
        r = consumer.poll(timeout_s=0)
        if r is None:
            break
        batch.append(r)
    return batch


def process(producer: Producer, consumer: Consumer, batch: list, member) -> list:
    """One transaction for `batch`, read as `member`; returns the positions it committed."""
    producer.begin_transaction()
    for r in batch:
        for sink in SINKS:
            producer.send(sink, sink.encode() + b":" + r.value, key=r.value)
    positions = consumer.positions()
    producer.send_positions_to_transaction(positions, member, timeout_s=CALL_TIMEOUT_S)
    producer.commit_transaction(timeout_s=CALL_TIMEOUT_S)
    return positions


def run(bootstrap: str, tid: str, group: str, idle_exit_s: float) -> None:
    producer = Producer(bootstrap, transactional_id=tid, request_timeout_s=REQUEST_TIMEOUT_S,
                        send_timeout_s=CALL_TIMEOUT_S, linger_ms=2,
                        transaction_timeout_ms=TRANSACTION_TIMEOUT_MS)
    producer.init_transactions(timeout_s=CALL_TIMEOUT_S)
    consumer = Consumer(bootstrap, SOURCE, group=group, group_instance_id=tid,
                        auto_commit_interval_ms=None, request_timeout_s=REQUEST_TIMEOUT_S,
                        session_timeout_ms=SESSION_TIMEOUT_MS)
    say(ready=True)
    committed, idle_since = 0, time.monotonic()
    try:
        while idle_exit_s <= 0 or time.monotonic() - idle_since < idle_exit_s:
            member = consumer.group_metadata()   # granted streamlets: a settled epoch
            batch = next_batch(consumer) if member.member_id and consumer.assignment() else []
            if not batch:
                if not consumer.assignment():   # not yet granted A's streamlets: not idle
                    idle_since = time.monotonic()
                    time.sleep(POLL_S)
                continue
            positions = process(producer, consumer, batch, member)
            committed += len(batch)
            idle_since = time.monotonic()
            say(committed=committed, inputs=[batch[0].value.decode(), batch[-1].value.decode()],
                positions=[list(p[1:4]) for p in positions], member=list(member[1:]))
    finally:
        consumer.close()
        producer.close(timeout=REQUEST_TIMEOUT_S)


def main(argv: list[str]) -> int:
    try:
        run(argv[0], argv[1], argv[2], float(argv[3]))
    except Exception as err:   # noqa: BLE001 - reported; the test restarts the loop
        say(error=f"{type(err).__name__}: {err}")
        return ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
