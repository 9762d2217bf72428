"""Helpers of the Kafka listener's tests: real Kafka clients (kafka-python, confluent-kafka)
made with timeouts, topic creation that waits for leaders, polling under deadlines
(`wait_for`), and raw bytes on a socket (`Wire`, requests encoded with kio, generated from
Kafka's own schemas)."""

from __future__ import annotations

import dataclasses
import datetime
import io
import itertools
import socket
import struct
import time
import typing
import uuid

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader, entity_writer

CLIENT_TIMEOUT_MS = 15_000
WAIT_S = 30.0
POLL_S = 0.02


def wait_for(predicate, timeout_s: float = WAIT_S, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned); AssertionError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


# ---------------------------------------------------------------------- Kafka clients
def kafka_python_admin(cluster):
    return KafkaAdminClient(bootstrap_servers=cluster.kafka_bootstrap,
                            request_timeout_ms=CLIENT_TIMEOUT_MS, client_id="kera-tests-admin")


def kafka_python_producer(cluster, **kw):
    """kafka-python's producer with its defaults (idempotent, acks=all) unless `kw` says."""
    kw.setdefault("request_timeout_ms", CLIENT_TIMEOUT_MS)
    kw.setdefault("max_block_ms", CLIENT_TIMEOUT_MS)
    return KafkaProducer(bootstrap_servers=cluster.kafka_bootstrap, **kw)


def kafka_python_consumer(cluster, *topics, **kw):
    kw.setdefault("request_timeout_ms", CLIENT_TIMEOUT_MS + 5000)
    kw.setdefault("auto_offset_reset", "earliest")
    kw.setdefault("enable_auto_commit", False)
    kw.setdefault("group_id", None)
    return KafkaConsumer(*topics, bootstrap_servers=cluster.kafka_bootstrap, **kw)


def confluent_config(cluster, **kw) -> dict:
    conf = {"bootstrap.servers": cluster.kafka_bootstrap, "socket.timeout.ms": CLIENT_TIMEOUT_MS,
            "broker.address.family": "v4"}
    conf.update({k.replace("_", "."): v for k, v in kw.items()})
    return conf


def create_topic(cluster, name: str, partitions: int = 2, replication: int = 2,
                 configs: dict | None = None) -> None:
    """Create `name` with KafkaAdminClient, then wait_topic_ready."""
    admin = kafka_python_admin(cluster)
    try:
        reply = admin.create_topics([NewTopic(name, partitions, replication,
                                              topic_configs=configs or {})])
        assert [(t["name"], t["error_code"]) for t in reply["topics"]] == [(name, 0)], reply
    finally:
        admin.close()
    wait_topic_ready(cluster, name, partitions)


def wait_topic_ready(cluster, name: str, partitions: int) -> None:
    """Wait until every owning broker has the topic (kera's `ready`: a raw request to its
    leader finds it; Kafka clients would retry UNKNOWN_TOPIC_OR_PARTITION meanwhile) and
    every broker's Metadata names a leader for each partition."""
    with cluster.admin() as admin:
        admin.wait_ready(name, timeout_s=WAIT_S)

    def ready() -> bool:
        for address in cluster.kafka_addresses:
            with Wire(address) as wire:
                reply = wire.request(metadata_request([name]))
            [t] = reply.topics
            if t.error_code != 0 or len(t.partitions) != partitions or \
                    any(p.leader_id < 0 for p in t.partitions):
                return False
        return True
    wait_for(ready, what=f"topic {name!r} to have a leader for each of its {partitions} "
                         f"partitions")


def consume_kafka_python(consumer, count: int, timeout_s: float = WAIT_S) -> list:
    """Poll a KafkaConsumer until `count` records came (or the deadline: AssertionError with
    how many came). Returns them in the order polled."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"read {len(got)} of {count} records within {timeout_s:.0f} s")
        for records in consumer.poll(timeout_ms=200).values():
            got.extend(records)
    return got


def consume_confluent(consumer, count: int, timeout_s: float = WAIT_S) -> list:
    """Poll a confluent_kafka.Consumer until `count` messages came; an error message fails."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"read {len(got)} of {count} records within {timeout_s:.0f} s")
        for m in consumer.consume(num_messages=1000, timeout=0.2):
            assert m.error() is None, m.error()
            got.append(m)
    return got


# ---------------------------------------------------------------------- raw wire
class Wire:
    """A raw Kafka connection: length-prefixed frames out and in, requests built with kio."""

    def __init__(self, address: str, timeout_s: float = 10.0):
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.correlation = itertools.count(1)
        self.pending: dict[int, type] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.sock.close()

    def encode(self, entity, correlation_id: int, client_id: str = "kera-tests") -> bytes:
        """One request frame (size prefix included)."""
        cls = type(entity)
        buf = io.BytesIO()
        header_cls = cls.__header_schema__
        fields = {"request_api_key": cls.__api_key__, "request_api_version": cls.__version__,
                  "correlation_id": correlation_id}
        if "client_id" in header_cls.__dataclass_fields__:
            fields["client_id"] = client_id
        entity_writer(header_cls)(buf, header_cls(**fields))
        entity_writer(cls)(buf, entity)
        body = buf.getvalue()
        return struct.pack(">i", len(body)) + body

    def send(self, entity) -> int:
        correlation_id = next(self.correlation)
        self.sock.sendall(self.encode(entity, correlation_id))
        self.pending[correlation_id] = type(entity)
        return correlation_id

    def recv_frame(self) -> bytes:
        """The next response frame (size prefix removed); ConnectionError when closed."""
        size = struct.unpack(">i", self.recv_exactly(4))[0]
        return self.recv_exactly(size)

    def recv_exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            data = self.sock.recv(n - len(out))
            if not data:
                raise ConnectionError(f"closed by the broker after {len(out)} of {n} bytes")
            out += data
        return bytes(out)

    def recv(self):
        """(correlation id, decoded response entity) of the next response."""
        frame = self.recv_frame()
        correlation_id = struct.unpack_from(">i", frame, 0)[0]
        cls = self.pending.pop(correlation_id)
        response_cls = load_response_schema(cls.__api_key__, cls.__version__)
        header, at = entity_reader(response_cls.__header_schema__)(frame, 0)
        body, used = entity_reader(response_cls)(frame, at)
        assert at + used == len(frame), "bytes after a response's body"
        return correlation_id, body

    def request(self, entity):
        sent = self.send(entity)
        correlation_id, body = self.recv()
        assert correlation_id == sent
        return body

    def closed_by_peer(self, timeout_s: float = 10.0) -> bool:
        """Whether the broker closes this connection within `timeout_s` (any bytes it sends
        meanwhile are read and dropped)."""
        self.sock.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
        return False


def metadata_request(topics: list[str] | None, version: int = 1):
    """Metadata of `topics` (None: all), never creating one."""
    cls = load_request_schema(3, version)
    entity = nested_entity(cls, "topics")
    kw = {"topics": None if topics is None else tuple(entity(name=t) for t in topics)}
    for name in ("allow_auto_topic_creation", "include_cluster_authorized_operations",
                 "include_topic_authorized_operations"):
        if name in cls.__dataclass_fields__:
            kw[name] = False
    return cls(**kw)


def nested_entity(cls, field_name: str):
    """The dataclass of the entities held in `cls.field_name` (a tuple of them)."""
    hint = typing.get_type_hints(cls)[field_name]
    for arg in typing.get_args(hint):
        for inner in (arg, *typing.get_args(arg)):
            if isinstance(inner, type) and hasattr(inner, "__dataclass_fields__"):
                return inner
    raise TypeError(f"{cls.__name__}.{field_name} holds no entity")


def api_versions_request(version: int = 0):
    """ApiVersions of `version` (0-3)."""
    cls = load_request_schema(18, version)
    kw = {}
    if "client_software_name" in cls.__dataclass_fields__:
        kw = {"client_software_name": "kera-tests", "client_software_version": "1"}
    return cls(**kw)


def fetch_request(topic: str, partition: int, offset: int, max_wait_ms: int = 0,
                  max_bytes: int = 1 << 20, version: int = 4):
    """A Fetch of one partition from `offset` (min_bytes 1, held up to `max_wait_ms`)."""
    cls = load_request_schema(1, version)
    topic_cls = nested_entity(cls, "topics")
    part_cls = nested_entity(topic_cls, "partitions")
    return cls(max_wait=datetime.timedelta(milliseconds=max_wait_ms), min_bytes=1,
               max_bytes=max_bytes,
               topics=(topic_cls(topic=topic, partitions=(part_cls(
                   partition=partition, fetch_offset=offset,
                   partition_max_bytes=max_bytes),)),))


def fetched_partition(reply):
    """The one partition of a one-partition Fetch reply."""
    [topic] = reply.responses
    [part] = topic.partitions
    return part


BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")


def record_batches(records: bytes) -> list[dict]:
    """The record batches (magic 2) of a Fetch partition's `records`: base offset, last offset
    delta, codec (attributes & 7) and record count of each whole batch (a partial last batch,
    as Kafka may send, is left out)."""
    out, at = [], 0
    while at + BATCH_HEADER.size <= len(records):
        (base, length, _epoch, magic, _crc, attributes, last_delta, _first_ts, _max_ts,
         _pid, _pepoch, _seq, count) = BATCH_HEADER.unpack_from(records, at)
        if at + 12 + length > len(records):
            break
        assert magic == 2, f"a batch of magic {magic}"
        out.append({"base_offset": base, "last_offset": base + last_delta,
                    "codec": attributes & 0x07, "count": count})
        at += 12 + length
    return out


def zero_request(api_key: int, version: int, **fields):
    """The request of (api_key, version) with every field at its zero ("", 0, empty arrays,
    null where the version allows it) unless `fields` gives it."""
    return zero_entity(load_request_schema(api_key, version), **fields)


def zero_entity(cls, **given):
    """An entity of `cls` with the fields `given`, every other at its zero (see zero_request)."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in values or f.default is not dataclasses.MISSING or \
                f.default_factory is not dataclasses.MISSING:
            continue
        hint, kind = hints[f.name], f.metadata.get("kafka_type", "")
        args = typing.get_args(hint)
        if type(None) in args:
            values[f.name] = None
        elif typing.get_origin(hint) is tuple:
            values[f.name] = ()
        elif dataclasses.is_dataclass(hint):
            values[f.name] = zero_entity(hint)
        elif kind.startswith("timedelta"):
            values[f.name] = datetime.timedelta(0)
        elif kind == "string":
            values[f.name] = ""
        elif kind in ("bytes", "records"):
            values[f.name] = b""
        elif kind == "bool":
            values[f.name] = False
        elif kind == "uuid":
            values[f.name] = uuid.UUID(int=0)
        elif kind == "float64":
            values[f.name] = 0.0
        else:
            values[f.name] = 0
    return cls(**values)
