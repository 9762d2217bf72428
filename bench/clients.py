"""The two systems' clients behind one small interface, used inside the worker processes.

Producer side: `send(stream_index, values)` hands one send unit (a 2-D uint8 array of
`records_per_chunk` stamped records: one chunk's worth) to the client; `acked()` counts records
the system acknowledged (acks=all / R copies); `flush()` waits for everything.
Consumer side: `poll()` returns the send-time stamps (µs) of the records that arrived, as a
numpy int64 array; `close()` stops.

Each system is driven through its best batch API: kera's `send_batch` (one call per chunk) and
`poll_batch` (whole chunks, columnar); confluent-kafka has no columnar API, so records go through
`produce_batch` (one dict per record, one call per chunk's worth) and `consume` (one message
object per record).
"""

from __future__ import annotations

import time

import numpy as np

from .latency import stamps_from_blob, stamps_from_values
from .workload import Workload

KAFKA_CONSUME_MAX_MESSAGES = 10_000
KAFKA_QUEUE_FULL_POLL_S = 0.005
IDLE_SLEEP_S = 0.001              # both consumers sleep this long when nothing had arrived


def stream_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:04d}"


# ---------------------------------------------------------------------- kera

def kera_producer_settings(w: Workload) -> dict:
    return {"chunk_size_bytes": w.chunk_size_bytes, "linger_ms": w.linger_ms,
            "buffer_bytes": w.producer_buffer_bytes,
            "compression": None if w.compression == "none" else w.compression}


class KeraProducerClient:
    def __init__(self, bootstrap: str, prefix: str, w: Workload):
        from kera.producer import Producer

        self.p = Producer(bootstrap, **kera_producer_settings(w))
        self.prefix = prefix
        self.names: dict[int, str] = {}
        # One header list per record of a send unit (send_batch takes them per record).
        self.headers = [w.record_headers] * w.records_per_chunk if w.headers else None

    def send(self, stream: int, values: np.ndarray) -> None:
        name = self.names.get(stream) or self.names.setdefault(stream, stream_name(self.prefix, stream))
        self.p.send_batch(name, values, headers=self.headers)

    def acked(self) -> int:
        return self.p.stats["records_acked"]

    def failed(self) -> int:
        return self.p.stats["records_failed"]

    def flush(self, timeout_s: float) -> None:
        self.p.flush(timeout_s)

    def close(self) -> None:
        self.p.close(timeout=30.0)


class KeraConsumerClient:
    """One kera Consumer for every stream this process reads: one request thread and one
    connection per broker whatever the number of streams (issue 11), assigned exactly the
    (stream, streamlet) parts the workload gives this client."""

    def __init__(self, bootstrap: str, prefix: str, w: Workload, partitions: dict[int, list[int]]):
        from kera.consumer import Consumer

        names = [stream_name(prefix, s) for s in sorted(partitions)]
        self.consumer = Consumer(bootstrap, names, start="earliest", streamlets=[])
        try:
            self.consumer.assign([(stream_name(prefix, s), sl)
                                  for s, streamlets in sorted(partitions.items())
                                  for sl in streamlets])
        except BaseException:
            self.close()
            raise

    def poll(self) -> np.ndarray | None:
        """Stamps of every chunk ready now; None if there was none."""
        parts = [stamps_from_blob(batch.values_blob, batch.value_offsets)
                 for batch in self.consumer.poll_batch(timeout_s=0)]
        if not parts:
            time.sleep(IDLE_SLEEP_S)
            return None
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        self.consumer.close()


# ---------------------------------------------------------------------- Kafka

# `kafka-tuned`: Kafka's producer tuned for throughput (Kafka's and Confluent's advice: batches of
# 100-200 kB or more, linger 5-100 ms, a bigger buffer), the same for the Python and Java clients.
# Compression stays the workload's (the records are random bytes); in-flight requests stay 5,
# the most idempotence (acks=all without duplicates) allows.
TUNED_BATCH_BYTES = 256 * 1024        # under the 1 MB max.request.size / message.max.bytes
TUNED_LINGER_MS = 20.0                # the top of the 5-20 ms range: fuller batches
TUNED_BUFFER_BYTES = 64 * 1024 * 1024  # twice the Java client's default buffer.memory


def kafka_tuned_producer(w: Workload) -> dict:
    """Batch size, linger and buffer of the tuned Kafka producer for `w` (never below w's)."""
    return {"batch_size_bytes": max(w.chunk_size_bytes, TUNED_BATCH_BYTES),
            "linger_ms": max(w.linger_ms, TUNED_LINGER_MS),
            "buffer_bytes": max(w.producer_buffer_bytes, TUNED_BUFFER_BYTES)}


def kafka_producer_settings(w: Workload, tuned: bool = False) -> dict:
    """Throughput tuning from Kafka's docs, with kera's chunk size as the batch size; `tuned`:
    the batch size, linger and buffer of `kafka_tuned_producer`."""
    batch, linger, buffer = w.chunk_size_bytes, w.linger_ms, w.producer_buffer_bytes
    if tuned:
        t = kafka_tuned_producer(w)
        batch, linger, buffer = t["batch_size_bytes"], t["linger_ms"], t["buffer_bytes"]
    return {
        "acks": "all",
        "enable.idempotence": True,
        "compression.type": w.compression,
        "linger.ms": linger,
        "batch.size": batch,
        "batch.num.messages": 1_000_000,                 # let batch.size decide
        "queue.buffering.max.kbytes": max(1, buffer // 1024),
        "queue.buffering.max.messages": max(1000, buffer // w.record_size_bytes),
        "delivery.report.only.error": True,              # count acks without a callback each
        "max.in.flight.requests.per.connection": 5,      # the idempotence maximum
    }


def kafka_consumer_settings() -> dict:
    return {
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        "fetch.wait.max.ms": 100,
        # Past queued.min.messages (100k) queued records librdkafka waits fetch.queue.backoff.ms
        # (1000 by default) before it fetches a partition again, and one fetch of a lagging
        # consumer (16 partitions x 1 MiB, ~150k records) is over it: measured, a consumer then
        # read one fetch a second, whatever the system (issue 35). A wait as long as
        # fetch.wait.max.ms keeps the queue from running dry; the same for every system.
        "fetch.queue.backoff.ms": 100,
    }


class KafkaProducerClient:
    """Sends each unit to one partition, rotating over partitions like kera's keyless
    send_batch rotates chunks over streamlets."""

    def __init__(self, bootstrap: str, prefix: str, w: Workload, producer_index: int,
                 tuned: bool = False):
        from confluent_kafka import KafkaError, Producer

        self.queue_full = KafkaError._QUEUE_FULL
        self.p = Producer({"bootstrap.servers": bootstrap, **kafka_producer_settings(w, tuned),
                           "on_delivery": self._on_error})
        self.prefix = prefix
        self.partitions = w.streamlets
        self.record_size = w.record_size_bytes
        self.next_partition: dict[int, int] = {}
        self.start_partition = producer_index
        self.produced = 0
        self.errors = 0
        self.names: dict[int, str] = {}
        self.headers = w.record_headers or None

    def _on_error(self, err, msg) -> None:  # delivery.report.only.error: failures only
        if err is not None:
            self.errors += 1

    def send(self, stream: int, values: np.ndarray) -> None:
        name = self.names.get(stream) or self.names.setdefault(stream, stream_name(self.prefix, stream))
        part = self.next_partition.get(stream, self.start_partition) % self.partitions
        self.next_partition[stream] = part + 1
        blob = values.tobytes()
        size = self.record_size
        n = len(values)
        if self.headers is not None:
            self._produce_each(name, part, blob, n)
            return
        messages = [{"value": blob[i * size:(i + 1) * size]} for i in range(n)]
        while True:
            queued = self.p.produce_batch(name, messages, partition=part)
            if queued == len(messages):
                break
            # The queue (buffer_bytes) is full: the tail that did not fit goes again, in order.
            failed = [m for m in messages if "_error" in m]
            other = next((m["_error"] for m in failed if m["_error"].code() != self.queue_full), None)
            if other is not None:
                raise RuntimeError(f"Kafka produce_batch failed: {other}")
            messages = [{"value": m["value"]} for m in failed]
            self.p.poll(KAFKA_QUEUE_FULL_POLL_S)
        self.produced += n
        self.p.poll(0)

    def _produce_each(self, name: str, part: int, blob: bytes, n: int) -> None:
        """produce() per record: confluent-kafka's produce_batch drops headers silently
        (confluent-kafka-python#2320), so records with headers take the per-record API."""
        size = self.record_size
        for i in range(n):
            while True:
                try:
                    self.p.produce(name, blob[i * size:(i + 1) * size], partition=part,
                                   headers=self.headers)
                    break
                except BufferError:       # the queue (buffer_bytes) is full
                    self.p.poll(KAFKA_QUEUE_FULL_POLL_S)
        self.produced += n
        self.p.poll(0)

    def acked(self) -> int:
        """Records sent and no longer queued nor failed (safe from the sampler thread)."""
        return self.produced - len(self.p) - self.errors

    def failed(self) -> int:
        return self.errors

    def flush(self, timeout_s: float) -> None:
        left = self.p.flush(timeout_s)
        if left:
            raise TimeoutError(f"{left} Kafka messages still unacknowledged after {timeout_s:.0f} s")

    def close(self) -> None:
        self.p.flush(30.0)


class KafkaConsumerClient:
    def __init__(self, bootstrap: str, prefix: str, w: Workload, partitions: dict[int, list[int]],
                 consumer_index: int):
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{prefix}-c{consumer_index}",
                           **kafka_consumer_settings()})
        self.c.assign([TopicPartition(stream_name(prefix, s), sl, OFFSET_BEGINNING)
                       for s, sls in sorted(partitions.items()) for sl in sls])

    def poll(self) -> np.ndarray | None:
        # timeout=0: take what the client has fetched and return at once (a timeout would make
        # consume() wait for a full batch); idle like the kera side.
        msgs = self.c.consume(num_messages=KAFKA_CONSUME_MAX_MESSAGES, timeout=0)
        if not msgs:
            time.sleep(IDLE_SLEEP_S)
            return None
        values = [m.value() for m in msgs if m.error() is None]
        if len(values) != len(msgs):
            bad = next(m.error() for m in msgs if m.error() is not None)
            if bad.fatal() or not bad.retriable():
                raise RuntimeError(f"Kafka consumer error: {bad}")
        return stamps_from_values(values)

    def close(self) -> None:
        self.c.close()


def kafka_client(system: str) -> bool:
    """Whether `system`'s workers are Kafka clients: kafka, kafka-tuned, and kera-kafka(-tuned)
    (kera through its Kafka listener); kera and kera-curve use kera's."""
    return not system.startswith("kera") or system.startswith("kera-kafka")


def make_producer(system: str, bootstrap: str, prefix: str, w: Workload, index: int):
    if not kafka_client(system):   # kera-curve: the key comes from $KERA_KEY_FILE
        return KeraProducerClient(bootstrap, prefix, w)
    return KafkaProducerClient(bootstrap, prefix, w, index, tuned=system.endswith("-tuned"))


def make_consumer(system: str, bootstrap: str, prefix: str, w: Workload,
                  partitions: dict[int, list[int]], index: int):
    if not kafka_client(system):
        return KeraConsumerClient(bootstrap, prefix, w, partitions)
    return KafkaConsumerClient(bootstrap, prefix, w, partitions, index)
