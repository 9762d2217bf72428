"""Kafka clients against brokers on test hosts (network namespaces; layout in host_layout.py):
each broker's Kafka listener binds its own host's address and advertises it (`--kafka-host`,
`--kafka-advertise`), the clients run on the root namespace's host and reach the brokers only
through what Metadata tells them. Under an idempotent confluent-kafka producer (acks=all) on an
R=2 topic, one broker's host is cut off briefly (healed inside the dead window: the requests
that timed out are retried to the same broker), then the other's until its partitions fail
over, then healed: every acknowledged record is read back exactly once, in the order sent
within its partition, and Metadata names each broker at its own host's address, and the
partitions' leaders, before and after (issue 35)."""

from __future__ import annotations

import collections
import time

from confluent_kafka import Consumer, Producer, TopicPartition

import host_layout as layout
from faultkit import call, wait_for
from kafkit import Wire, create_topic, metadata_request

TOPIC = "orders-across-hosts"
PARTITIONS = 4
HEARTBEAT_MS = 100
MISSED_MAX = 30             # a broker is declared dead after 3 s of silence
SEND_INTERVAL_S = 0.002     # ~500 records/s: production goes on through the whole cut
ACKED_BEFORE_CUT = 500
AFTER_HEAL_S = 3.0          # production after the heal, the healed broker back in the cluster
DELIVERY_TIMEOUT_S = 60.0   # librdkafka's message.timeout.ms: outlives the failover
SHORT_CUT_S = 1.5           # healed before the dead window: no failover
CLIENT_TIMEOUT_MS = 1_000   # a request to the cut-off host is given up (and retried) this soon
READ_TIMEOUT_S = 30.0


def start(multihost):
    """The cluster of host_layout, each broker's Kafka listener bound and advertised on its
    host's address (passed explicitly: what an operator of separate machines would write)."""
    hosts, cluster = multihost(
        kafka_port=0, heartbeat_interval_ms=HEARTBEAT_MS, log_level="INFO", start=False,
        extra_coordinator_args=["--heartbeat-missed-max", str(MISSED_MAX)])
    for broker, address in zip(cluster.brokers, cluster.kafka_addresses):
        broker.args += ["--kafka-host", address.rpartition(":")[0], "--kafka-advertise", address]
    cluster.start()
    return hosts, cluster


def advertised(cluster) -> list[set]:
    """The (node id, host, port) brokers of Metadata, as each broker answers it."""
    out = []
    for address in cluster.kafka_addresses:
        with Wire(address) as wire:
            reply = wire.request(metadata_request(None))
        out.append({(b.node_id, b.host, b.port) for b in reply.brokers})
    return out


def partition_leaders(cluster) -> list[list[int]]:
    """The leader of each partition of TOPIC, as each broker's Metadata answers it."""
    out = []
    for address in cluster.kafka_addresses:
        with Wire(address) as wire:
            [topic] = wire.request(metadata_request([TOPIC])).topics
        out.append([p.leader_id for p in sorted(topic.partitions, key=lambda p: p.partition_index)])
    return out


def own_hosts(hosts, cluster) -> set:
    """Each broker at its own host's address (and its listener's port)."""
    return {(d.index, hosts.address(layout.host_of(d)), int(a.rpartition(":")[2]))
            for d, a in zip(cluster.brokers, cluster.kafka_addresses)}


class Production:
    """An idempotent producer (acks=all) sending numbered records round-robin over the
    partitions, driven from the test's thread; what each delivery report said."""

    def __init__(self, cluster):
        self.producer = Producer({
            "bootstrap.servers": cluster.kafka_bootstrap, "broker.address.family": "v4",
            "enable.idempotence": True, "acks": "all", "linger.ms": 5,
            "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000),
            "request.timeout.ms": CLIENT_TIMEOUT_MS, "socket.timeout.ms": CLIENT_TIMEOUT_MS,
            "socket.connection.setup.timeout.ms": CLIENT_TIMEOUT_MS,
            "topic.metadata.refresh.interval.ms": 1000})
        self.sent = 0
        self.acked: dict[tuple[int, int], bytes] = {}     # (partition, offset) -> value
        self.failed: list = []

    def _report(self, err, msg) -> None:
        if err is None:
            self.acked[(msg.partition(), msg.offset())] = msg.value()
        else:
            self.failed.append((msg.value(), err))

    def acked_in(self, partitions: list[int]) -> int:
        return sum(p in partitions for p, _ in self.acked)

    def run_until(self, done, what: str, timeout_s: float = 60.0) -> None:
        """Keep producing until `done()` (AssertionError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
            value = b"%07d" % self.sent
            self.producer.produce(TOPIC, value=value, partition=self.sent % PARTITIONS,
                                  on_delivery=self._report)
            self.sent += 1
            self.producer.poll(0)
            time.sleep(SEND_INTERVAL_S)

    def finish(self) -> None:
        assert self.producer.flush(DELIVERY_TIMEOUT_S) == 0, "records left undelivered"

    def close(self) -> None:
        """Stop the producer's threads now (what is left undelivered is dropped)."""
        self.producer.purge()
        self.producer.close()


def read_back(cluster) -> list[tuple[int, int, bytes]]:
    """Every record of the topic, (partition, offset, value), read from the beginning to the
    high watermark of each partition by a confluent-kafka consumer."""
    consumer = Consumer({"bootstrap.servers": cluster.kafka_bootstrap,
                         "broker.address.family": "v4", "group.id": "reader",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    read: list = []
    try:
        parts = [TopicPartition(TOPIC, p, 0) for p in range(PARTITIONS)]
        ends = {p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=10)[1]
                for p in range(PARTITIONS)}
        consumer.assign(parts)
        last = {p: -1 for p in range(PARTITIONS)}

        def at_end() -> bool:
            for m in consumer.consume(num_messages=1000, timeout=0.2):
                assert m.error() is None, m.error()
                read.append((m.partition(), m.offset(), m.value()))
                last[m.partition()] = m.offset()
            return all(last[p] >= ends[p] - 1 for p in range(PARTITIONS))
        wait_for(at_end, f"the reader to reach the high watermarks {ends}", READ_TIMEOUT_S)
        # Nothing beyond the high watermarks (a record stored twice would show up here).
        for m in consumer.consume(num_messages=1000, timeout=1.0):
            assert m.error() is None, m.error()
            read.append((m.partition(), m.offset(), m.value()))
    finally:
        consumer.close()
    return read


def stream_placement(cluster) -> list[int]:
    return call(cluster.bootstrap, "describe_stream", {"name": TOPIC})["stream"]["placement"]


def short_cut(hosts, cluster, work, broker: int) -> None:
    """Cut `broker`'s host off for less than the dead window: it keeps its partitions, and the
    producer's requests that timed out meanwhile are retried to it (and must be stored once)."""
    host = layout.host_of(cluster.brokers[broker])
    hosts.partition(host)
    try:
        cut = time.monotonic()
        work.run_until(lambda: time.monotonic() - cut > SHORT_CUT_S, "a short cut")
    finally:
        hosts.heal(host)
    acked = len(work.acked)
    work.run_until(lambda: len(work.acked) >= acked + ACKED_BEFORE_CUT,
                   "records acknowledged after the short cut")
    assert call(cluster.bootstrap, "recovery_status")["failed"] == [], \
        f"broker {broker} failed over after a cut of {SHORT_CUT_S} s"
    print(f"broker {broker}'s host {hosts.name(host)} cut off for {SHORT_CUT_S} s "
          f"(librdkafka logs the requests it timed out meanwhile: REQTMOUT)")


def long_cut(hosts, cluster, work, broker: int) -> None:
    """Cut `broker`'s host off until its partitions fail over and the producer has followed
    them to their new leader, then heal it and wait until it is back in the cluster."""
    epochs = dict(map(tuple, call(cluster.bootstrap, "recovery_status")["epochs"]))
    moved = [p for p, b in enumerate(stream_placement(cluster)) if b == broker]
    host = layout.host_of(cluster.brokers[broker])
    hosts.partition(host)
    cut = time.monotonic()
    try:
        # Production goes on while the coordinator declares the cut-off broker dead and its
        # partitions move; the producer must find their new leader through Metadata.
        work.run_until(lambda: [broker, epochs[broker]] in
                       call(cluster.bootstrap, "recovery_status")["failed"],
                       f"broker {broker} to be declared dead and failed over")
        led = stream_placement(cluster)
        assert broker not in led, f"broker {broker} still leads partitions: {led}"
        before = work.acked_in(moved)
        work.run_until(lambda: work.acked_in(moved) >= before + ACKED_BEFORE_CUT // 2,
                       f"records acknowledged in partitions {moved} with their old leader's "
                       f"host cut off")
    finally:
        hosts.heal(host)
    print(f"broker {broker}'s host {hosts.name(host)} cut off for "
          f"{time.monotonic() - cut:.1f} s (leading partitions {moved}); sent {work.sent}, "
          f"acknowledged {len(work.acked)}")
    work.run_until(lambda: any(b["id"] == broker and b["alive"]
                               for b in call(cluster.bootstrap, "cluster")["brokers"]),
                   "the healed broker to register again")
    healed = time.monotonic()
    work.run_until(lambda: time.monotonic() - healed > AFTER_HEAL_S, "production after the heal")


def test_kafka_clients_follow_a_cut_off_broker_host_and_lose_and_double_nothing(multihost):
    hosts, cluster = start(multihost)
    want = own_hosts(hosts, cluster)
    # (A broker learns the others from the coordinator: within a heartbeat or so.)
    wait_for(lambda: all(b == want for b in advertised(cluster)),
             "every broker's Metadata to list each broker at its own host's address", 30)
    create_topic(cluster, TOPIC, partitions=PARTITIONS, replication=2)

    work = Production(cluster)
    try:
        work.run_until(lambda: len(work.acked) >= ACKED_BEFORE_CUT, "records acknowledged")
        placement = stream_placement(cluster)
        short_cut(hosts, cluster, work, placement[1])
        long_cut(hosts, cluster, work, placement[0])
        work.finish()
    finally:
        work.close()

    # Each acknowledged record is there once, in its partition's order.
    assert not work.failed, f"{len(work.failed)} records not delivered: {work.failed[:3]}"
    assert len(work.acked) == work.sent, "two records acknowledged at one offset"
    read = read_back(cluster)
    by_offset = {(p, o): v for p, o, v in read}
    assert len(by_offset) == len(read), "an offset read twice"
    missing = sorted(k for k, v in work.acked.items() if by_offset.get(k) != v)
    assert not missing, f"{len(missing)} acknowledged records missing or changed, e.g. " \
                        f"{missing[:5]}"
    doubled = [v for v, n in collections.Counter(v for _, _, v in read).items() if n > 1]
    assert not doubled, f"{len(doubled)} records stored twice, e.g. {sorted(doubled)[:5]}"
    assert len(read) == work.sent
    for p in range(PARTITIONS):
        mine = sorted((o, v) for q, o, v in read if q == p)
        assert [o for o, _ in mine] == list(range(len(mine))), f"partition {p}: offsets not dense"
        assert [v for _, v in mine] == sorted(v for _, v in mine), \
            f"partition {p}: records not in the order sent"
    # The healed broker is back in Metadata at its own host's address, as the other sees it,
    # and names the partitions' new leaders, not itself.
    wait_for(lambda: all(b == want for b in advertised(cluster)),
             "every broker's Metadata to list each broker at its own host's address", 30)
    led = stream_placement(cluster)
    wait_for(lambda: all(leaders == led for leaders in partition_leaders(cluster)),
             f"every broker's Metadata to name the leaders {led}", 30)
