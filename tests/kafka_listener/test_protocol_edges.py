"""The Kafka listener at the edges of the protocol, with raw bytes on a socket: an ApiVersions
request of an unsupported version, unknown APIs, oversized and negative length prefixes,
pipelined requests answered in order, and a few hundred seeded random, truncated and
corrupted frames after which the brokers still serve and nothing stored is lost."""

from __future__ import annotations

import datetime
import random
import socket
import struct
import time

import pytest
from kafka.record.default_records import DefaultRecordBatchBuilder
from kio.index import load_request_schema

from kafkit import (CLIENT_TIMEOUT_MS, WAIT_S, Wire, api_versions_request, create_topic,
                    fetch_request, kafka_python_consumer, kafka_python_producer,
                    metadata_request, nested_entity, zero_entity, zero_request)

UNSUPPORTED_VERSION = 35
SEED = 20_240_935
FUZZ_FRAMES = 480


def raw_header(api_key: int, version: int, correlation_id: int, client_id: bytes = b"raw") -> bytes:
    """A request header v1 (api key, version, correlation id, client id), no body."""
    return struct.pack(">hhih", api_key, version, correlation_id, len(client_id)) + client_id


def framed(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def test_api_versions_of_an_unsupported_version_answers_35_and_the_versions(kafka_cluster):
    with Wire(kafka_cluster.kafka_addresses[0]) as wire:
        wire.sock.sendall(framed(raw_header(18, 99, 4242)))
        frame = wire.recv_frame()
        # An ApiVersions v0 response: correlation id, error code, [api key, min, max].
        correlation_id, error, count = struct.unpack_from(">ihi", frame, 0)
        assert (correlation_id, error) == (4242, UNSUPPORTED_VERSION)
        assert len(frame) == 10 + 6 * count
        versions = {k: (lo, hi) for k, lo, hi in
                    struct.iter_unpack(">hhh", frame[10:10 + 6 * count])}
        assert versions[18][0] == 0 and versions[18][1] >= 3, versions
        for key in (0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 19, 20, 22, 32):
            assert key in versions, f"api key {key} not advertised: {versions}"
        assert versions[0][0] == 0, "Produce advertised from v0, as Kafka 4 does (librdkafka)"
        # The connection stays open: the client asks again with a version from the list.
        reply = wire.request(api_versions_request(3))
        assert reply.error_code == 0
        assert {k.api_key: (k.min_version, k.max_version) for k in reply.api_keys} == versions


@pytest.mark.parametrize("api_key, version", [(9999, 0), (-5, 0), (3, 99)],
                         ids=["unknown-key", "negative-key", "metadata-v99"])
def test_a_request_of_an_unknown_api_or_version_closes_the_connection(kafka_cluster, api_key,
                                                                       version):
    with Wire(kafka_cluster.kafka_addresses[0]) as wire:
        wire.sock.sendall(framed(raw_header(api_key, version, 7) + b"\0" * 16))
        assert wire.closed_by_peer(10.0)
    _still_serves(kafka_cluster.kafka_addresses[0])


@pytest.mark.parametrize("size", [200 << 20, (1 << 31) - 1, -1, -(1 << 31)],
                         ids=["200MiB", "int32-max", "minus-1", "int32-min"])
def test_an_oversized_or_negative_length_prefix_closes_the_connection_at_once(kafka_cluster, size):
    with Wire(kafka_cluster.kafka_addresses[1]) as wire:
        # The prefix and a real request header, but not the body promised: a broker that
        # waited for (or allocated) `size` bytes would not close.
        wire.sock.sendall(struct.pack(">i", size) + raw_header(3, 1, 1) + b"\xff\xff\xff\xff")
        assert wire.closed_by_peer(5.0)
    _still_serves(kafka_cluster.kafka_addresses[1])


def _still_serves(address: str) -> None:
    with Wire(address) as wire:
        assert wire.request(api_versions_request(0)).error_code == 0


def test_pipelined_requests_are_answered_in_order(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=1, replication=2)
    leader = _leader(kafka_cluster, topic)
    sent = []
    with Wire(leader) as wire:
        for i in range(20):
            if i % 5 == 0:   # held by the broker (nothing to read yet) while later ones are ready
                sent.append(wire.send(fetch_request(topic, 0, 0, max_wait_ms=300)))
            if i % 7 == 3:   # waits for its records to be durable on both copies
                sent.append(wire.send(produce_request(topic, [b"pipelined-%d" % i])))
            sent.append(wire.send(metadata_request([topic], version=1 + i % 9)))
            sent.append(wire.send(api_versions_request(i % 4)))
        answered = [wire.recv() for _ in sent]
    assert [c for c, _ in answered] == sent
    assert all(getattr(body, "error_code", 0) == 0 for _, body in answered)
    produced = [p.base_offset for _, body in answered if hasattr(body, "responses") and
                hasattr(body.responses[0], "partition_responses")
                for p in body.responses[0].partition_responses]
    assert produced == [0, 1, 2]


def _leader(cluster, topic: str, partition: int = 0) -> str:
    with Wire(cluster.kafka_addresses[0]) as wire:
        reply = wire.request(metadata_request([topic]))
    nodes = {b.node_id: f"{b.host}:{b.port}" for b in reply.brokers}
    return nodes[reply.topics[0].partitions[partition].leader_id]


def produce_request(topic: str, values: list[bytes], partition: int = 0, acks: int = -1,
                    version: int = 3):
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                        batch_size=1 << 20)
    for i, value in enumerate(values):
        builder.append(i, timestamp=None, key=None, value=value, headers=[])
    records = bytes(builder.build())
    cls = load_request_schema(0, version)
    topic_cls = nested_entity(cls, "topic_data")
    part_cls = nested_entity(topic_cls, "partition_data")
    return cls(transactional_id=None, acks=acks, timeout=datetime.timedelta(seconds=10),
               topic_data=(topic_cls(name=topic, partition_data=(
                   part_cls(index=partition, records=records),)),))


def _valid_requests(topic: str) -> list:
    """Requests the listener answers, to be truncated and corrupted."""
    return [
        metadata_request([topic], version=1), metadata_request([topic], version=9),
        metadata_request(None, version=4), api_versions_request(0), api_versions_request(3),
        fetch_request(topic, 0, 0), produce_request(topic, [b"x" * 40, b"y"]),
        load_request_schema(10, 0)(key="fuzz-group"),
        _list_offsets(topic),
    ]


def _list_offsets(topic: str):
    cls = load_request_schema(2, 1)
    topic_cls = nested_entity(cls, "topics")
    part_cls = nested_entity(topic_cls, "partitions")
    return cls(replica_id=-1, topics=(topic_cls(name=topic, partitions=(
        part_cls(partition_index=0, timestamp=-1),)),))


def fuzz_frames(rng: random.Random, topic: str, advertised: dict[int, tuple[int, int]]):
    """Seeded hostile input, FUZZ_FRAMES byte strings of six kinds in turn."""
    wire = Wire.__new__(Wire)                      # for its encoder only
    valid = [wire.encode(r, rng.randrange(1 << 31)) for r in _valid_requests(topic)]
    keys = sorted(advertised)
    for n in range(FUZZ_FRAMES):
        kind = n % 6
        if kind == 0:      # random bytes, the length prefix included
            yield rng.randbytes(rng.randrange(0, 64))
        elif kind == 1:    # a right length prefix, a random body
            yield framed(rng.randbytes(rng.randrange(0, 256)))
        elif kind == 2:    # a real API and version, then a random body
            key = rng.choice(keys)
            lo, hi = advertised[key]
            yield framed(raw_header(key, rng.randint(lo, hi), n) +
                         rng.randbytes(rng.randrange(200)))
        elif kind == 3:    # a real request cut short, its prefix saying so
            body = rng.choice(valid)[4:]
            yield framed(body[:rng.randrange(len(body))])
        elif kind == 4:    # a real request with a few bytes changed
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                frame[rng.randrange(4, len(frame))] = rng.randrange(256)
            yield bytes(frame)
        else:              # a real request whose stream ends inside it
            frame = rng.choice(valid)
            yield frame[:rng.randrange(1, len(frame))]


def test_random_and_truncated_frames_never_stop_a_broker(kafka_cluster, topic):
    create_topic(kafka_cluster, topic, partitions=2, replication=2)
    producer = kafka_python_producer(kafka_cluster)
    try:
        for i in range(200):
            producer.send(topic, key=b"%d" % i, value=b"before-%d" % i)
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)
    with Wire(kafka_cluster.kafka_addresses[0]) as wire:
        advertised = {k.api_key: (k.min_version, k.max_version)
                      for k in wire.request(api_versions_request(0)).api_keys}

    rng = random.Random(SEED)
    addresses = kafka_cluster.kafka_addresses
    for n, frame in enumerate(fuzz_frames(rng, topic, advertised)):
        broker = n % len(addresses)
        host, _, port = addresses[broker].rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(frame)
                if n % 3 == 0:       # and sometimes wait for the broker's answer or close
                    sock.shutdown(socket.SHUT_WR)
                    sock.settimeout(2.0)
                    while sock.recv(65536):
                        pass
        except (OSError, socket.timeout):
            pass                     # closed by the broker, or left waiting: both fine
        daemon = kafka_cluster.brokers[broker]
        if not daemon.running():
            raise AssertionError(
                f"broker {broker} stopped by a fuzz frame up to #{n} (seed {SEED}; the last: "
                f"kind {n % 6}, {frame[:80].hex()}): {crash_line(daemon.log_tail(3000))}\n"
                f"{daemon.log_tail(2500)}")

    producer = kafka_python_producer(kafka_cluster)
    try:
        for i in range(200):
            producer.send(topic, key=b"%d" % i, value=b"after-%d" % i)
        producer.flush(timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        producer.close(timeout=10)
    # Fuzzed Produce requests may have stored records of their own (valid ones: b"x" * 40,
    # b"y"); none of the records produced before or after is lost, changed or doubled.
    want = sorted([b"before-%d" % i for i in range(200)] + [b"after-%d" % i for i in range(200)])
    consumer = kafka_python_consumer(kafka_cluster, topic)
    try:
        ours: list[bytes] = []
        deadline = time.monotonic() + WAIT_S
        while len(ours) < len(want) and time.monotonic() < deadline:
            ours += [r.value for rs in consumer.poll(timeout_ms=200).values() for r in rs
                     if r.value.startswith((b"before-", b"after-"))]
        ours += [r.value for rs in consumer.poll(timeout_ms=500).values() for r in rs
                 if r.value.startswith((b"before-", b"after-"))]
    finally:
        consumer.close()
    assert sorted(ours) == want
    for d in kafka_cluster.brokers:
        assert d.running(), f"{d.name} died:\n{d.log_tail()}"


def test_every_advertised_version_of_every_api_is_answered(kafka_cluster):
    """A request of each advertised (api, version), every field at its zero (empty arrays,
    empty names): each is answered, and the broker serves on. (Produce v0-2 are advertised
    for librdkafka's sake and refused, as Kafka 4 does; kio has no schema to build them.)"""
    address = kafka_cluster.kafka_addresses[0]
    with Wire(address) as wire:
        advertised = {k.api_key: (k.min_version, k.max_version)
                      for k in wire.request(api_versions_request(0)).api_keys}
    unanswered = []
    for key, (lo, hi) in sorted(advertised.items()):
        for version in range(max(lo, 3) if key == 0 else lo, hi + 1):
            fields = {"acks": 1} if key == 0 else {}
            if key == 10:   # FindCoordinator: one key (v0-3) or a list of them (v4)
                fields = {"key": "a-group"} if version < 4 else {"coordinator_keys": ("a-group",)}
            request = zero_request(key, version, **fields)
            try:
                with Wire(address, timeout_s=5.0) as wire:
                    wire.request(request)
                continue
            except (OSError, socket.timeout) as exc:
                what = f"{exc.__class__.__name__}: {exc}"
            broker = kafka_cluster.brokers[0]
            if broker.wait(2.0) is not None:      # it stopped: say why, and start it again
                what = f"the broker stopped: {crash_line(broker.log_tail(3000))}"
                kafka_cluster.restart_broker(0)
            unanswered.append((key, version, what))
    assert unanswered == [], "not answered:\n" + "\n".join(
        f"  api key {k} v{v}: {what}" for k, v, what in unanswered)


def crash_line(log: str) -> str:
    """The exception line of the last traceback in a daemon's log."""
    lines = log.split("Traceback (most recent call last):")[-1].splitlines()
    errors = [line for line in lines if line and not line[0].isspace() and not line[0].isdigit()]
    return errors[0] if errors else "(no traceback in the log)"


def _repeated(kind: str, name: str):
    """The request of `kind` naming `name` twice (or, offset-fetch-no-group, no group)."""
    key, version = {"create-topics": (19, 4), "delete-topics": (20, 4),
                    "create-partitions": (37, 1), "offset-fetch-groups": (9, 8),
                    "offset-fetch-no-group": (9, 8), "delete-groups": (42, 2)}[kind]
    cls = load_request_schema(key, version)
    ten_s = datetime.timedelta(seconds=10)
    if kind == "create-topics":
        entry = nested_entity(cls, "topics")
        topic = zero_entity(entry, name=name, num_partitions=1, replication_factor=1)
        return cls(topics=(topic, topic), timeout=ten_s, validate_only=False)
    if kind == "delete-topics":
        return cls(topic_names=(name, name), timeout=ten_s)
    if kind == "delete-groups":
        return cls(groups_names=(name, name))
    if kind == "create-partitions":
        entry = nested_entity(cls, "topics")
        topic = entry(name=name, count=4, assignments=None)
        return cls(topics=(topic, topic), timeout=ten_s, validate_only=False)
    entry = nested_entity(cls, "groups")
    groups = () if kind == "offset-fetch-no-group" else \
        (entry(group_id=name, topics=None), entry(group_id=name, topics=None))
    return cls(groups=groups, require_stable=False)


@pytest.mark.parametrize("kind", ["create-topics", "delete-topics", "create-partitions",
                                  "offset-fetch-groups", "offset-fetch-no-group",
                                  "delete-groups"])
def test_a_request_naming_a_topic_or_group_twice_or_none_is_answered(kafka_cluster, topic, kind):
    """Every request gets exactly one reply, and the replies queued behind it on its
    connection are not held: one naming the same topic (group) twice (Kafka answers
    INVALID_REQUEST for it), an OffsetFetch v8 naming no group (an empty reply)."""
    create_topic(kafka_cluster, topic, partitions=1, replication=1)
    with Wire(kafka_cluster.kafka_addresses[0], timeout_s=5.0) as wire:
        first = wire.send(_repeated(kind, topic))
        second = wire.send(api_versions_request(0))
        try:
            answered = [wire.recv()[0] for _ in range(2)]
        except socket.timeout:
            answered = "no reply within 5 s"
    assert answered == [first, second]
