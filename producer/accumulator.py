"""The source side of the producer: records accumulate in one open chunk per streamlet. Sans-IO.

`append` is the hot path of `Producer.send` (about a microsecond: a few list appends). A chunk
that fills up is sealed (encoded, its sequence taken from its lane) and queued in the
Pipeline; the request thread seals chunks that have been open longer than `linger_ms`.
Keyless records go to a *sticky* streamlet that moves round-robin each time its chunk seals,
so they fill whole chunks instead of spreading thin over every streamlet.

Not thread-safe: the Producer calls everything here under its lock.
"""

from __future__ import annotations

import time
from typing import Callable

from kera.codec import chunk as chunkcodec
from kera.codec.partitioner import KeyHash, key_hash as partitioner_hash
from kera.errors import RecordTooLarge
from kera.client.metadata import StreamInfo
from kera.producer.pipeline import Lane, Pipeline

OPENED, SEALED = 1, 2
# Bytes a record costs in a chunk besides its value: timestamp (8) and value offset (4); a keyed
# record also has a key offset (4) and a null flag (1).
RECORD_OVERHEAD_BYTES = 12
KEYED_OVERHEAD_BYTES = 17
# A header costs its key and value bytes plus two offsets (8); a record with headers one index entry (4).
HEADER_OVERHEAD_BYTES = 8
HEADERS_INDEX_BYTES = 4


def _wall_clock_us() -> int:
    return time.time_ns() // 1000


# What a RecordTooLarge tells the caller to do.
RAISE_HINT = (f"send a smaller record, or raise the Producer's max_record_bytes (at most "
              f"{chunkcodec.MAX_CHUNK_BYTES - chunkcodec.HEADER_SIZE}, a chunk's limit less its "
              f"header; a stream's segment size bounds it too)")


class OpenChunk:
    __slots__ = ("stream", "streamlet", "values", "keys", "timestamps", "nbytes", "keyed", "opened_at",
                 "headers", "tombstones", "futures")

    def __init__(self, stream: "StreamState", streamlet: int, opened_at: float):
        self.stream = stream
        self.streamlet = streamlet
        self.values: list = []
        self.keys: list = []
        self.timestamps: list = []
        self.nbytes = 0
        self.keyed = False
        self.opened_at = opened_at
        self.headers: list | None = None  # one list per record once any record has headers
        self.tombstones = False
        self.futures: list | None = None  # (index, 1, DeliveryFuture) of records sent with one


def header_bytes(headers) -> int:
    """Bytes a record's (non-empty) headers take in a chunk body."""
    return HEADERS_INDEX_BYTES + sum(len(k.encode()) + len(v) + HEADER_OVERHEAD_BYTES
                                     for k, v in headers)


class StreamState:
    """What the source side keeps per stream: its descriptor, open chunks and lanes."""

    __slots__ = ("name", "info", "streamlets", "sticky", "open", "lanes", "key_hash")

    def __init__(self, info: StreamInfo, lanes: list[Lane], key_hash: KeyHash):
        self.name = info.name
        self.key_hash = key_hash   # places keyed records (kera.codec.partitioner)
        self.info = info
        self.streamlets = info.streamlets
        self.sticky = 0
        self.open: list[OpenChunk | None] = [None] * info.streamlets
        self.lanes = lanes


class Accumulator:
    def __init__(self, pipeline: Pipeline, producer_id: int, *, chunk_size_bytes: int,
                 max_record_bytes: int, linger_s: float, clock: Callable[[], float] = time.monotonic,
                 wall_clock_us: Callable[[], int] = _wall_clock_us, compression: str | None = None,
                 key_hash: KeyHash | None = None):
        if chunk_size_bytes <= chunkcodec.HEADER_SIZE + 64:
            raise ValueError(f"chunk_size_bytes={chunk_size_bytes} is too small")
        self.pipeline = pipeline
        self.producer_id = producer_id
        self.chunk_size_bytes = chunk_size_bytes
        # Room for records in a chunk: the header and the extra (n+1-th) value and key offsets
        # excluded (the key one only exists with keys, but which chunk gets keys is not known
        # when it opens; without it a keyed chunk could overrun chunk_size_bytes by 4).
        self.capacity = chunk_size_bytes - chunkcodec.HEADER_SIZE - 8
        self.max_record_bytes = max_record_bytes
        self.linger_s = linger_s
        self.clock = clock
        self.now_us = wall_clock_us
        self.compression = compression
        # Places keyed records (kera.codec.partitioner); None: each stream's own partitioner.
        self.key_hash = key_hash
        self.open_bytes = 0
        self.records = 0
        # Open chunks in the order they were opened: the linger check scans only the front.
        self._open: dict[OpenChunk, None] = {}

    def stream_state(self, info: StreamInfo) -> StreamState:
        lanes = [self.pipeline.own_lane(info.name, info.id, sl, self.producer_id, info.active_groups)
                 for sl in range(info.streamlets)]
        return StreamState(info, lanes, self.key_hash or partitioner_hash(info.partitioner))

    def grow(self, st: StreamState, info: StreamInfo) -> None:
        """The stream's streamlet count was raised: lanes and chunk slots for the new ones.
        Keys now map over the larger count (records of a key go to a new streamlet from
        here on, as in Kafka after partitions are added)."""
        st.lanes += [self.pipeline.own_lane(info.name, info.id, sl, self.producer_id,
                                            info.active_groups)
                     for sl in range(st.streamlets, info.streamlets)]
        st.open += [None] * (info.streamlets - st.streamlets)
        st.info = info
        st.streamlets = info.streamlets

    # ------------------------------------------------------------------ hot path
    def append(self, st: StreamState, value: bytes | None, key: bytes | None, timestamp: int | None,
               headers: list | None = None, streamlet: int | None = None, future=None) -> int:
        """Add one record (a None value is a tombstone; `streamlet` overrides the key's
        placement); returns 0, OPENED or SEALED (the request thread may need waking)."""
        value_bytes = 0 if value is None else len(value)
        record_bytes = value_bytes if key is None else value_bytes + len(key)
        if headers:
            record_bytes += header_bytes(headers)
        size = record_bytes + (RECORD_OVERHEAD_BYTES if key is None else KEYED_OVERHEAD_BYTES)
        if streamlet is not None:
            sl = streamlet
        elif key is None:
            sl = st.sticky
        else:
            sl = st.key_hash(key) % st.streamlets
        oc = st.open[sl]
        event = 0
        if oc is None or oc.nbytes + size > self.capacity:
            oc, event = self._room(st, sl, key is None and streamlet is None, size, record_bytes)
        if future is not None:
            if oc.futures is None:
                oc.futures = []
            oc.futures.append((len(oc.values), 1, future))
        self._add(oc, value, key, timestamp, headers)
        oc.nbytes += size
        self.open_bytes += size
        if oc.nbytes >= self.capacity:  # exactly full, or one record too large for a chunk
            self.seal(oc)
            event = SEALED
        return event

    def _add(self, oc: OpenChunk, value, key, timestamp, headers) -> None:
        if headers and oc.headers is None:
            oc.headers = [None] * len(oc.values)
        if oc.headers is not None:
            oc.headers.append(headers)
        oc.values.append(value)
        oc.keys.append(key)
        oc.timestamps.append(self.now_us() if timestamp is None else timestamp)
        self.records += 1
        if key is not None:
            oc.keyed = True
        if value is None:
            oc.tombstones = True

    def _room(self, st: StreamState, sl: int, sticky: bool, size: int, record_bytes: int
              ) -> tuple[OpenChunk, int]:
        """An open chunk with room for a record of `size` bytes (sealing full ones)."""
        if record_bytes > self.max_record_bytes:
            raise RecordTooLarge(f"record of {record_bytes} bytes exceeds max_record_bytes="
                                 f"{self.max_record_bytes}: {RAISE_HINT}")
        event = OPENED
        oc = st.open[sl]
        if oc is not None:
            self.seal(oc)
            event = SEALED
            if sticky:  # the sticky streamlet moved on: follow it
                sl = st.sticky
                oc = st.open[sl]
                if oc is not None and oc.nbytes + size > self.capacity:
                    self.seal(oc, advance=False)
                elif oc is not None:
                    return oc, event
        oc = st.open[sl] = OpenChunk(st, sl, self.clock())
        self._open[oc] = None
        return oc, event

    # ------------------------------------------------------------------ sealing
    def seal(self, oc: OpenChunk, advance: bool = True) -> None:
        """Encode an open chunk and queue it in its lane; moves the sticky streamlet on."""
        st, sl = oc.stream, oc.streamlet
        assert st.open[sl] is oc
        st.open[sl] = None
        del self._open[oc]
        self.open_bytes -= oc.nbytes
        if advance and sl == st.sticky:
            st.sticky = (sl + 1) % st.streamlets
        lane = st.lanes[sl]
        keys = oc.keys if oc.keyed else None
        if oc.tombstones or oc.headers is not None or self.compression is not None:
            data = chunkcodec.encode(lane.producer_id, lane.wire_sequence, st.info.id, sl, oc.values,
                                     keys, oc.timestamps, oc.headers, self.compression)
        else:  # the common plain chunk: no per-record scan for tombstones
            blob, offsets = chunkcodec.values_columns(oc.values)
            data = chunkcodec.encode_columns(lane.producer_id, lane.wire_sequence, st.info.id, sl,
                                             blob, offsets, keys, oc.timestamps)
        self.pipeline.add(lane, data, lane.next_sequence, len(oc.values), oc.futures)

    def seal_streamlet(self, st: StreamState, sl: int) -> None:
        """Seal the open chunk of a streamlet, if any (before a batch chunk goes after it)."""
        oc = st.open[sl]
        if oc is not None:
            self.seal(oc, advance=False)

    def seal_lingering(self, now: float) -> int:
        """Seal every chunk open for `linger_s` or longer; returns how many."""
        due = []
        for oc in self._open:
            if oc.opened_at + self.linger_s > now:
                break
            due.append(oc)
        for oc in due:
            self.seal(oc)
        return len(due)

    def seal_all(self) -> int:
        due = list(self._open)
        for oc in due:
            self.seal(oc)
        return len(due)

    def next_linger_deadline(self) -> float | None:
        for oc in self._open:
            return oc.opened_at + self.linger_s
        return None

    def drop_stream(self, st: StreamState, error=None) -> int:
        """Discard a stream's open chunks (the stream is gone); returns the records dropped.
        Their delivery futures fail with `error`."""
        dropped = 0
        for sl, oc in enumerate(st.open):
            if oc is not None:
                st.open[sl] = None
                del self._open[oc]
                self.open_bytes -= oc.nbytes
                dropped += len(oc.values)
                if oc.futures:
                    self.pipeline.settled.append((oc.futures, st.name, sl, None, error))
        return dropped
