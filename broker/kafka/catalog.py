"""What the Kafka listener knows of the cluster: every topic (a kera stream) and every broker's
Kafka address, as the coordinator last listed them; and the calls it makes to the coordinator.

Metadata, ListOffsets and the admin APIs name topics this broker may not own, so the catalog
lists all streams (`list_streams`, page by page) when its copy is older than
`CATALOG_MAX_AGE_S` and a request needs it; requests that arrive meanwhile wait for that one
listing. Brokers' Kafka addresses come with the `cluster` replies the broker asks for anyway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kera.codec import schema
from kera.errors import BadRequest, KeraError

log = logging.getLogger(__name__)

# How old the list of topics may be when a Metadata request reads it: a topic created through
# another broker or kera's own Admin is seen within this, and a metadata storm of many clients
# costs one listing per interval, not one per request.
CATALOG_MAX_AGE_S = 1.0
# A call to the coordinator (listing, create, delete) is given up after this long.
COORDINATOR_CALL_TIMEOUT_S = 10.0
# Pages of `list_streams` one listing follows (the coordinator holds at most 10,000 streams,
# up to 1,000 a page).
LISTING_PAGES_MAX = 64


@dataclass(frozen=True, slots=True)
class KafkaBroker:
    node_id: int
    host: str
    port: int


class CoordinatorCalls:
    """Request/reply calls to the leading coordinator over the daemon's peers, errors given to
    the caller (a CoordinatorLink call only logs them)."""

    def __init__(self, server, leader_address: Callable[[], str]):
        self.server = server
        self.leader_address = leader_address

    def call(self, op: str, fields: dict, done: Callable[[dict | None, KeraError | None], None]) -> None:
        def reply(header, frames, error):
            done(header if error is None else None, error)

        peer = self.server.peer(self.leader_address())
        peer.request(op, fields, [], COORDINATOR_CALL_TIMEOUT_S, reply)


class Catalog:
    def __init__(self, calls: CoordinatorCalls, clock):
        self.calls = calls
        self.clock = clock
        self.brokers: dict[int, KafkaBroker] = {}
        self.topics: dict[str, schema.StreamInfo] = {}
        self.settings: dict[str, dict] = {}    # name -> its descriptor as listed (retention...)
        self.listed_at = float("-inf")
        self._waiting: list[Callable[[KeraError | None], None]] = []
        self._pages: list = []

    # ------------------------------------------------------------------ brokers
    def update_brokers(self, entries) -> None:
        """From a `cluster` reply: the live brokers that run a Kafka listener."""
        if not isinstance(entries, list):
            return
        brokers = {}
        for e in entries:
            address = e.get("kafka_address") if isinstance(e, dict) else None
            if e.get("alive") and isinstance(address, str) and isinstance(e.get("id"), int):
                host, _, port = address.rpartition(":")
                brokers[e["id"]] = KafkaBroker(e["id"], host.strip("[]"), int(port))
        self.brokers = brokers

    # ------------------------------------------------------------------ topics
    def fresh(self, then: Callable[[KeraError | None], None], max_age_s: float = CATALOG_MAX_AGE_S) -> None:
        """Run `then(None)` once the topic list is at most `max_age_s` old (now, or after a
        listing), `then(error)` when the listing failed."""
        if self.clock.monotonic() - self.listed_at <= max_age_s:
            then(None)
            return
        self._waiting.append(then)
        if len(self._waiting) == 1:
            self._pages = []
            self._list(None)

    def forget(self) -> None:
        """The next request lists again (after a create or delete)."""
        self.listed_at = float("-inf")

    def _list(self, after: str | None) -> None:
        fields = {} if after is None else {"after": after}
        self.calls.call("list_streams", fields, self._page)

    def _page(self, header: dict | None, error: KeraError | None) -> None:
        if error is None:
            try:
                self._pages.extend((schema.stream_descriptor(d), d) for d in header.get("streams", []))
            except (KeraError, AttributeError, TypeError) as exc:
                error = BadRequest(f"malformed list_streams reply: {exc}")
        after = header.get("next") if error is None else None
        if isinstance(after, str) and len(self._pages) < LISTING_PAGES_MAX * 1000:
            self._list(after)
            return
        if error is None:
            self.topics = {info.name: info for info, _ in self._pages}
            self.settings = {info.name: d for info, d in self._pages}
            self.listed_at = self.clock.monotonic()
        else:
            log.warning("kafka listener: listing topics failed: %s", error)
        waiting, self._waiting = self._waiting, []
        for then in waiting:
            then(error)

