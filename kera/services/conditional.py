"""Conditional appends: Waltz's optimistic locking on a kera stream.

A service keeps its state by applying a stream's records in number order (kera.broker.streamlet
numbers each streamlet's records densely from 0). Its *high-water mark* is the number of the
last record it applied (-1 for none). To write, it names the *locks* its transaction depends on
(row ids, account ids: ints, strings or bytes) and appends with its high-water mark:

    with ConditionalAppender("127.0.0.1:7000") as log:
        md = log.append("accounts", [b"debit 7 by 10"], locks=["account-7"],
                        high_water_mark=41, streamlet=0)
        md.number     # the record number of the first record appended

The broker owning the streamlet appends it only if no record carrying one of those locks was
appended after the mark, atomically with the append; otherwise it stores nothing and the call
raises LockConflict naming the lock and the number that wrote it: read on to that number,
re-execute the transaction against the new state, append again. A retry after a timeout or a
failover is never stored twice (each append is its own idempotent producer, sequence 0), and
the lock table survives failover (rebuilt from the replicated records).

The unit of numbering and locking is the streamlet, so the stream must have one active group
per streamlet (`active_groups=1`, the default). One call appends its records as one chunk.
"""

from __future__ import annotations

import hashlib
import threading
import time

from kera.codec import chunk as chunkcodec
from kera.net import rpc
from kera.net.backoff import Backoff
from kera.codec import schema, wire
from kera.errors import KeraError, LockConflict, Timeout
from kera.client.metadata import Metadata
from kera.codec.partitioner import KeyHash, key_hash as partitioner_hash, streamlet_for_key
from kera.producer.delivery import RecordMetadata
from kera.producer.producer import new_producer_id

DEFAULT_APPEND_TIMEOUT_S = 30.0   # one append, retries across a failover included
# Attempts of one append: a broker failover takes a few (not_ready while recovering, not_owner
# until the new placement is known), each after a backoff that doubles up to a second.
APPEND_ATTEMPTS_MAX = 100
RETRY_BACKOFF = Backoff(first_ms=50, max_ms=1000)
# While an append waits for its reply, how often the writer asks whether its streamlet moved: a
# broker killed mid-request never answers, and its failover (~2-3 s) ends long before the
# request timeout (10 s), after which the append goes to the new owner at once.
OWNER_CHECK_S = 0.5


def lock_id(lock: int | str | bytes) -> int:
    """The 64-bit id a lock travels as: an int as itself, a str or bytes by a stable hash."""
    if isinstance(lock, bool):
        raise TypeError("a lock is an int, str or bytes, not a bool")
    if isinstance(lock, int):
        if not 0 <= lock < 1 << 64:
            raise ValueError(f"integer lock {lock} is outside 0..2**64-1")
        return lock
    if isinstance(lock, str):
        lock = lock.encode()
    if not isinstance(lock, (bytes, bytearray)):
        raise TypeError(f"a lock is an int, str or bytes, not {type(lock).__name__}")
    return int.from_bytes(hashlib.blake2b(bytes(lock), digest_size=8).digest(), "little")


class ConditionalAppender:
    """Conditional appends from the calling thread (thread-safe: one call at a time)."""

    def __init__(self, bootstrap: str, *, timeout_s: float = DEFAULT_APPEND_TIMEOUT_S,
                 key_file: str | None = None, request_timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
                 key_hash: KeyHash | None = None):
        self.timeout_s = timeout_s
        self.key_hash = key_hash   # places `key` (kera.codec.partitioner); None: the stream's own
        self.request_timeout_s = request_timeout_s
        self.key_file = key_file
        self._meta = Metadata(bootstrap, timeout_s=request_timeout_s, key_file=key_file)
        self._conns: dict[str, rpc.Connection] = {}
        self._lock = threading.Lock()
        self.conflicts = 0
        self.appended = 0

    def append(self, stream: str, values, *, locks=(), high_water_mark: int = -1,
               keys=None, headers=None, streamlet: int | None = None,
               key: bytes | None = None) -> RecordMetadata:
        """Append `values` (one chunk) to `streamlet` (or the streamlet of `key`; 0 when
        neither is given) if none of `locks` was written after `high_water_mark`. Returns the
        RecordMetadata (its `number` is the first record's); raises LockConflict (nothing
        stored), or Timeout when no broker took it within `timeout_s`."""
        if high_water_mark < -1:
            raise ValueError(f"high_water_mark={high_water_mark}: -1 (nothing applied) or a record number")
        ids = {lock_id(lock): lock for lock in locks}
        with self._lock:
            info = self._meta.stream(stream)
            sl = self._streamlet(info, streamlet, key)
            data = chunkcodec.encode(new_producer_id(), 0, info.id, sl, list(values), keys,
                                     headers=headers, condition=(list(ids), high_water_mark))
            try:
                result = self._send(stream, sl, data)
            except LockConflict as err:
                self.conflicts += 1
                err.lock = ids.get(err.lock, err.lock)   # the caller's own lock object
                raise
            self.appended += 1
        return RecordMetadata(stream, sl, result[0], result[2], len(values),
                              result[3] if len(result) > 3 else None)

    def _streamlet(self, info, streamlet: int | None, key: bytes | None) -> int:
        if streamlet is None and key is not None:
            streamlet = streamlet_for_key(key, info.streamlets,
                                          self.key_hash or partitioner_hash(info.partitioner))
        elif streamlet is None:
            streamlet = 0
        if not 0 <= streamlet < info.streamlets:
            raise ValueError(f"streamlet {streamlet} of {info.name!r}, which has {info.streamlets}")
        if info.active_groups != 1:
            raise ValueError(f"conditional appends need one active group per streamlet; "
                             f"{info.name!r} has {info.active_groups}")
        return streamlet

    def _send(self, stream: str, sl: int, data: bytes) -> tuple:
        """Send until a definite answer: stored (its result) or refused for good (raised)."""
        deadline = time.monotonic() + self.timeout_s
        last: KeraError | None = None
        for attempt in range(1, APPEND_ATTEMPTS_MAX + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return self._attempt(stream, sl, data, min(left, self.request_timeout_s))
            except KeraError as err:
                if not err.retriable:
                    raise
                last = err
            time.sleep(min(RETRY_BACKOFF.delay_s(attempt), max(0.0, deadline - time.monotonic())))
            last = self._refresh(stream) or last
        raise Timeout(f"conditional append to {stream!r} streamlet {sl} not stored within "
                      f"{self.timeout_s} s (last error: {last})")

    def _refresh(self, stream: str) -> KeraError | None:
        """Ask for the stream's placement again; a retriable failure (the coordinator failing
        over) is returned for the next attempt to go on from, not raised."""
        try:
            self._meta.refresh(stream)
        except KeraError as err:
            if not err.retriable:
                raise
            return err
        return None

    def _attempt(self, stream: str, sl: int, data: bytes, timeout_s: float) -> tuple:
        address = self._meta.stream(stream).owner(sl)
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = rpc.Connection(address, timeout_s=timeout_s,
                                                         key_file=self.key_file)
        moved = lambda: self._moved(stream, sl, address)   # noqa: E731
        try:
            req_id = _in_slices(lambda t: conn.send("produce", {}, [data], t), timeout_s, moved)
            header = _in_slices(lambda t: _reply_to(conn, req_id, t), timeout_s, moved)
        except KeraError:
            self._conns.pop(address).close()   # a late reply must not answer the next call
            raise
        wire.raise_for_reply(header)
        results = header.get("results")
        if not isinstance(results, list) or len(results) != 1:
            raise KeraError(f"malformed produce reply from {address}", retriable=True)
        out = schema.produce_result(results[0])
        if isinstance(out, KeraError):
            raise out
        if out is None:   # only a retry of an older chunk gets it; this sends one at a time
            raise KeraError(f"produce reply from {address} gives no position for the chunk "
                            f"just sent", retriable=False)
        return out

    def _moved(self, stream: str, sl: int, address: str) -> bool:
        """Whether the coordinator now places streamlet `sl` elsewhere (False when it cannot
        say: the wait goes on)."""
        try:
            return self._meta.refresh(stream).owner(sl) != address
        except KeraError as err:
            if not err.retriable:
                raise
            return False

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._meta.close()

    def __enter__(self) -> "ConditionalAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_slices(step, timeout_s: float, moved):
    """`step(slice_s)` (a send or a wait for a reply) tried in slices of OWNER_CHECK_S until it
    returns or `timeout_s` passes (Timeout); a retriable KeraError as soon as `moved()` says
    the streamlet has another owner: the append is idempotent, so sending it there is safe."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no answer within {timeout_s:.1f} s")
        try:
            return step(min(left, OWNER_CHECK_S))
        except Timeout:
            if moved():
                raise KeraError("the streamlet moved to another broker while an append waited "
                                "for its owner", retriable=True) from None


def _reply_to(conn: rpc.Connection, req_id: int, timeout_s: float) -> dict:
    """The reply header to `req_id` (earlier requests' late replies dropped), or Timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        header, _ = conn.recv(max(0.0, deadline - time.monotonic()))
        if header.get("id") == req_id:
            return header
