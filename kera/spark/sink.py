"""The kera sink: `df.write.format("kera")` and `df.writeStream.format("kera")`.

Input columns: `value` (binary or string, required), `key` (binary or string, optional: rows
with the same key go to the same streamlet: the stream's partitioner (`kera stream describe`)
of the key mod streamlets, unless option `partitioner` names one: crc32c, or Kafka's murmur2),
`stream` (string,
optional; the `stream` option overrides it), `timestamp` (optional; otherwise every row gets
the time the write was planned) and `headers` (optional, array<struct<key string, value binary
or string>>, kept in order; Kafka's sink column). Other columns are ignored, so rows read from
kera can be written back as they are.

Exactly-once. Each write task is one idempotent producer: its id is a 64-bit hash of (write id,
batch id, partition id) -- for a streaming query the query id from the checkpoint and the
micro-batch id; for a batch write an id drawn when the write is planned (or the `writeId`
option) -- and its chunks carry sequences dense from 0 per (stream, streamlet). The task cuts
its rows into chunks deterministically (kera.spark.chunking), so when Spark runs the task again
(task retry, speculative copy, or a restarted query replaying the batch) it rebuilds the same
chunks with the same identities, and the broker acknowledges the ones it already stored without
storing them twice. Every row is then stored exactly once *provided the task sees the same rows
in the same order on every attempt*: true for kera and other replayable sources and for
deterministic transformations, not for input whose order is not fixed (e.g. rows straight out
of a shuffle without a sort) or non-deterministic expressions (rand(), current_timestamp()).
A task sends its full chunks as it goes; its last, partly filled chunk per lane (at most one
chunk per streamlet, plus one for keyless rows) travels in its commit message and is sent by the
driver when Spark commits the write, because only then is it certain that the task saw all its
rows (see _TaskWriter.run). Rows become visible to readers as soon as their chunk is stored,
before Spark commits the batch (as with Kafka's non-transactional sink).

The chunks travel through the library's engine: one kera.producer.Producer per write task (and
one on the driver for the tails), given each chunk with its own identity (`send_chunk`). It
resends a chunk with the same bytes until acknowledged, follows streamlets that move, retries
through a stream that its brokers do not know yet (just created), and bounds what a task holds
unacknowledged by option `bufferBytes`.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (DataSourceArrowWriter, DataSourceStreamArrowWriter,
                                    WriterCommitMessage)
from pyspark.sql.types import ArrayType, BinaryType, StringType, StructType, TimestampNTZType, TimestampType

from kera.errors import KeraError, Timeout, UnknownStream
from kera.producer.producer import Producer
from kera.spark.chunking import ChunkPlanner
from kera.spark.columns import as_binary, encode_arrow
from kera.spark.metadata import Metadata
from kera.spark.options import Options

log = logging.getLogger(__name__)

QUERY_ID_PROPERTY = "sql.streaming.queryId"     # set by Spark on every task of a streaming query
BATCH_ID_PROPERTY = "streaming.sql.batchId"     # the micro-batch id, likewise
# A task (or the driver's commit) fails when its chunks are not all acknowledged within this
# many request timeouts (option timeoutMs) of its final flush, or when its buffer stays full as
# long: room for a broker failover (detected, then recovered, within a few timeouts) without
# hanging on a cluster that is down.
STALL_TIMEOUTS = 3


def producer_id(write_id: str, batch_id: str, partition_id: int) -> int:
    """A 64-bit producer id, the same on every attempt of the same task."""
    digest = hashlib.blake2b(f"kera-spark\0{write_id}\0{batch_id}\0{partition_id}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


@dataclass
class KeraCommitMessage(WriterCommitMessage):
    partition_id: int
    producer_id: int
    rows: int
    chunks: int
    # The task's last, partly filled chunk of each lane: (stream, stream id, streamlet, seq,
    # chunk). Sent by the driver's commit, once Spark knows every task saw all its rows.
    tails: list


def send_tails(opts: Options, messages) -> int:
    """Store the tail chunks of every task (driver side, at commit). Returns how many."""
    tails = [(m.producer_id, *t) for m in messages if m is not None for t in m.tails]
    if not tails:
        return 0
    producer = open_producer(opts)
    try:
        for _, stream, sid, _, _, chunk in sorted(tails, key=lambda t: t[:5]):
            if producer.stream_info(stream).id != sid:
                raise UnknownStream(f"stream {stream!r} was deleted and created again during the "
                                    f"write; its rows cannot be committed: run the write again")
            producer.send_chunk(stream, chunk)
        flush_chunks(producer, opts, f"the commit of {len(tails)} tail chunks")
    finally:
        close_quietly(producer)
    return len(tails)


def open_producer(opts: Options) -> Producer:
    """The engine that sends a task's chunks (each given with its own identity)."""
    return Producer(opts.bootstrap, chunk_size_bytes=opts.chunk_size_bytes,
                    request_size_bytes=opts.request_size_bytes,
                    in_flight_per_broker=opts.in_flight_per_broker, buffer_bytes=opts.buffer_bytes,
                    request_timeout_s=opts.timeout_s, send_timeout_s=STALL_TIMEOUTS * opts.timeout_s,
                    key_file=opts.key_file)


def flush_chunks(producer: Producer, opts: Options, what: str) -> None:
    """Wait until every chunk sent is acknowledged; a KeraError of the same class naming `what`
    and the streamlets (Producer.flush's message) when one failed or time ran out."""
    try:
        producer.flush(STALL_TIMEOUTS * opts.timeout_s)
    except KeraError as err:
        raise with_context(err, f"the kera sink could not store {what}", opts)


def with_context(err: KeraError, what: str, opts: Options) -> KeraError:
    """`err` itself (class and fields kept), its message prefixed with what failed and where."""
    hint = " (if the cluster is only slow, raise option 'timeoutMs')" if isinstance(err, Timeout) else ""
    err.args = (f"{what} on {opts.bootstrap}{hint}: {err}",)
    return err


def close_quietly(producer: Producer) -> None:
    """Close without waiting: after a successful flush nothing is pending; after a failure the
    task fails anyway and its retry resends the same chunks."""
    try:
        producer.close(timeout=0)
    except KeraError as err:
        log.info("kera sink: closing the producer dropped unacknowledged chunks: %s", err)


def check_schema(schema: StructType, opts: Options) -> None:
    fields = {f.name: f.dataType for f in schema.fields}
    if "value" not in fields:
        raise ValueError(f"the kera sink needs a 'value' column (binary or string); got {schema.simpleString()}")
    for name, kinds in (("value", (BinaryType, StringType)), ("key", (BinaryType, StringType)),
                        ("stream", (StringType,)), ("timestamp", (TimestampType, TimestampNTZType))):
        if name in fields and not isinstance(fields[name], kinds):
            raise ValueError(f"column '{name}' must be {' or '.join(k.typeName() for k in kinds)}, "
                             f"not {fields[name].simpleString()}")
    if "headers" in fields and not _is_headers_type(fields["headers"]):
        raise ValueError(f"column 'headers' must be array<struct<key: string, value: binary>> "
                         f"(value may be string), not {fields['headers'].simpleString()}")
    if len(opts.streams) > 1:
        raise ValueError("the kera sink writes to one stream per row: give one name in option "
                         "'stream', or a 'stream' column")
    if not opts.streams and "stream" not in fields:
        raise ValueError("the kera sink needs option 'stream' or a 'stream' column")


def _is_headers_type(kind) -> bool:
    if not isinstance(kind, ArrayType) or not isinstance(kind.elementType, StructType):
        return False
    inner = {f.name: f.dataType for f in kind.elementType.fields}
    return set(inner) == {"key", "value"} and isinstance(inner["key"], StringType) and \
        isinstance(inner["value"], (BinaryType, StringType))


def check_streams_exist(opts: Options) -> None:
    """The streams named in option 'stream' exist: checked when Spark plans the write, so a
    missing stream fails there in one line, not in every task attempt with the reason buried.
    (Names in a 'stream' column are only known to the tasks.)"""
    if not opts.streams:
        return
    meta = Metadata(opts.bootstrap, opts.timeout_s, opts.key_file)
    try:
        for stream in opts.streams:
            try:
                meta.describe(stream)
            except UnknownStream:
                raise UnknownStream(f"the kera sink cannot write to stream {stream!r}: it does not "
                                    f"exist on {opts.bootstrap}; create it first (kera stream "
                                    f"create {stream} --bootstrap {opts.bootstrap})") from None
    finally:
        meta.close()


class _TaskWriter:
    """One write task: rows -> chunks -> acknowledged."""

    def __init__(self, opts: Options, pid: int, partition_id: int, timestamp_us: int):
        self.opts = opts
        self.pid = pid
        self.partition_id = partition_id
        self.timestamp_us = timestamp_us
        self.producer: Producer | None = None   # opened by run, which closes it
        self.planners: dict[str, ChunkPlanner] = {}
        self.seqs: dict[tuple[int, int], int] = {}
        self.rows = 0
        self.chunks = 0

    def run(self, batches: Iterator[pa.RecordBatch]) -> KeraCommitMessage:
        """Send every full chunk; return the partly filled ones for the driver to send.

        The tails wait for the commit because an ended iterator does not prove the task saw
        all its rows: when an upstream operator fails, Spark may end the input early and
        cleanly. A tail cut from such a truncated input would take the sequence the complete
        re-run gives a fuller chunk, which the broker would then drop as a duplicate."""
        self.producer = open_producer(self.opts)
        try:
            for batch in batches:
                self.add(batch)
            tails = []
            for stream in sorted(self.planners):
                info = self.producer.stream_info(stream)
                for c, seq, chunk in self._encode(stream, self.planners[stream].flush()):
                    tails.append((stream, info.id, c.streamlet, seq, chunk))
            flush_chunks(self.producer, self.opts,
                         f"the {self.chunks - len(tails)} full chunks of write task {self.partition_id}")
        finally:
            close_quietly(self.producer)
        return KeraCommitMessage(self.partition_id, self.pid, self.rows, self.chunks, tails)

    def add(self, batch: pa.RecordBatch) -> None:
        n = batch.num_rows
        if n == 0:
            return
        names = batch.schema.names
        values = as_binary(batch.column(names.index("value")))
        if values.null_count:
            raise ValueError("the kera sink cannot store a null 'value'")
        keys = as_binary(batch.column(names.index("key"))) if "key" in names else None
        ts = self._timestamps(batch.column(names.index("timestamp")) if "timestamp" in names else None, n)
        headers = batch.column(names.index("headers")) if "headers" in names else None
        self.rows += n
        if self.opts.streams:
            self._add(self.opts.streams[0], values, keys, ts, headers)
            return
        streams = batch.column(names.index("stream"))
        if streams.null_count:
            raise ValueError("the 'stream' column may not be null")
        encoded = pc.dictionary_encode(streams)
        indices = encoded.indices.to_numpy(zero_copy_only=False)
        names_in_batch = encoded.dictionary.to_pylist()
        if len(names_in_batch) == 1:
            self._add(names_in_batch[0], values, keys, ts, headers)
            return
        for i, stream in enumerate(names_in_batch):
            mask = indices == i
            sel = pa.array(mask)
            self._add(stream, values.filter(sel), None if keys is None else keys.filter(sel), ts[mask],
                      None if headers is None else headers.filter(sel))

    def _timestamps(self, column, n: int) -> np.ndarray:
        """int64 µs since the epoch (a naive timestamp is taken as UTC)."""
        if column is None:
            return np.full(n, self.timestamp_us, dtype=np.int64)
        if column.type.unit != "us":
            column = column.cast(pa.timestamp("us", tz=column.type.tz))
        return column.cast(pa.int64()).fill_null(self.timestamp_us).to_numpy(zero_copy_only=False)

    def _add(self, stream: str, values, keys, ts, headers) -> None:
        planner = self.planners.get(stream)
        if planner is None:
            info = self.producer.stream_info(stream)
            planner = self.planners[stream] = ChunkPlanner(info.streamlets, self.opts.chunk_size_bytes,
                                                           keyless_seed=self.partition_id,
                                                           partitioner=self.opts.partitioner
                                                           or info.partitioner)
        self._send(stream, planner.add(values, keys, ts, headers))

    def _send(self, stream: str, planned) -> None:
        try:
            for _, _, chunk in self._encode(stream, planned):
                self.producer.send_chunk(stream, chunk)
        except KeraError as err:  # the buffer stayed full: no chunk acknowledged for long
            raise with_context(err, f"write task {self.partition_id} could not send to stream "
                                    f"{stream!r}", self.opts)

    def _encode(self, stream: str, planned):
        """(planned chunk, sequence, bytes): sequences dense from 0 per (stream, streamlet)."""
        if not planned:
            return
        info = self.producer.stream_info(stream)
        for c in planned:
            key = (info.id, c.streamlet)
            seq = self.seqs.get(key, 0)
            self.seqs[key] = seq + 1
            self.chunks += 1
            yield c, seq, encode_arrow(self.pid, seq, info.id, c.streamlet, c.values, c.keys,
                                       c.timestamps, c.headers)


def _task_context():
    from pyspark import TaskContext
    return TaskContext.get()


class KeraBatchWriter(DataSourceArrowWriter):
    def __init__(self, opts: Options, schema: StructType):
        check_schema(schema, opts)
        check_streams_exist(opts)
        self.opts = opts
        # Drawn once on the driver: every attempt of every task of this write shares it.
        self.write_id = opts.write_id or uuid.uuid4().hex
        self.timestamp_us = time.time_ns() // 1000

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KeraCommitMessage:
        ctx = _task_context()
        partition_id = ctx.partitionId() if ctx is not None else 0
        pid = producer_id(self.write_id, "batch", partition_id)
        return _TaskWriter(self.opts, pid, partition_id, self.timestamp_us).run(iterator)

    def commit(self, messages) -> None:
        done = [m for m in messages if m is not None]
        tails = send_tails(self.opts, done)
        log.info("kera write %s stored %d rows in %d chunks (%d at commit) from %d tasks",
                 self.write_id, sum(m.rows for m in done), sum(m.chunks for m in done), tails, len(done))

    def abort(self, messages) -> None:
        log.warning("kera write %s aborted; the full chunks its tasks sent stay stored", self.write_id)


class KeraStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, opts: Options, schema: StructType):
        check_schema(schema, opts)
        check_streams_exist(opts)
        self.opts = opts
        # Created on the driver once per micro-batch: task retries share the timestamp.
        self.timestamp_us = time.time_ns() // 1000
        self.fallback_id = uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KeraCommitMessage:
        ctx = _task_context()
        partition_id = ctx.partitionId() if ctx is not None else 0
        query_id = (ctx.getLocalProperty(QUERY_ID_PROPERTY) if ctx is not None else None) or self.fallback_id
        batch_id = (ctx.getLocalProperty(BATCH_ID_PROPERTY) if ctx is not None else None) or "0"
        pid = producer_id(query_id, batch_id, partition_id)
        return _TaskWriter(self.opts, pid, partition_id, self.timestamp_us).run(iterator)

    def commit(self, messages, batchId: int) -> None:
        done = [m for m in messages if m is not None]
        tails = send_tails(self.opts, done)
        log.info("kera micro-batch %d stored %d rows in %d chunks (%d at commit)", batchId,
                 sum(m.rows for m in done), sum(m.chunks for m in done), tails)

    def abort(self, messages, batchId: int) -> None:
        log.warning("kera micro-batch %d aborted; the full chunks its tasks sent stay stored "
                    "and a re-run of the batch will not store them again", batchId)
