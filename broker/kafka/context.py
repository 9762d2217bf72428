"""What every Kafka API handler is given: the broker's core and the few collaborators around it.

Handlers take this narrow view, not the broker daemon: the core (streams, appends, reads), the
catalog (all topics, brokers' Kafka addresses, coordinator calls), the clock, the loop's
`wake_at` for held requests, and the listener's settings.
"""

from __future__ import annotations

import abc

from dataclasses import dataclass, field
from typing import Callable

from kera.broker.core import Broker
from kera.broker.kafka.classic_groups import ClassicGroups
from kera.broker.kafka.catalog import Catalog, KafkaBroker
from kera.broker.kafka.connection import SILENT, Connection, Slot
from kera.broker.kafka.messages import KafkaRequest, encode_parts, response

# Partitions a Kafka-created topic gets when CreateTopics or auto-creation does not say:
# Kafka's num.partitions default (`--kafka-default-partitions` changes it).
DEFAULT_PARTITIONS = 1


@dataclass(frozen=True)
class Advertised:
    """Where Kafka clients reach this broker's listener."""
    host: str
    port: int

    def with_id(self, node_id: int) -> KafkaBroker:
        return KafkaBroker(node_id, self.host, self.port)


@dataclass
class Settings:
    advertise: Advertised | None = None
    cluster_id: str = "kera"
    auto_create_topics: bool = False      # Kafka's auto.create.topics.enable
    default_partitions: int = DEFAULT_PARTITIONS
    default_replication: int = 1
    # A secure cluster's SASL_SSL listener: TLS, SASL users, the broker's ACLs and quotas
    # (kera.broker.kafka.sasl.KafkaSecurity); None for a plaintext one.
    security: object | None = None


@dataclass
class Context:
    core: Broker
    catalog: Catalog
    clock: object                         # .monotonic(), .time()
    wake_at: Callable[[float], None]
    settings: Settings = field(default_factory=Settings)
    groups: ClassicGroups = field(default_factory=ClassicGroups)
    _names: tuple = (None, {})            # (core.metadata_version, {name: Stream})

    @property
    def node_id(self) -> int:
        return -1 if self.core.broker_id is None else self.core.broker_id

    def stream_by_name(self, name: str):
        """This broker's stream named `name` (a topic with partitions here), else None."""
        version, names = self._names
        if version != self.core.metadata_version or len(names) != len(self.core.streams):
            names = {s.info.name: s for s in self.core.streams.values()}
            self._names = (self.core.metadata_version, names)
        return names.get(name)


class Deferred(abc.ABC):
    """A Kafka request the broker's core answers later: a Produce waiting for durability, a
    Fetch held until records arrive. The broker daemon calls `done` with the core's result
    where it would answer a kera request (kera.broker.server.BrokerDaemon.pump)."""
    __slots__ = ()

    @abc.abstractmethod
    def done(self, result) -> None:
        """Answer with the core's result (a KeraError when the whole request failed)."""


class Call:
    """One Kafka request being answered, now or later, in its connection's order."""
    __slots__ = ("conn", "req", "slot", "amend")

    def __init__(self, conn: Connection, req: KafkaRequest, slot: Slot):
        self.conn, self.req, self.slot = conn, req, slot
        # What authorization adds to the handler's answer: the entries it refused, the
        # throttle time (kera.broker.kafka.authorize); None: the answer as the handler gave it.
        self.amend: Callable[[dict], dict] | None = None

    @property
    def body(self):
        return self.req.body

    @property
    def version(self) -> int:
        return self.req.api_version

    def answer(self, data: dict | None) -> None:
        """Send the response described by `data` (kera.broker.kafka.messages.response); None
        sends nothing (a Produce with acks=0)."""
        if data is None:
            self.conn.fill(self.slot, SILENT)
            return
        if self.amend is not None:
            data = self.amend(data)
        entity = response(self.req.api_key, self.req.api_version, data)
        self.conn.fill(self.slot, encode_parts(self.req.correlation_id, entity))


class Gather:
    """Parts of one answer that arrive one by one (a coordinator call per topic or group),
    answered together, in request order, once the last is in."""
    __slots__ = ("results", "left", "finish")

    def __init__(self, count: int, finish: Callable[[list], None]):
        self.results: list = [None] * count
        self.left = count
        self.finish = finish
        if count == 0:
            finish([])

    def put(self, i: int, value) -> None:
        assert self.results[i] is None, "each part is answered once"
        self.results[i] = value
        self.left -= 1
        if self.left == 0:
            self.finish(self.results)
