"""The Producer: the caller's side (source) and one background request thread.

    with Producer("127.0.0.1:7000") as p:
        p.send("clicks", b"value", key=b"user-1")
        p.send_batch("clicks", [b"a", b"b", b"c"])
        p.flush()

    with Producer("127.0.0.1:7000", transactional_id="enricher-3") as p:   # all or nothing
        p.init_transactions()
        p.begin_transaction()
        p.send("invoices", b"...")
        p.send_positions_to_transaction(consumer.positions(), consumer.group_metadata())
        p.commit_transaction()        # or abort_transaction()

`send` appends to the open chunk of the record's streamlet (Accumulator); full chunks are sealed
and queued in the Pipeline; the request thread (Sender) seals chunks older than `linger_ms`,
sends produce requests and applies the replies. Both sides share one lock; the request thread
does its socket I/O outside it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Mapping

from kera.codec import chunk as chunkcodec
from kera import config
from kera.errors import (BadRequest, ClientClosed, ConcurrentTransactions, KeraError,
                         StaleMemberEpoch, Timeout, TransactionTimedOut, Undelivered)
from kera.client.metadata import Metadata, StreamInfo
from kera.producer import batch as batching
from kera.producer.accumulator import Accumulator, StreamState
from kera.producer.delivery import DeliveryFuture, on_delivery_callback
from kera.producer.pipeline import Failure, Pipeline
from kera.producer.sender import Sender, Shared, StreamHooks
from kera.producer.transaction import TransactionState
from kera.producer import transaction as txns
from kera.codec.txn import TXN_SEQUENCE_BIT
from kera.client.env import ClientEnv
from kera.client.kafka_config import PRODUCER_PROPERTIES, kera_arguments
from kera.codec.partitioner import key_hash
from kera.codec.timestamps import check_us, ms_column_to_us, ms_to_us

log = logging.getLogger(__name__)

DEFAULT_RETRIES_MAX = 30
# An abort re-checks this often for chunks that went back to unsent (a failed request's) to
# drop them: a failed request does not wake the waiting caller.
DRAIN_CHECK_S = 0.05
# The least time a transactional coordinator call is given, even at its deadline: one round trip.
COORDINATOR_CALL_MIN_S = 0.5


def new_producer_id() -> int:
    return int.from_bytes(os.urandom(8), "little")


def _check_sizes(max_record_bytes: int, in_flight_per_broker: int, buffer_bytes: int,
                 chunk_size_bytes: int) -> None:
    """ValueError for sizes a Producer cannot work with, naming the limit."""
    if max_record_bytes + chunkcodec.HEADER_SIZE > chunkcodec.MAX_CHUNK_BYTES:
        raise ValueError(f"max_record_bytes={max_record_bytes} exceeds the chunk limit: a "
                         f"chunk holds at most {chunkcodec.MAX_CHUNK_BYTES} bytes "
                         f"(kera.codec.chunk.MAX_CHUNK_BYTES) with its "
                         f"{chunkcodec.HEADER_SIZE}-byte header")
    if in_flight_per_broker < 1 or buffer_bytes < chunk_size_bytes:
        raise ValueError("in_flight_per_broker must be >= 1 and buffer_bytes >= chunk_size_bytes")


def failure_error(failures: list[Failure]) -> KeraError:
    """One exception for the failures since the last flush: the first failure's class, with a
    message naming its stream and streamlet and the totals."""
    first = failures[0]
    records = sum(f.records for f in failures)
    where = sorted({(f.stream, f.streamlet) for f in failures})
    more = f" (and {len(where) - 1} more streamlets)" if len(where) > 1 else ""
    message = (f"{records} records failed: stream '{first.stream}' streamlet {first.streamlet}"
               f"{more}: [{first.error.code}] {first.error.message}")
    err = first.error.__class__(message, retriable=False) if isinstance(first.error, KeraError) \
        else KeraError(message)
    if type(err) is KeraError:
        err.code = first.error.code
    err.failures = failures
    return err


class Producer:
    """Appends records to streams; thread-safe (any thread may send, flush or close).

    `bootstrap` is the coordinator's "host:port". Chunks of `chunk_size_bytes` are sealed when full
    or `linger_ms` after their first record; a request to a broker carries the next chunk of
    each streamlet, then runs of the chunks after them while it has room, up to
    `request_size_bytes`, with `in_flight_per_broker` requests in flight per broker. Sent but
    unacknowledged bytes are bounded by `buffer_bytes` (`send` blocks up to `send_timeout_s`,
    then raises Timeout). A chunk is retried (same identity, so never stored twice) on retriable
    errors up to `retries_max` times. `producer_id` is random
    unless given; give one only with a sequence space of its own (the broker drops a chunk
    whose (producer id, streamlet, sequence) it already holds as a duplicate): reusing an id
    in a new Producer on the same stream makes its first chunks look like duplicates.
    Each stream's descriptor is asked for again at least every `metadata_max_age_ms`, so a
    raised streamlet count is used within that time (keys then map over the new count).
    `bootstrap` may be a confluent-kafka configuration dict instead (kera.client.kafka_config).
    `partitioner` places keyed records: "crc32c" (kera's default) or "murmur2" (Kafka's
    clients' default: a key then lands where a Kafka producer puts it, kera.codec.partitioner);
    None (the default): each stream's own `partitioner` setting (`kera stream describe`).
    `transactional_id` (Kafka's transactional.id) makes it a transactional producer
    (docs/TRANSACTIONS.md): records are sent only inside transactions
    (`init_transactions` once, then `begin_transaction` ... `commit_transaction` or
    `abort_transaction`), each all or nothing for read_committed consumers; a transaction left
    open longer than `transaction_timeout_ms` is aborted by the cluster.
    """

    def __init__(self, bootstrap: str, *,
                 chunk_size_bytes: int = config.DEFAULT_CHUNK_SIZE_BYTES,
                 linger_ms: float = config.DEFAULT_LINGER_MS,
                 request_size_bytes: int = config.DEFAULT_REQUEST_SIZE_BYTES,
                 in_flight_per_broker: int = config.DEFAULT_IN_FLIGHT_PER_BROKER,
                 buffer_bytes: int = config.DEFAULT_BUFFER_BYTES,
                 max_record_bytes: int = config.DEFAULT_MAX_RECORD_BYTES,
                 send_timeout_s: float = config.DEFAULT_SEND_TIMEOUT_S,
                 request_timeout_s: float = config.DEFAULT_REQUEST_TIMEOUT_S,
                 producer_id: int | None = None,
                 retries_max: int = DEFAULT_RETRIES_MAX,
                 compression: str | None = None,
                 key_file: str | None = None, env: ClientEnv | None = None,
                 metadata_max_age_ms: int = config.DEFAULT_METADATA_MAX_AGE_MS,
                 partitioner: str | None = None,
                 transactional_id: str | None = None,
                 transaction_timeout_ms: int = txns.TIMEOUT_MS_DEFAULT):
        if isinstance(bootstrap, Mapping):   # a confluent-kafka configuration dict
            given = {k: v for k, v in locals().items() if k not in ("self", "bootstrap")}
            self.__init__(**kera_arguments(bootstrap, PRODUCER_PROPERTIES, Producer.__init__,
                                           given))
            return
        _check_sizes(max_record_bytes, in_flight_per_broker, buffer_bytes, chunk_size_bytes)
        # None: each stream's own; an unknown name is refused before anything starts.
        self._key_hash = None if partitioner is None else key_hash(partitioner)
        if compression not in chunkcodec.COMPRESSIONS:
            raise ValueError(f"compression={compression!r}: use None, 'lz4' or 'zstd'")
        self.compression = compression
        # The transaction's state (None: not transactional); chunks then carry its identity.
        self._txn = None if transactional_id is None else \
            TransactionState(transactional_id, transaction_timeout_ms)
        if self._txn is not None and producer_id is not None:
            raise BadRequest("give a transactional_id or a producer_id, not both: a "
                             "transactional producer's id comes from init_transactions()")
        self.producer_id = new_producer_id() if producer_id is None else producer_id % (1 << 64)
        self.buffer_bytes = buffer_bytes
        self.send_timeout_s = send_timeout_s
        self.request_timeout_s = request_timeout_s
        # CURVE key (kera.net.keys; None: $KERA_KEY_FILE, else plaintext), for every connection.
        self.key_file = key_file
        # Clock, connections, wake-ups, thread (kera.client.env): real unless simulated.
        self._env = env or ClientEnv()
        self._meta = Metadata(bootstrap, timeout_s=request_timeout_s, key_file=key_file,
                              max_age_s=metadata_max_age_ms / 1000)
        if self._env.prime is not None:
            self._env.prime(self._meta)
        self._pipe = Pipeline(request_size_bytes=request_size_bytes,
                              in_flight_per_broker=in_flight_per_broker,
                              retries_max=retries_max, request_timeout_s=request_timeout_s,
                              sequence_bit=0 if self._txn is None else TXN_SEQUENCE_BIT)
        self._acc = Accumulator(self._pipe, self.producer_id, chunk_size_bytes=chunk_size_bytes,
                                max_record_bytes=max_record_bytes, linger_s=linger_ms / 1000,
                                compression=compression, clock=self._env.clock,
                                key_hash=self._key_hash)
        lock = threading.Lock()
        # With the request thread, under one lock: the pipeline, the accumulator and the
        # thread's flags (kera.producer.sender.Shared); `_cond` wakes flush and full-buffer waits.
        self._shared = Shared(lock, threading.Condition(lock), self._pipe, self._acc)
        self._lock, self._cond = lock, self._shared.cond
        self._streams: dict[str, StreamState] = {}
        self._closed = False
        self._batch_records = 0
        self._bootstrap = bootstrap
        self._appender = None   # kera.services.conditional.ConditionalAppender, made at the first append
        # The request thread sleeps in a zmq poll; a byte on this pipe wakes it (`Shared.idle`
        # says whether it is asleep, so a busy thread is not woken once per chunk).
        self._waker = self._env.waker()
        self._sender = self._start_sender()

    def _start_sender(self) -> Sender:
        """The request thread, given what it shares with this producer and nothing else."""
        sender = Sender(f"kera-producer-{self.producer_id:016x}", self._shared, self._meta,
                        self._waker, StreamHooks(self._grow, self._stream_gone),
                        request_timeout_s=self.request_timeout_s, key_file=self.key_file,
                        env=self._env)
        sender.start_engine()
        return sender

    # ------------------------------------------------------------------ send
    def send(self, stream: str, value: bytes | None, key: bytes | None = None,
             timestamp: int | None = None, *, timestamp_ms: int | None = None,
             headers=None, streamlet: int | None = None, on_delivery=None) -> DeliveryFuture:
        """Queue one record. Blocks (up to send_timeout_s) while the buffer is full.
        `timestamp` is in microseconds; `timestamp_ms` (milliseconds, like Kafka) instead.
        A None `value` is a tombstone (read back as None, unlike b""). `headers`: (str, bytes)
        pairs kept in order. `streamlet` places the record there instead of by its key.

        Returns a DeliveryFuture resolving to the record's RecordMetadata (stream, streamlet,
        group, offset as consumers see them) or its KeraError. `on_delivery(err, metadata)`
        (confluent-kafka's signature) is called once settled, on the producer's IO thread:
        keep it short, it delays the next request."""
        if self._txn is not None:
            self._check_txn_send()
        if timestamp_ms is not None:
            timestamp = ms_to_us(timestamp_ms)
        elif timestamp is not None:
            if timestamp.__class__ is not int:
                timestamp = int(timestamp)
            check_us(timestamp)
        st = self._streams.get(stream)
        if st is None:
            st = self._stream_state(stream)
        if value is not None and value.__class__ is not bytes:
            value = batching.as_bytes(value, "value")
        if headers:
            headers = batching.normalize_headers(headers)
        if streamlet is not None and not 0 <= streamlet < st.streamlets:
            raise BadRequest(f"stream '{stream}' has streamlets 0..{st.streamlets - 1}, not {streamlet}")
        if key is not None and key.__class__ is not bytes:
            key = batching.as_bytes(key, "key")
        future = DeliveryFuture()
        if on_delivery is not None:
            future.add_done_callback(on_delivery_callback(on_delivery))
        with self._lock:
            if self._acc.open_bytes + self._pipe.pending_bytes > self.buffer_bytes or self._closed:
                self._wait_for_room()
            event = self._acc.append(st, value, key, timestamp, headers or None, streamlet, future)
            if event and self._shared.idle:
                self._shared.idle = False
                self._wake()
        return future

    def send_batch(self, stream: str, values, keys=None, timestamps=None,
                   headers=None, *, timestamps_ms=None) -> list[DeliveryFuture]:
        """Queue many records with O(1) Python calls per chunk; returns one DeliveryFuture per
        chunk, resolving to RecordMetadata(count=its records, offset=its first record's).
        (`len()` of the list is no longer the record count: sum the futures' counts.)

        `values`: a list of bytes, a numpy 'S' array, a 2-D uint8 array (one row per value) or
        a pyarrow binary array. `keys`: None, or one bytes/None per value (numpy 'S' and
        pyarrow arrays too). `timestamps`: None (now), one int, or one int64 per value (µs);
        `timestamps_ms` the same in milliseconds (Kafka's unit) instead.
        `headers`: None, or one list of (str, bytes) pairs (or None) per value.
        """
        if self._txn is not None:
            self._check_txn_send()
        if timestamps_ms is not None:
            timestamps = ms_column_to_us(timestamps_ms)
        st = self._streams.get(stream) or self._stream_state(stream)
        n, pieces = batching.plan(values, keys, timestamps, streamlets=st.streamlets,
                                  capacity=self._acc.capacity,
                                  max_record_bytes=self._acc.max_record_bytes,
                                  keyless_streamlet=st.sticky, headers=headers,
                                  key_hash=st.key_hash)
        return [self._queue_piece(st, piece) for piece in pieces]

    def _queue_piece(self, st: StreamState, piece: batching.Piece) -> DeliveryFuture:
        sl = piece.streamlet
        with self._lock:
            if self._acc.open_bytes + self._pipe.pending_bytes > self.buffer_bytes or self._closed:
                self._wait_for_room()
            if sl is None:
                sl = st.sticky
                st.sticky = (sl + 1) % st.streamlets
            self._acc.seal_streamlet(st, sl)  # records sent before this batch go first
            lane = st.lanes[sl]
            data = chunkcodec.encode(lane.producer_id, lane.wire_sequence, st.info.id, sl,
                                     piece.values, piece.keys, piece.timestamps,
                                     headers=piece.headers, compression=self.compression)
            future = DeliveryFuture()
            self._pipe.add(lane, data, lane.next_sequence, piece.count, [(-1, piece.count, future)])
            self._batch_records += piece.count
            if self._shared.idle:
                self._shared.idle = False
                self._wake()
        return future

    # ------------------------------------------------------------------ explicit identity
    def stream_info(self, stream: str) -> StreamInfo:
        """The stream's descriptor (id, streamlets, ...), as this producer knows it."""
        return (self._streams.get(stream) or self._stream_state(stream)).info

    def send_chunk(self, stream: str, chunk: bytes) -> None:
        """Internal: queue a chunk encoded by the caller (kera.codec.chunk.encode) with its own
        producer id and sequence. Chunks of one (producer id, streamlet) must be given in
        sequence order; a chunk the broker already holds is acknowledged, not stored again."""
        self._refuse_if_transactional("send_chunk")
        info = self.stream_info(stream)
        header = chunkcodec.verify(chunk)
        if header.stream_id != info.id or header.streamlet >= info.streamlets:
            raise BadRequest(f"chunk for stream id {header.stream_id} streamlet {header.streamlet} "
                             f"does not belong to stream '{stream}' (id {info.id}, "
                             f"{info.streamlets} streamlets)")
        chunk = bytes(chunk)
        with self._lock:
            if self._acc.open_bytes + self._pipe.pending_bytes > self.buffer_bytes or self._closed:
                self._wait_for_room()
            self._pipe.add_foreign(stream, chunk)
            self._batch_records += header.record_count
            if self._shared.idle:
                self._shared.idle = False
                self._wake()

    def send_batch_as(self, stream: str, streamlet: int, values, *, producer_id: int,
                      sequence_start: int, keys=None, timestamps=None) -> int:
        """Internal (deterministic writers such as the Spark sink): encode `values` for one
        streamlet into chunks with an explicit identity, sequences `sequence_start`, +1, ...
        The same input always makes the same chunks, so a replay is de-duplicated by the
        broker. Returns the next sequence."""
        self._refuse_if_transactional("send_batch_as")
        info = self.stream_info(stream)
        if not 0 <= streamlet < info.streamlets:
            raise BadRequest(f"stream '{stream}' has no streamlet {streamlet}")
        _, pieces = batching.plan(values, keys, timestamps, streamlets=1,
                                  capacity=self._acc.capacity,
                                  max_record_bytes=self._acc.max_record_bytes, keyless_streamlet=0)
        sequence = sequence_start
        for piece in pieces:
            # Keyed or not, every record goes to the one streamlet given (streamlets=1 above).
            data = chunkcodec.encode(producer_id, sequence, info.id, streamlet, piece.values,
                                     piece.keys, piece.timestamps)
            self.send_chunk(stream, data)
            sequence += 1
        return sequence

    def append(self, stream: str, values, *, locks=(), high_water_mark: int = -1, keys=None,
               headers=None, streamlet: int | None = None, key: bytes | None = None):
        """A conditional append (Waltz's optimistic locking; kera.services.conditional): `values` are
        stored as one chunk only if none of `locks` was written by a record numbered after
        `high_water_mark`. Blocks until stored (returns RecordMetadata with its `number`) or
        refused (raises LockConflict, nothing stored). Independent of send()'s ordering."""
        self._refuse_if_transactional("append")
        if self._appender is None:
            from kera.services.conditional import ConditionalAppender
            self._appender = ConditionalAppender(self._bootstrap, key_file=self.key_file,
                                                 request_timeout_s=self.request_timeout_s,
                                                 timeout_s=self.send_timeout_s,
                                                 key_hash=self._key_hash)
        return self._appender.append(stream, values, locks=locks, high_water_mark=high_water_mark,
                                     keys=keys, headers=headers, streamlet=streamlet, key=key)

    # ------------------------------------------------------------------ transactions
    def init_transactions(self, timeout_s: float | None = None) -> None:
        """Take the transactional id: fences any older producer holding it and aborts what it
        left open. Retries ConcurrentTransactions (the previous transaction still completing)
        for up to `timeout_s` (default: the transaction timeout), then raises Timeout."""
        txn = self._transactional("init_transactions")
        deadline = self._deadline(timeout_s, txn.timeout_ms / 1000)
        if txn.state == txns.ABORTABLE:   # giving the transaction up: its chunks first
            self._drain(deadline)
        self._init(deadline)

    def begin_transaction(self) -> None:
        """Start a transaction: what is sent from now until commit_transaction() is stored
        all or nothing. After a transaction the cluster held, waits (up to send_timeout_s)
        until that one's markers are written."""
        txn = self._transactional("begin_transaction")
        with self._lock:
            txn.begin()
            fields = txn.barrier_request()
        if fields is None:
            return
        try:   # the previous transaction's markers first (kera.producer.transaction)
            self._txn_call("txn_add_parts", fields, self._deadline(None), "begin_transaction")
        except KeraError as err:
            with self._lock:
                txn.fail(err)
            raise
        with self._lock:
            txn.on_barrier()

    def send_positions_to_transaction(self, positions, group, timeout_s: float | None = None
                                      ) -> None:
        """Join consumer positions to the transaction: `group` commits them exactly when the
        transaction commits (dropped if it aborts). `positions`: consumer.positions();
        `group`: the group's name or consumer.group_metadata() (then a member fenced by a
        rebalance cannot join its positions: StaleMemberEpoch, and the transaction must be
        aborted)."""
        from kera.consumer.membership import positions_to_wire
        txn = self._transactional("send_positions_to_transaction")
        self._check_txn_send()
        with self._lock:
            fields = txn.positions_request(positions_to_wire(list(positions)), group)
        try:
            self._txn_call("txn_add_positions", fields, self._deadline(timeout_s),
                           "send_positions_to_transaction", final=(StaleMemberEpoch,))
        except KeraError as err:
            with self._lock:
                txn.fail(err)
            raise
        txn.opened = True

    def commit_transaction(self, timeout_s: float | None = None) -> None:
        """Flush the transaction's records, then commit it: once this returns, read_committed
        consumers see all of it and its positions are the group's. A failure leaves it
        abortable (abort_transaction(), then redo); a Timeout may be retried by calling
        commit_transaction again."""
        txn = self._transactional("commit_transaction")
        deadline = self._deadline(timeout_s)
        with self._lock:
            txn.start_end(commit=True)
        try:
            self.flush(max(0.0, deadline - time.monotonic()))
        except KeraError as err:
            with self._lock:
                txn.fail(err)
            raise
        with self._lock:
            txn.opened = txn.opened or self._pipe.txn_acked > 0
        self._end(True, deadline)

    def abort_transaction(self, timeout_s: float | None = None) -> None:
        """Abort the transaction: records not yet sent are dropped (their futures fail),
        those in flight are waited for, then the cluster discards all of it. When an answer
        never came (a broker down), a new epoch is taken instead, which aborts and fences."""
        txn = self._transactional("abort_transaction")
        deadline = self._deadline(timeout_s)
        with self._lock:
            txn.start_end(commit=False)
        self._drain(deadline)
        with self._lock:
            txn.opened = txn.opened or self._pipe.txn_acked > 0
            # A timeout fenced the epoch (KIP-588: init again with it); or a chunk may still
            # land unanswered: a new epoch fences it.
            timed_out = any(isinstance(e, TransactionTimedOut)
                            for e in (txn.error, self._pipe.txn_error))
            new_epoch = self._pipe.txn_new_epoch or timed_out
        if new_epoch:
            self._init(deadline)
        else:
            self._end(False, deadline)

    def _init(self, deadline: float) -> None:
        txn = self._txn
        with self._lock:
            fields = txn.init_request()
        try:
            reply = self._txn_call("txn_init", fields, deadline, "init_transactions")
        except KeraError as err:
            with self._lock:
                txn.fail(err)
            raise
        with self._lock:
            txn.on_init(reply)
            self.producer_id = self._acc.producer_id = txn.chunk_producer_id
            self._pipe.new_identity(self.producer_id)

    def _end(self, commit: bool, deadline: float) -> None:
        txn = self._txn
        fields = txn.end_request(commit)
        if fields is not None:
            try:
                self._txn_call("txn_end", fields, deadline,
                               "commit_transaction" if commit else "abort_transaction")
            except KeraError as err:
                if not err.retriable:   # retriable: the same call may be made again
                    with self._lock:
                        txn.fail(err)
                raise
        with self._lock:
            self._pipe.end_transaction()
            txn.ended()

    def _drain(self, deadline: float) -> None:
        """Drop what is unsent, wait until nothing is in flight. Requests are answered or
        expire within request_timeout_s (Pipeline.expire), so this ends by then."""
        aborted = KeraError("the transaction was aborted before this record was sent")
        with self._lock:
            self._pipe.halted = True
            try:
                for st in self._streams.values():
                    self._acc.drop_stream(st, aborted)
                while True:
                    self._pipe.drop_unsent(aborted)
                    if not self._pipe.chunks_in_flight():
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout("abort_transaction: chunks still in flight after its "
                                      "timeout: call abort_transaction again (or "
                                      "init_transactions, whose new epoch fences them)")
                    self._cond.wait(min(left, DRAIN_CHECK_S))
            finally:
                self._pipe.halted = False
                self._wake()   # the request thread settles the dropped records' futures
            self._pipe.take_failures()   # the abort's own drops, and failures it makes moot

    def _txn_call(self, op: str, fields: dict, deadline: float, what: str,
                  final: tuple = ()) -> dict:
        """One coordinator call, retried on retriable errors with a bounded back-off until
        `deadline` (txn_init after ConcurrentTransactions retries as a new instance: its first
        try fenced the transaction it held, so its epoch is no longer the current one).
        Errors of the `final` classes are raised at once: the same fields would be refused
        again (a consumer's stale member epoch: only the consumer can renew it)."""
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            try:
                header, _ = self._meta.call(op, fields, timeout_s=max(
                    COORDINATOR_CALL_MIN_S, min(self.request_timeout_s, left)))
                return header
            except KeraError as err:
                if not err.retriable or isinstance(err, final):
                    raise
                attempt += 1
                pause = txns.retry_backoff_s(attempt)
                if time.monotonic() + pause >= deadline:
                    raise Timeout(f"{what}: not done within its timeout (last answer: "
                                  f"[{err.code}] {err.message}); call it again") from err
                if op == "txn_init" and isinstance(err, ConcurrentTransactions):
                    fields = fields | {"producer_id": -1, "epoch": -1}
                time.sleep(pause)

    def _deadline(self, timeout_s: float | None, default_s: float | None = None) -> float:
        if timeout_s is None:
            timeout_s = self.send_timeout_s if default_s is None else default_s
        return time.monotonic() + timeout_s

    def _transactional(self, what: str) -> TransactionState:
        if self._txn is None:
            raise BadRequest(f"{what} needs a transactional producer: "
                             f"Producer(..., transactional_id='...')")
        return self._txn

    def _check_txn_send(self) -> None:
        """Raise unless a transactional producer may send now (in a transaction that can
        still commit)."""
        txn = self._txn
        err = self._pipe.txn_error
        if err is not None and txn.state == txns.IN_TRANSACTION:
            with self._lock:
                txn.fail(err)
        txn.check_send()

    def _refuse_if_transactional(self, what: str) -> None:
        if self._txn is not None:
            raise BadRequest(f"{what} is not available on a transactional producer: its chunks "
                             f"carry their own identity, outside any transaction")

    # ------------------------------------------------------------------ flush and close
    def flush(self, timeout: float | None = None) -> None:
        """Return once every record sent before this call is acknowledged; raises the failures
        since the last flush (a KeraError naming the stream and streamlet), or Timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._acc.seal_all()
            target = self._pipe.last_serial
            self._shared.idle = False
            self._wake()
            while not self._pipe.done_through(target):
                if self._shared.fatal is not None:
                    raise KeraError(f"producer request thread died: {self._shared.fatal!r}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._undelivered(target, timeout)
                self._cond.wait(left)
            failures = self._pipe.take_failures()
        if failures:
            raise failure_error(failures)

    def _undelivered(self, target: int, timeout: float) -> Undelivered:
        """Under the lock: which streamlets still hold records sent before the flush."""
        counts: dict[tuple[str, int], int] = {}
        for serial, c in self._pipe.incomplete.items():
            if serial > target:
                break  # serial order: the rest were sent after the flush began
            where = (c.lane.stream, c.lane.streamlet)
            counts[where] = counts.get(where, 0) + c.records
        names = ", ".join(f"'{s}' streamlet {sl} ({n})" for (s, sl), n in sorted(counts.items()))
        total = sum(counts.values())
        return Undelivered(f"flush: {total} records still unacknowledged after {timeout:.1f} s: "
                           f"{names}; the rest were stored. Is their broker down? (kera stream "
                           f"describe); flush again to keep retrying", streamlets=counts, records=total)

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the request thread and close the connections."""
        if self._closed:
            return
        try:
            if self._shared.fatal is None:
                self.flush(timeout)
        finally:
            with self._lock:
                self._closed = True
                self._shared.stopping = True
                self._wake()
            self._sender.join(self.request_timeout_s + 5)
            self._meta.close()
            if self._appender is not None:
                self._appender.close()
            with self._lock:
                self._waker.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except KeraError as err:  # do not hide the exception already on its way
            log.warning("producer close after %s: %s", exc_type.__name__, err)

    @property
    def stats(self) -> dict:
        with self._lock:
            s = dict(self._pipe.stats)
            return {
                "records_sent": self._acc.records + self._batch_records,
                "chunks_sent": s.get("chunks_acked", 0) + s.get("chunks_failed", 0)
                + sum(len(lane.chunks) for lane in self._pipe.lanes.values()),
                "requests": s.get("requests", 0),
                "retries": s.get("retries", 0),
                "acked": s.get("records_acked", 0),
                "records_acked": s.get("records_acked", 0),
                "records_failed": s.get("records_failed", 0),
                "chunks_acked": s.get("chunks_acked", 0),
                "chunks_failed": s.get("chunks_failed", 0),
                "reidentified": s.get("reidentified", 0),
                "buffered_bytes": self._acc.open_bytes + self._pipe.pending_bytes,
            }

    # ------------------------------------------------------------------ internals
    def _stream_state(self, name: str) -> StreamState:
        if self._closed:
            raise ClientClosed("producer is closed")
        if not isinstance(name, str):
            raise TypeError(f"stream name must be str, not {type(name).__name__}")
        info = self._meta.stream(name)
        with self._lock:
            st = self._streams.get(name)
            if st is None or st.info.id != info.id:
                st = self._streams[name] = self._acc.stream_state(info)
            return st

    def _grow(self, info) -> None:
        """A refreshed descriptor (request thread): use a raised streamlet count from now on."""
        with self._lock:
            st = self._streams.get(info.name)
            if st is not None and st.info.id == info.id and info.streamlets > st.streamlets:
                log.info("stream '%s' now has %d streamlets (was %d)", info.name,
                         info.streamlets, st.streamlets)
                self._acc.grow(st, info)

    def _wait_for_room(self) -> None:
        """Called under the lock when the buffer is full (or the producer closed)."""
        deadline = time.monotonic() + self.send_timeout_s
        while True:
            if self._closed:
                raise ClientClosed("producer is closed")
            if self._shared.fatal is not None:
                raise KeraError(f"producer request thread died: {self._shared.fatal!r}")
            if self._acc.open_bytes + self._pipe.pending_bytes <= self.buffer_bytes:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"send: buffer of {self.buffer_bytes} bytes still full after "
                              f"{self.send_timeout_s:.1f} s")
            self._acc.seal_all()  # lingering open chunks hold buffer space too
            if self._shared.idle:   # else a wake-up is pending: its turn sends what was sealed
                self._shared.idle = False
                self._wake()
            self._cond.wait(left)

    def _wake(self) -> None:
        self._waker.wake()

    def _stream_gone(self, name: str, stream_id: int, error: KeraError) -> None:
        """Under the lock: the coordinator confirmed the stream was deleted."""
        self._pipe.fail_stream(stream_id, error)
        st = self._streams.get(name)
        if st is not None and st.info.id == stream_id:
            del self._streams[name]
            dropped = self._acc.drop_stream(st, error)
            if dropped:
                self._pipe.stats["records_failed"] += dropped
                self._pipe.failures.append(Failure(name, -1, error, dropped))
        self._meta.forget(name)
        self._cond.notify_all()
