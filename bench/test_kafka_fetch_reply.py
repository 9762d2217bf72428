"""The Kafka listener's Fetch reply, from stored batches to the socket (issue 35): the copies
it used to make against the reply sent by reference.

    python -m pytest bench/test_kafka_fetch_reply.py -q --benchmark-enable

One reply is what a confluent-kafka consumer of 16 partitions gets when it lags (1 MiB per
partition, max.partition.fetch.bytes): 16 partitions of four 256 KiB Kafka batches each (the
kafka-tuned producer's batch.size), read as views of a segment-like mmap. `copying` is the
listener before issue 35: each batch copied with its new base offset (with_offset), each
partition's batches joined, the response written into a BytesIO, copied out of it, then
appended to the connection's bytearray and sent from it (five copies of every record).
`by-reference` is the listener now (kera.broker.kafka.fetch.batch_parts, messages.encode_parts,
connection.Outbox): one join per partition, the reply's parts sent with sendmsg. Both send to
a socket pair drained by a thread; the figure to read is the time per reply (16 MiB), no
assertion on it.
"""

from __future__ import annotations

import io
import mmap
import socket
import struct
import threading

import pytest
from kio.serial import entity_writer

from kera.broker.kafka.connection import SEND_BUFFERS_MAX, Outbox
from kera.broker.kafka.messages import encode_parts, response
from kera.codec import kafka_batch

PARTITIONS = 16
BATCHES_PER_PARTITION = 4
BATCH_BYTES = 256 * 1024
FETCH_KEY, FETCH_VERSION = 1, 12
DRAIN_BYTES = 1 << 20
_SIZE = struct.Struct(">i")


@pytest.fixture(scope="module")
def segment():
    size = PARTITIONS * BATCHES_PER_PARTITION * BATCH_BYTES
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"x" * size)    # touched once: the bench times the reply, not page faults
    view = memoryview(buf)
    return [[view[(p * BATCHES_PER_PARTITION + b) * BATCH_BYTES:][:BATCH_BYTES]
             for b in range(BATCHES_PER_PARTITION)] for p in range(PARTITIONS)]


class Pair:
    """A connected socket pair; a thread reads the far end and counts the bytes."""

    def __init__(self):
        self.near, self.far = socket.socketpair()
        self.got = 0
        self.cond = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        buf = bytearray(DRAIN_BYTES)
        while True:
            n = self.far.recv_into(buf)
            if not n:
                return
            with self.cond:
                self.got += n
                self.cond.notify()

    def wait_for(self, total: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.got >= total, timeout=60.0):
                raise TimeoutError("the drain thread fell behind")


def _data(records: list) -> dict:
    parts = [{"partition_index": i, "error_code": 0, "high_watermark": 0,
              "last_stable_offset": 0, "log_start_offset": 0, "aborted_transactions": None,
              "preferred_read_replica": -1, "records": r} for i, r in enumerate(records)]
    return {"responses": [{"topic": "t", "partitions": parts}], "session_id": 0,
            "error_code": 0}


def _copying(segment, pair: Pair) -> int:
    records = [b"".join(kafka_batch.with_offset(v, i) for i, v in enumerate(views))
               for views in segment]
    entity = response(FETCH_KEY, FETCH_VERSION, _data(records))
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    entity_writer(entity.__header_schema__)(buf, entity.__header_schema__(correlation_id=1))
    entity_writer(type(entity))(buf, entity)
    out = buf.getbuffer()
    _SIZE.pack_into(out, 0, len(out) - 4)
    reply = bytes(out)
    del out
    queue = bytearray()
    queue += reply
    while queue:
        sent = pair.near.send(queue)
        del queue[:sent]
    return len(reply)


def _by_reference(segment, pair: Pair) -> int:
    records = [b"".join(part for i, v in enumerate(views)
                        for part in kafka_batch.offset_parts(v, i)) for views in segment]
    entity = response(FETCH_KEY, FETCH_VERSION, _data(records))
    out = Outbox()
    out.add(encode_parts(1, entity))
    size = len(out)
    while out:
        out.sent(pair.near.sendmsg(out.head(SEND_BUFFERS_MAX)))
    return size


@pytest.mark.parametrize("path", ["copying", "by-reference"])
def test_fetch_reply(benchmark, segment, path):
    pair = Pair()
    send = _copying if path == "copying" else _by_reference
    sent = [0]

    def one_reply():
        sent[0] += send(segment, pair)
        pair.wait_for(sent[0])

    benchmark.pedantic(one_reply, rounds=20, iterations=1, warmup_rounds=2)
    benchmark.extra_info.update(reply_bytes=sent[0] // 22, partitions=PARTITIONS)
