"""A transactional producer on the simulated network (tests/sim/transactions.py says what runs).

The real kera.producer.Producer with a transactional_id: its transaction state
(kera.producer.transaction.TransactionState), its accumulator and pipeline (transactional
chunks, the brokers' verification, sequences with the transaction bit) and its request thread,
driven by this process through kera.client.env as the other simulated clients are. What the
simulation cannot run is the application's blocking calls (init_transactions, begin, commit,
abort: each waits on a condition or sleeps between retries): this process makes the same moves
of the same state object as events, in Producer's order, its coordinator calls sent as
requests of its own with a deadline and a bounded number of retries:

    init:   TransactionState.init_request -> txn_init -> on_init, the pipeline's new identity
    begin:  begin, barrier_request -> txn_add_parts (ConcurrentTransactions retried) -> on_barrier
    send:   Producer.send (it checks the transaction's state itself)
    commit: start_end(commit), seal and wait for every record to settle (flush), then
            end_request -> txn_end -> the pipeline's end_transaction, ended
    abort:  start_end(abort), drop what is unsent and wait for what is in flight (_drain), then
            txn_end (or txn_init, when a chunk may still land or a timeout fenced the epoch)

A failure that leaves the transaction abortable aborts it; a fence (a newer instance, or the
timeout) makes this instance init again, as an application restarting its task would.
"""

from __future__ import annotations

import functools

from kera.codec import wire
from kera.errors import ConcurrentTransactions, KeraError, Timeout, TransactionTimedOut
from kera.producer import Producer
from kera.producer import transaction as txns
from kera.producer.producer import failure_error

from tests.sim.clients import PRODUCER_RETRIES_MAX, Client, SimConsumer, sim_env
from tests.sim.transactions import (ABORTED, COMMITTED, COMMITTING, GROUP_PREFIX, UNKNOWN,
                                    TxnLedger, txn_value)

# A coordinator call's reply deadline, and how often a retriable refusal or a lost reply is
# retried (ConcurrentTransactions while markers are written: a few back-offs of up to 0.5 s).
CALL_TIMEOUT_S = 1.0
CALL_ATTEMPTS_MAX = 40
SETTLE_POLL_S = 0.01     # how often a flush or a drain looks at the pipeline again


class SimTxnProducer(Client):
    """Runs transactions one after the other until `txns_max`, or until it is told to finish
    (`finish`: one last committed transaction that writes to every streamlet, then idle)."""

    def __init__(self, net, address, rng, checker, coordinator, *, client: int, spec: dict,
                 ledger: TxnLedger, request_timeout_s: float, first_k: int = 0):
        super().__init__(net, address, f"txn producer {client}", rng, checker, coordinator)
        self.client = client
        self.spec = spec
        self.ledger = ledger
        self.request_timeout_s = request_timeout_s
        self.k = first_k            # the transaction's number (continued by a next instance)
        self.phase = "starting"
        self.finishing = False      # the healing asked for one last committed transaction
        self.done = False           # finished: nothing more to run
        self._calls: dict[int, tuple] = {}
        self.txn: txns.TransactionState | None = None

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self.producer = Producer(self.coordinator, request_timeout_s=self.request_timeout_s,
                                 retries_max=PRODUCER_RETRIES_MAX, env=sim_env(self),
                                 transactional_id=f"tx{self.client}",
                                 transaction_timeout_ms=self.spec["timeout_ms"])
        self.txn = self.producer._txn
        self.cache = self.producer._meta.cache
        self.names = [s["name"] for s in self.spec["streams"]]
        self.engine.want_describe(self.names)
        self.wake_at(self.sched.now)
        self.schedule(0.05, self._wait_streams)

    def _wait_streams(self) -> None:
        if all(n in self.cache.by_name for n in self.names):
            self._init()
            return
        self.engine.want_describe([n for n in self.names if n not in self.cache.by_name])
        self.wake_at(self.sched.now)
        self.schedule(0.05, self._wait_streams)

    def finish(self) -> None:
        self.finishing = True

    def idle(self) -> bool:
        return self.done

    # ------------------------------------------------------------------ coordinator calls
    def _call(self, op: str, fields: dict, on_ok, on_err, attempt: int = 1) -> None:
        req_id = self.send_request(self.coordinator, op, fields)
        self._calls[req_id] = (op, fields, on_ok, on_err, attempt)
        self.schedule(CALL_TIMEOUT_S, self._expire, req_id)

    def _expire(self, req_id: int) -> None:
        call = self._calls.pop(req_id, None)
        if call is not None:
            self._retry(call, Timeout(f"no reply to {call[0]}"))

    def _retry(self, call: tuple, err: KeraError) -> None:
        op, fields, on_ok, on_err, attempt = call
        if attempt >= CALL_ATTEMPTS_MAX:
            on_err(err)
            return
        if op == "txn_init" and isinstance(err, ConcurrentTransactions):
            fields = fields | {"producer_id": -1, "epoch": -1}   # as Producer._txn_call
        self.schedule(txns.retry_backoff_s(attempt), self._call, op, fields, on_ok, on_err,
                      attempt + 1)

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        call = self._calls.pop(header.get("id"), None)
        if call is None:
            if self.engine is not None:
                self.engine.deliver([(src, header, frames)])
                self.loop()
            return
        if header.get("ok") is True:
            call[2](header)
            return
        try:
            wire.raise_for_reply(header)
        except KeraError as err:
            if err.retriable:
                self._retry(call, err)
            else:
                call[3](err)

    def loop(self) -> None:
        if self.engine is not None:
            self.wake_at(self.engine.step())

    # ------------------------------------------------------------------ init
    def _init(self) -> None:
        if self.phase != "aborting":     # (aborting: the transaction ends with this init)
            self.phase = "init"
        self._call("txn_init", self.txn.init_request(), self._inited, self._stuck)

    def _inited(self, reply: dict) -> None:
        self.txn.on_init(reply)
        p = self.producer
        p.producer_id = p._acc.producer_id = self.txn.chunk_producer_id
        p._pipe.new_identity(p.producer_id)
        if self.phase == "aborting":
            self.ledger.outcome(self.client, self.k, ABORTED)   # the new epoch aborted it
            self.k += 1
        self.phase = "ready"
        self._next()

    def _stuck(self, err: KeraError) -> None:
        """A coordinator call failed for good (its retries spent, or refused): what was open
        is given up, and this producer inits again, as an application restarting its task
        would (a fenced instance is replaced by a new one with the same transactional id)."""
        if self.phase in ("open", "committing", "aborting"):
            self.phase = "aborting"     # the next init's epoch aborts it (_inited)
        if self.txn.state not in txns.INIT_STATES:
            self.txn.fail(err)
        if self.txn.state == txns.FENCED:
            self.producer._pipe.halted = True
            self.start()       # a new Producer: the old one is closed for good
            return
        self.schedule(0.1, self._init)

    # ------------------------------------------------------------------ a transaction
    def _next(self) -> None:
        if self.done:
            return
        if self.k >= self.spec["txns_max"] and not self.finishing:
            self.phase = "ready"
            self.schedule(0.1, self._next)    # wait for the healing's last transaction
            return
        self.schedule(self.rng.expovariate(1 / self.spec["interval_s"]), self._begin)

    def _begin(self) -> None:
        self.phase = "open"
        self.txn.begin()
        self.ledger.begun(self.client, self.k)
        fields = self.txn.barrier_request()
        if fields is None:
            self._write()
        else:
            self._call("txn_add_parts", fields, self._barrier_passed, self._failed)

    def _barrier_passed(self, _reply: dict) -> None:
        self.txn.on_barrier()
        self._write()

    def _write(self) -> None:
        """Records to every streamlet of every stream (so a later committed transaction is
        read past every earlier one), and the group's position, sometimes."""
        if self.phase != "open":
            return
        for name in self.names:
            info = self.cache.by_name[name]
            for sl in range(info.streamlets):
                for i in range(self.rng.randint(1, self.spec["records_max"])):
                    self._send(info, sl, i)
        if self.rng.random() < self.spec["positions_rate"]:
            self._join_positions()
        else:
            self.schedule(self.rng.uniform(0.0, 0.05), self._end)

    def _send(self, info, sl: int, i: int) -> None:
        try:
            self.producer.send(info.name, txn_value(self.client, self.k, info.id, sl, i),
                               streamlet=sl, on_delivery=functools.partial(self._settled))
        except KeraError:
            return    # abortable now (a failed earlier send): the end aborts it
        self.ledger.sending(self.client, self.k, (info.id, sl, i))

    def _settled(self, error, metadata) -> None:
        self.checker.counts["txn_records_acked" if error is None else "txn_records_failed"] += 1

    def _join_positions(self) -> None:
        stream = self.names[0]
        fields = self.txn.positions_request([[stream, 0, [[0, self.k, 0]]]],
                                            f"{GROUP_PREFIX}{self.client}")
        self.ledger.positions_joined(self.client, self.k, self.k)
        self._call("txn_add_positions", fields, self._positions_joined, self._failed)

    def _positions_joined(self, _reply: dict) -> None:
        self.txn.opened = True
        self._end()

    def _failed(self, err: KeraError) -> None:
        self.txn.fail(err)
        self._abort()

    def _end(self) -> None:
        if self.phase != "open":
            return
        commit = self.finishing or self.rng.random() >= self.spec["abort_rate"]
        if commit and self.txn.state == txns.IN_TRANSACTION and self.producer._pipe.txn_error is None:
            self._commit()
        else:
            self._abort()

    # ------------------------------------------------------------------ commit
    def _commit(self) -> None:
        self.phase = "committing"
        self.txn.start_end(commit=True)
        p = self.producer
        p._acc.seal_all()
        self._flush_target = p._pipe.last_serial
        p._wake()
        self._await_flush()

    def _await_flush(self) -> None:
        pipe = self.producer._pipe
        if not pipe.done_through(self._flush_target):
            self.schedule(SETTLE_POLL_S, self._await_flush)
            return
        failures = pipe.take_failures()
        if failures:
            self.txn.fail(failure_error(failures))
            self._abort()
            return
        self.txn.opened = self.txn.opened or pipe.txn_acked > 0
        fields = self.txn.end_request(True)
        self.ledger.outcome(self.client, self.k, COMMITTING)
        if fields is None:
            self._ended(True, {})
        else:
            self._call("txn_end", fields, functools.partial(self._ended, True), self._commit_failed)

    def _commit_failed(self, err: KeraError) -> None:
        if isinstance(err, TransactionTimedOut):
            self.ledger.outcome(self.client, self.k, ABORTED)   # the timeout aborted it
        else:
            self.ledger.outcome(self.client, self.k, UNKNOWN)
        self.txn.fail(err)
        self._abort()

    def _ended(self, commit: bool, _reply: dict) -> None:
        self.producer._pipe.end_transaction()
        self.txn.ended()
        self.ledger.outcome(self.client, self.k, COMMITTED if commit else ABORTED)
        self.k += 1
        if commit and self.finishing:
            self.done = True
            self.phase = "done"
            return
        self.phase = "ready"
        self._next()

    # ------------------------------------------------------------------ abort
    def _abort(self) -> None:
        if self.txn.state == txns.FENCED:
            self._stuck(self.txn.error)
            return
        self.phase = "aborting"
        self.ledger.outcome(self.client, self.k, ABORTED)
        self.txn.start_end(commit=False)
        p = self.producer
        aborted = KeraError("the transaction was aborted before this record was sent")
        p._pipe.halted = True
        for st in p._streams.values():
            p._acc.drop_stream(st, aborted)
        self._await_drain(aborted)

    def _await_drain(self, aborted: KeraError) -> None:
        """Producer._drain as events: bounded by the request timeout (Pipeline.expire)."""
        p = self.producer
        p._pipe.drop_unsent(aborted)
        if p._pipe.chunks_in_flight():
            self.schedule(SETTLE_POLL_S, self._await_drain, aborted)
            return
        p._pipe.halted = False
        p._wake()
        p._pipe.take_failures()
        txn = self.txn
        txn.opened = txn.opened or p._pipe.txn_acked > 0
        timed_out = any(isinstance(e, TransactionTimedOut) for e in (txn.error, p._pipe.txn_error))
        if p._pipe.txn_new_epoch or timed_out:
            self._init()
            return
        fields = txn.end_request(False)
        if fields is None:
            self._ended(False, {})
        else:
            self._call("txn_end", fields, functools.partial(self._ended, False), self._stuck)


class SimTxnConsumer(SimConsumer):
    """A read_committed consumer (the Consumer's default) of a transactional stream: what it
    reads goes to the transactions' ledger."""

    def __init__(self, *args, ledger: TxnLedger, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    def _take(self, sid: int, b) -> None:
        self.ledger.consumed(self.name, sid, b.streamlet, b.chunk.values()[b.skip:])
