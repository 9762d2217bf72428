"""Clients on the simulated network: producers, consumers and the admin that creates streams.

Producers and consumers are the real kera.producer.Producer and kera.consumer.Consumer: their
request threads (kera.client.request_thread: producer/sender.py, consumer/fetcher.py) and stream
caches (kera.client.stream_cache) are driven by the simulated process through kera.client.env (the
simulated clock, transports on this network, a wake-up that schedules an event, and `start`
adopting the request thread, whose `step` and `deliver` the process calls). Producers append
records numbered per (producer, stream, streamlet), so the checker can follow every record
through retries, re-identification and reads.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import random

from kera.client.env import ClientEnv
from kera.consumer import Consumer
from kera.errors import BadRequest, KeraError, UnknownStream
from kera.codec.schema import StreamInfo
from kera.net.coordinators import CoordinatorList
from kera.client.stream_cache import StreamCache
from kera.producer import Producer

from tests.sim.checker import Checker, InvariantBroken, record_value
from tests.sim.compaction import ID_HEADER, identity
from tests.sim.network import Network
from tests.sim.shell import SimHost, SimServer

COORDINATOR_REQUEST_TIMEOUT_S = 1.0
PRODUCER_RETRIES_MAX = 30   # a fault round must not fail chunks a healed cluster would take


class ClientMetadata:
    """The clients' kera.client.stream_cache.StreamCache, its requests sent on the simulated network
    the way kera.client.request_thread sends them."""

    def __init__(self, node: "Client", coordinator: str, on_update=None):
        self.node = node
        self.cache = StreamCache(CoordinatorList(coordinator), COORDINATOR_REQUEST_TIMEOUT_S)
        self.on_update = on_update
        self._known: set[str] = set()
        self.by_name = self.cache.by_name
        self.address_of = self.cache.address_of

    def refresh(self, name: str) -> None:
        self.cache.want(name, self.node.sched.now)
        self.pump()

    def pump(self) -> None:
        """Send the describe requests due now; wake when the next one is."""
        now = self.node.sched.now
        for req in self.cache.requests(now):
            req_id = self.node.send_request(req.address, "describe_stream", req.fields)
            self.cache.sent(req, req_id, now)
        self.node.wake_at(self.cache.next_wake(now))

    def on_reply(self, header: dict) -> bool:
        """Apply a coordinator reply; False if it was not one of ours (or came too late)."""
        found = self.cache.on_reply(header, self.node.sched.now)
        if found is None:
            return False
        name, result = found
        if isinstance(result, UnknownStream) and name in self._known:
            raise InvariantBroken(f"{self.node.name}: the coordinator forgot stream '{name}'")
        if isinstance(result, BadRequest):
            raise InvariantBroken(f"{self.node.name}: bad descriptor of '{name}': {result}")
        if isinstance(result, KeraError):
            self.pump()   # retried after the refresh interval (or not created yet: asked again)
            return True
        self._known.add(name)
        if self.on_update is not None:
            self.on_update(result)
        return True


class SimTransport:
    """kera.client.env.Transport on the simulated network: replies reach the node's
    on_client_reply."""

    def __init__(self, node: "Client", address: str):
        self.node, self.address = node, address

    def send(self, op: str, fields: dict | None = None, frames=(), timeout_s: float | None = None) -> int:
        return self.node.send_request(self.address, op, fields, frames)

    def close(self) -> None:
        pass


class SimWaker:
    """An application thread's wake-up: the request thread's next turn, as an event."""

    def __init__(self, node: "Client"):
        self.node = node

    def wake(self) -> None:
        self.node.wake_at(self.node.sched.now)

    def close(self) -> None:
        pass


def sim_env(node: "Client") -> ClientEnv:
    """The environment a real client gets inside simulated process `node`."""
    return ClientEnv(clock=lambda: node.sched.now,
                     connect=lambda address, timeout_s, key_file: SimTransport(node, address),
                     waker=lambda: SimWaker(node), start=node.adopt)


class Client(SimServer):
    """A client process: replies come to on_client_reply; `loop` runs after every event."""

    def __init__(self, net: Network, address: str, name: str, rng: random.Random,
                 checker: Checker, coordinator: str):
        host, port = address.split(":")
        super().__init__(name, SimHost(net, rng, host), int(port))
        self.name = name
        self.checker = checker
        self.coordinator = coordinator
        self._wake_at = math.inf
        self.meta = ClientMetadata(self, self.coordinator, self.on_metadata)
        self.engine = None   # a real client's request thread (kera.client.request_thread), if any

    def adopt(self, engine) -> None:
        """kera.client.env's `start`: this process runs the request thread's turns."""
        self.engine = engine

    def boot(self) -> None:
        pass

    def on_metadata(self, info: StreamInfo) -> None:
        pass

    def wake_at(self, t: float | None) -> None:
        """Make sure the loop runs at `t` (the request thread's poll timeout)."""
        if t is None:
            return
        now = self.sched.now
        if now < self._wake_at <= t:
            return
        self._wake_at = max(t, now)
        # At the absolute time: scheduled `after(t - now)`, the event could run a rounding
        # error before `t`; the loop then expired nothing, found `t` already booked, and
        # never woke again (seed 317: a producer's timed-out requests were never retried).
        self.schedule_at(self._wake_at, self._wake)

    def _wake(self) -> None:
        if self.sched.now >= self._wake_at:
            self._wake_at = math.inf
        self.meta.pump()
        self.loop()

    def loop(self) -> None:
        raise NotImplementedError


# ====================================================================== producer

class SimProducer(Client):
    """The real kera.producer.Producer, its request thread driven by this process
    (kera.client.env): the application sends numbered records to chosen streamlets."""

    def __init__(self, net, address, rng, checker, coordinator, *, client: int, producer_id: int,
                 streams: list[str], request_timeout_s: float, interval_s: float,
                 records_max: int, outstanding_max: int = 64, batch_max: int = 24):
        super().__init__(net, address, f"producer {client}", rng, checker, coordinator)
        self.client = client
        self.producer_id = producer_id
        self.streams = streams
        self.request_timeout_s = request_timeout_s
        self.interval_s = interval_s
        self.records_max = records_max
        self.outstanding_max = outstanding_max
        self.batch_max = batch_max
        self.producing = False
        self.records = 0
        self.next_n: dict[tuple[int, int], int] = {}
        # (stream id, streamlet) -> records sent and not settled yet
        self.outstanding: collections.Counter = collections.Counter()

    def start(self) -> None:
        self.boot()
        self.producer = Producer(self.coordinator, request_timeout_s=self.request_timeout_s,
                                 retries_max=PRODUCER_RETRIES_MAX, producer_id=self.producer_id,
                                 env=sim_env(self))
        self.cache = self.producer._meta.cache
        self.producing = True
        self.engine.want_describe(self.streams)
        self.wake_at(self.sched.now)
        self.schedule(self.rng.expovariate(1 / self.interval_s), self._app)

    # ------------------------------------------------------------------ the application
    def _app(self) -> None:
        if not self.producing:
            return
        known = [self.cache.by_name[n] for n in self.streams if n in self.cache.by_name]
        pending = sum(self.outstanding.values())
        if known and pending < self.outstanding_max and self.records < self.records_max:
            info = self.rng.choice(known)
            self._send_batch(info, self.rng.randrange(info.streamlets), self.rng.randint(1, self.batch_max))
        unknown = [n for n in self.streams if n not in self.cache.by_name]
        if unknown:
            self.engine.want_describe(unknown)
            self.wake_at(self.sched.now)
        self.schedule(self.rng.expovariate(1 / self.interval_s), self._app)

    def _send_batch(self, info: StreamInfo, sl: int, count: int) -> None:
        """Records numbered per (stream, streamlet), sent in order to streamlet `sl`."""
        key = (info.id, sl)
        first = self.next_n.get(key, 0)
        ts_us = int(self.sched.now * 1e6)
        for n in range(first, first + count):
            value = record_value(self.client, info.id, sl, n, self.rng.randrange(0, 48))
            self.outstanding[key] += 1
            self.producer.send(info.name, value, timestamp=ts_us, streamlet=sl,
                               on_delivery=functools.partial(self._settled, info.id, sl, n))
        self.next_n[key] = first + count
        self.records += count

    def _settled(self, sid: int, sl: int, n: int, error, metadata) -> None:
        self.outstanding[(sid, sl)] -= 1
        self.checker.producer_outcome(self.client, sid, sl, n, n + 1, error is None)

    # ------------------------------------------------------------------ the request thread
    def loop(self) -> None:
        if self.engine is not None:
            self.wake_at(self.engine.step())

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        self.engine.deliver([(src, header, frames)])
        self.loop()

    def idle(self, lost: set) -> bool:
        """Nothing left to send, but records for streamlets whose broker is gone for good."""
        return all(key in lost for key, n in self.outstanding.items() if n > 0)


class SimKeyedProducer(SimProducer):
    """A producer of keyed updates and deletes (a None value: a tombstone) to a compacted
    stream, each record's identity in a header (tests/sim/compaction.py), so that the ledger
    follows tombstones and superseded records too."""

    def __init__(self, *args, ledger, keys: int, tombstone_rate: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger = ledger
        self.keys = keys
        self.tombstone_rate = tombstone_rate

    def _send_batch(self, info: StreamInfo, sl: int, count: int) -> None:
        key = (info.id, sl)
        first = self.next_n.get(key, 0)
        ts_us = int(self.sched.now * 1e6)
        for n in range(first, first + count):
            k = b"k%d" % self.rng.randrange(self.keys)
            value = None if self.rng.random() < self.tombstone_rate else \
                record_value(self.client, info.id, sl, n, self.rng.randrange(0, 48))
            self.ledger.sending(self.client, info.id, sl, n, k, value)
            self.outstanding[key] += 1
            self.producer.send(info.name, value, key=k, timestamp=ts_us, streamlet=sl,
                               headers=[(ID_HEADER, identity(self.client, info.id, sl, n))],
                               on_delivery=functools.partial(self._settled, info.id, sl, n))
        self.next_n[key] = first + count
        self.records += count

    def _settled(self, sid: int, sl: int, n: int, error, metadata) -> None:
        super()._settled(sid, sl, n, error, metadata)
        if error is None:
            self.ledger.acked(self.client, sid, sl, n, getattr(metadata, "number", None))


# ====================================================================== consumer

class SimConsumer(Client):
    """The real kera.consumer.Consumer reading every streamlet of one stream from the earliest,
    its request thread driven by this process (kera.client.env); started once this process
    learnt the stream's descriptor (the Consumer's own first lookup would block)."""

    def __init__(self, net, address, rng, checker, coordinator, *, name: str, stream: str,
                 request_timeout_s: float, idle_wait_s: float, fetch_max_bytes: int):
        super().__init__(net, address, name, rng, checker, coordinator)
        self.stream = stream
        self.request_timeout_s = request_timeout_s
        self.idle_wait_s = idle_wait_s
        self.fetch_max_bytes = fetch_max_bytes
        self.consumer: Consumer | None = None
        self.errors: list = []

    @property
    def state(self):
        """The consumer's fetch bookkeeping (kera.consumer.fetching.FetchState), once started."""
        return None if self.consumer is None else self.consumer._fetch

    @property
    def stream_id(self) -> int:
        return self.state.stream_ids[self.stream]

    def start(self) -> None:
        self.boot()
        self.consumer = None
        self.meta.refresh(self.stream)
        self.every(COORDINATOR_REQUEST_TIMEOUT_S, self._startup)

    def _startup(self) -> None:
        if self.consumer is None:
            self.meta.refresh(self.stream)

    def on_metadata(self, info: StreamInfo) -> None:
        if self.consumer is None:
            now = self.sched.now
            env = dataclasses.replace(sim_env(self), prime=lambda m: m.cache.store(info, now))
            self.consumer = Consumer(self.coordinator, self.stream, start="earliest",
                                     fetch_max_bytes=self.fetch_max_bytes,
                                     request_timeout_s=self.request_timeout_s,
                                     fetch_wait_ms=self.idle_wait_s * 1000, env=env)
        self.loop()

    def loop(self) -> None:
        """The request thread's turn, then the application reads what it brought."""
        if self.engine is None or self.state.fatal:
            return
        self.wake_at(self.engine.step())

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        # Request ids are unique per process: a reply is the startup lookup's or the engine's.
        if not (src == self.coordinator and self.meta.on_reply(header)) and self.engine is not None:
            self.engine.deliver([(src, header, frames)])
            self._read()
        self.loop()

    def _read(self) -> None:
        sid = self.stream_id
        while True:
            try:
                batches = self.consumer.poll_batch(timeout_s=0.0)
            except KeraError as err:
                self.errors.append(err)
                return
            if not batches:
                return
            for b in batches:
                self._take(sid, b)

    def _take(self, sid: int, b) -> None:
        self.checker.consumed(self.name, sid, b.streamlet, b.chunk.values()[b.skip:])


class SimKeyedConsumer(SimConsumer):
    """A consumer of a compacted stream: its batches go to the keyed records' ledger
    (tests/sim/compaction.Ledger), gaps and tombstones included."""

    def __init__(self, *args, ledger, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    def _take(self, sid: int, b) -> None:
        self.ledger.consumed(self.name, sid, b.streamlet, b)


# ====================================================================== admin

class SimAdmin(Client):
    """Creates the run's streams, retrying until the coordinator has the daemons it needs."""

    RETRY_S = 0.2

    def __init__(self, net, address, rng, checker, coordinator, specs: list[dict]):
        super().__init__(net, address, "admin", rng, checker, coordinator)
        self.specs = specs
        self.created: dict[str, dict] = {}
        self._asked: dict[int, str] = {}

    def start(self) -> None:
        self.boot()
        self.every(self.RETRY_S, self.loop)

    def loop(self) -> None:
        self._asked.clear()   # a reply not back by now is lost: ask again
        for spec in self.specs:
            if spec["name"] not in self.created:
                self._asked[self.send_request(self.coordinator, "create_stream", spec)] = spec["name"]

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        name = self._asked.pop(header.get("id"), None)
        if name is None or name in self.created:
            return
        if header.get("ok") is True:
            self.created[name] = header["stream"]
        elif header.get("code") == "stream_exists":
            self.created[name] = {}    # an earlier attempt made it; its reply was lost
        elif header.get("code") != "not_ready":
            raise InvariantBroken(f"create_stream {name} refused: {header.get('code')}: "
                                  f"{header.get('message')}")

    def done(self) -> bool:
        return len(self.created) == len(self.specs)
