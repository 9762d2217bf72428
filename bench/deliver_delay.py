"""Delivery delay of kera.services.deliver.deliverer: from a record's send to its target's apply returning.

    python -m bench.deliver_delay [--rate 2000] [--seconds 20] [--linger-ms 1] [--fetch-wait-ms 5]
                                  [--postgres] [--kafka]

Starts a local cluster (one broker), a stream of 4 streamlets and one Deliverer in this process
pushing it to an in-memory target (the deliverer's own cost), a SQLite file target (delay to a
committed transaction) and, with --postgres, a PostgreSQL target (tests.postgres_cluster). A
producer sends at --rate records/s, paced every PACE_MS; each record's delay is the time its
target's apply() returned minus the record's timestamp (stamped by the producer at send, so the
producer's linger is included). The first WARMUP_S are not counted.

--kafka also runs the same delivery built on Apache Kafka (LogPlayer's comparison), right after
on the same machine: one Kafka broker (bench/kafka), a topic of 4 partitions, an idempotent
acks=all producer with the same linger, pace and keys, and a consumer that assigns every
partition and hands what each poll returns, in order, to the in-memory target (its
fetch.wait.max.ms = --fetch-wait-ms: Kafka's broker holds its fetch that long at most; kera's
brokers hold the deliverer's fetches up to the Consumer's default fetch_max_wait_ms, and
--fetch-wait-ms is then only the back-off for a broker that does not). The send time travels in
the value (µs; Kafka's own timestamps are milliseconds).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from typing import NamedTuple

from kera import config
from kera.services.deliver.deliverer import Deliverer
from kera.services.deliver.targets import PostgresTarget, SqliteTarget, Target
from kera.cli.local import LocalCluster
from kera.producer import Producer

STREAM = "deliver_delay"
STREAMLETS = 4
PACE_MS = 10                 # the producer sends rate * PACE_MS / 1000 records per step
WARMUP_S = 2.0
DRAIN_TIMEOUT_S = 60.0       # after production, every target has everything within it
POLL_S = 0.05
VALUE = b"x" * 100
KAFKA_POLL_MESSAGES = 1000   # most messages one consume() call hands over


class TimedTarget(Target):
    """Wraps a target (None: stores nothing) and keeps each applied record's delay in µs."""

    def __init__(self, name: str, inner: Target | None = None):
        self.name, self.inner = name, inner
        self.delays_us: list[int] = []
        self.count = 0
        self.counted_after_us = 0   # records stamped before it are warm-up

    def last_applied(self) -> dict:
        return {} if self.inner is None else self.inner.last_applied()

    def apply(self, records) -> None:
        if self.inner is not None:
            self.inner.apply(records)
        now_us = time.time_ns() // 1000
        self.delays_us += [now_us - r.timestamp for r in records
                           if r.timestamp >= self.counted_after_us]
        self.count += len(records)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def produce(bootstrap: str, rate: int, seconds: float, linger_ms: float) -> int:
    per_step = max(1, rate * PACE_MS // 1000)
    sent, started = 0, time.monotonic()
    with Producer(bootstrap, linger_ms=linger_ms) as producer:
        while time.monotonic() - started < seconds:
            for _ in range(per_step):
                producer.send(STREAM, VALUE, key=str(sent % 64).encode())
                sent += 1
            next_s = started + sent / rate
            time.sleep(max(0.0, next_s - time.monotonic()))
        producer.flush()
    return sent


class Stamped(NamedTuple):
    """What TimedTarget reads of a record: its send time in µs."""
    timestamp: int


def run_kafka(work_dir: Path, args) -> TimedTarget:
    """The in-memory target fed by a Kafka consumer loop (see the module docstring)."""
    import threading

    from bench.kafka.cluster import KafkaCluster
    target = TimedTarget("kafka")
    with KafkaCluster(work_dir, brokers=1) as cluster:
        cluster.create_topic(STREAM, partitions=STREAMLETS)
        stop = threading.Event()
        reader = threading.Thread(target=kafka_consume, args=(cluster.bootstrap, target, stop, args))
        reader.start()
        try:
            target.counted_after_us = time.time_ns() // 1000 + int(WARMUP_S * 1e6)
            sent = kafka_produce(cluster.bootstrap, args)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while target.count < sent and time.monotonic() < deadline:
                time.sleep(POLL_S)
        finally:
            stop.set()
            reader.join()
    report(target, sent)
    return target


def kafka_consume(bootstrap: str, target: TimedTarget, stop, args) -> None:
    from confluent_kafka import Consumer, TopicPartition
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "deliver-delay",
                         "enable.auto.commit": False, "fetch.wait.max.ms": int(args.fetch_wait_ms),
                         "fetch.min.bytes": 1})
    try:
        consumer.assign([TopicPartition(STREAM, p, 0) for p in range(STREAMLETS)])
        while not stop.is_set():
            messages = consumer.consume(num_messages=KAFKA_POLL_MESSAGES, timeout=POLL_S)
            records = [Stamped(int.from_bytes(m.value()[:8], "little"))
                       for m in messages if m.error() is None]
            if records:
                target.apply(records)
    finally:
        consumer.close()


def kafka_produce(bootstrap: str, args) -> int:
    from confluent_kafka import Producer as KafkaProducer
    producer = KafkaProducer({"bootstrap.servers": bootstrap, "acks": "all",
                              "enable.idempotence": True, "linger.ms": args.linger_ms})
    per_step = max(1, args.rate * PACE_MS // 1000)
    sent, started = 0, time.monotonic()
    while time.monotonic() - started < args.seconds:
        for _ in range(per_step):
            stamp = (time.time_ns() // 1000).to_bytes(8, "little")
            producer.produce(STREAM, stamp + VALUE[8:], key=str(sent % 64).encode())
            sent += 1
        producer.poll(0)
        time.sleep(max(0.0, started + sent / args.rate - time.monotonic()))
    producer.flush(DRAIN_TIMEOUT_S)
    return sent


def report(t: TimedTarget, sent: int) -> None:
    print(f"{t.name:10} {t.count}/{sent} records, delay p50 {percentile(t.delays_us, 0.5):.2f}"
          f" ms, p99 {percentile(t.delays_us, 0.99):.2f} ms, mean "
          f"{sum(t.delays_us) / max(1, len(t.delays_us)) / 1000:.2f} ms, max "
          f"{percentile(t.delays_us, 1.0):.2f} ms", flush=True)


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000 if ordered else 0.0


def run(bootstrap: str, targets: list[TimedTarget], args) -> None:
    for t in targets:
        t.counted_after_us = time.time_ns() // 1000 + int(WARMUP_S * 1e6)
    with Deliverer(bootstrap, STREAM, targets, fetch_wait_ms=args.fetch_wait_ms):
        sent = produce(bootstrap, args.rate, args.seconds, args.linger_ms)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(t.count < sent for t in targets) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    for t in targets:
        report(t, sent)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=2_000, help="records/s")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--linger-ms", type=float, default=1.0)
    parser.add_argument("--fetch-wait-ms", type=float, default=config.DEFAULT_FETCH_WAIT_MS)
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--kafka", action="store_true",
                        help="then the same delivery built on Apache Kafka, for comparison")
    args = parser.parse_args(argv)
    print(f"rate {args.rate} records/s for {args.seconds} s, linger {args.linger_ms} ms, "
          f"fetch wait {args.fetch_wait_ms} ms, "
          f"{STREAMLETS} streamlets, one broker, loopback")
    server = None
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(Path(tmp), log_level="WARNING") as cluster:
        cluster.admin().create_stream(STREAM, streamlets=STREAMLETS)
        targets = [TimedTarget("memory"), TimedTarget("sqlite", SqliteTarget(f"{tmp}/t.db"))]
        if args.postgres:
            from tests.postgres_cluster import PostgresServer, postgres_bin_dir
            server = PostgresServer(postgres_bin_dir()[0]).start()
            targets.append(TimedTarget("postgresql", PostgresTarget(server.dsn)))
        try:
            run(cluster.bootstrap, targets, args)
        finally:
            if server is not None:
                server.stop()
    if args.kafka:
        with tempfile.TemporaryDirectory() as tmp:
            run_kafka(Path(tmp) / "kafka", args)


if __name__ == "__main__":
    main()
