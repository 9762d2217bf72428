"""The latency histograms a broker's shell observes (kera.broker.server), when metrics are served.

Each is observed once per request on the daemon's monotonic clock, at the shell, never in the
sans-IO core: produce from the handler's start to its reply (for a request that waits for its
backups, the reply sent once durable); fetch from the handler's start to its reply, labelled
`held` when it waited for new records; replication from a write's send to its backup's ack.
Requests of kera's own protocol only: the Kafka listener's are not timed.
"""

from __future__ import annotations

from kera.broker.kafka.context import Deferred
from kera.daemon.metrics import DaemonMetrics
from kera.errors import KeraError


class BrokerLatency:
    """The broker's histograms in its DaemonMetrics registry."""

    def __init__(self, metrics: DaemonMetrics):
        self.produce = metrics.histogram(
            "produce_latency_seconds", "a produce request from its arrival to its reply (for "
            "acks, once every chunk is durable)")
        fetch_doc = ("a fetch request from its arrival to its reply; held: it waited for new "
                     "records (wait_ms)")
        self.fetch = metrics.histogram("fetch_latency_seconds", fetch_doc, held="false")
        self.fetch_held = metrics.histogram("fetch_latency_seconds", fetch_doc, held="true")
        self.replication = metrics.histogram(
            "replication_latency_seconds", "a replication write from its send to a backup to "
            "that backup's ack")


class ProduceReply(Deferred):
    """A produce request the core answers once durable (BrokerDaemon.pump calls `done`): the
    reply, then its latency since `started_s`."""
    __slots__ = ("server", "req", "clock", "started_s", "histogram")

    def __init__(self, server, req, clock, started_s: float, histogram):
        self.server, self.req, self.clock = server, req, clock
        self.started_s, self.histogram = started_s, histogram

    def done(self, result) -> None:
        if isinstance(result, KeraError):
            self.server.fail(self.req, result)
        else:
            self.server.reply(self.req, {"results": result})
        self.histogram.observe(self.clock.monotonic() - self.started_s)
