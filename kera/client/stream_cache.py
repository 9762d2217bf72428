"""What a client knows of streams, and the `describe_stream` requests that keep it fresh. Sans-IO.

Every client (producer, consumer, the Spark reader and sink, the simulation's clients) keeps
one StreamCache. Lookups are plain dict reads. A refresh is *wanted* (a broker said
`not_owner`, a request timed out, a read met an unknown stream, or its descriptor is older
than `max_age_s`: a streamlet count may have been raised); `requests` turns wanted names
into `describe_stream` requests for the owner to send, at most one in flight per name and at
most one per name every `refresh_interval_s_min` (a burst of refused chunks must not flood the
coordinator); `on_reply` applies the answer. A blocking caller uses `on_describe` directly
(kera.client.metadata.Metadata). The clock is passed in; nothing here touches a socket or a thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kera import config

from kera.codec import schema

from kera.codec import wire
from kera.net.coordinators import CoordinatorList
from kera.errors import BadRequest, KeraError, Timeout, UnknownStream

log = logging.getLogger(__name__)

# A stream's descriptor is asked for again at most this often when refreshes pile up.
REFRESH_INTERVAL_S_MIN = 0.05

StreamInfo = schema.StreamInfo


@dataclass(frozen=True)
class Describe:
    """A `describe_stream` request to send to `address`."""
    name: str
    address: str

    @property
    def fields(self) -> dict:
        return {"name": self.name}


class StreamCache:
    def __init__(self, coordinators: CoordinatorList, request_timeout_s: float,
                 refresh_interval_s_min: float = REFRESH_INTERVAL_S_MIN,
                 max_age_s: float = config.DEFAULT_METADATA_MAX_AGE_MS / 1000):
        if max_age_s <= 0:
            raise ValueError(f"metadata max age must be positive, not {max_age_s} s")
        self.coordinators = coordinators   # asked in turn until the leader answers
        self.request_timeout_s = request_timeout_s
        self.refresh_interval_s_min = refresh_interval_s_min
        self.max_age_s = max_age_s         # every known stream is asked about again this often
        self._aged_at = float("inf")       # when the oldest descriptor reaches max_age_s
        self.by_name: dict[str, StreamInfo] = {}
        self.by_id: dict[int, StreamInfo] = {}
        self._fetched_at: dict[str, float] = {}
        self._wanted: dict[str, float] = {}            # name -> not before (monotonic s)
        self._asked: dict[int, tuple[str, float, str]] = {}  # request id -> (name, deadline, address)

    # ------------------------------------------------------------------ lookups
    def get(self, name: str) -> StreamInfo | None:
        return self.by_name.get(name)

    def address_of(self, stream_id: int, streamlet: int) -> str | None:
        info = self.by_id.get(stream_id)
        return None if info is None else info.address_of(streamlet)

    # ------------------------------------------------------------------ asynchronous refresh
    def want(self, name: str, now: float) -> None:
        """Ask about `name` again soon (no sooner than the refresh interval after the last)."""
        not_before = self._fetched_at.get(name, -1e18) + self.refresh_interval_s_min
        self._wanted[name] = min(self._wanted.get(name, not_before), not_before)

    def requests(self, now: float) -> list[Describe]:
        """The describe requests due now; report each as `sent` (or `failed`)."""
        self._expire(now)
        self._age_out(now)
        asking = {a[0] for a in self._asked.values()}
        due = [n for n, t in self._wanted.items() if t <= now and n not in asking]
        for name in due:
            del self._wanted[name]
        return [Describe(name, self.coordinators.current) for name in sorted(due)]

    def sent(self, req: Describe, req_id: int, now: float) -> None:
        self._asked[req_id] = (req.name, now + self.request_timeout_s, req.address)

    def failed(self, req: Describe, now: float) -> None:
        """The request could not be sent: ask again after the refresh interval."""
        self.coordinators.failed(req.address, Timeout(f"{req.address} took no request"))
        self._wanted.setdefault(req.name, now + self.refresh_interval_s_min)

    def on_reply(self, header: dict, now: float) -> tuple[str, StreamInfo | KeraError] | None:
        """Apply a coordinator reply: (name, new descriptor or the error for that name), or None
        if the reply is not to one of our requests (or came after its deadline). A retriable
        error is asked again after the refresh interval."""
        asked = self._asked.pop(header.get("id"), None)
        if asked is None:
            return None
        name, _, address = asked
        try:
            return name, self.on_describe(name, header, now)
        except KeraError as err:
            self.coordinators.failed(address, err)   # a standby: ask the next one
            if err.retriable:
                self._wanted.setdefault(name, now + self.refresh_interval_s_min)
            return name, err

    def next_wake(self, now: float) -> float | None:
        """When `requests` next has something to do (a wanted name, a request's deadline)."""
        asking = {a[0] for a in self._asked.values()}
        times = [t for n, t in self._wanted.items() if n not in asking]
        times += [a[1] for a in self._asked.values()]
        if self._aged_at != float("inf"):
            times.append(self._aged_at)
        return min(times) if times else None

    def _age_out(self, now: float) -> None:
        """Want every descriptor older than max_age_s (scanned only when the oldest is due)."""
        if now < self._aged_at:
            return
        # `fetched + max_age` exactly as `_aged_at` is computed: `now - max_age` may round
        # the other way, leave the oldest name not due at its own due time, and spin.
        for name, fetched in self._fetched_at.items():
            if fetched + self.max_age_s <= now:
                self._wanted.setdefault(name, now)
        later = [t + self.max_age_s for t in self._fetched_at.values() if t + self.max_age_s > now]
        # Names just wanted are looked at again after another max age if no reply comes.
        self._aged_at = min(later, default=now + self.max_age_s)

    def _expire(self, now: float) -> None:
        for req_id in [r for r, a in self._asked.items() if a[1] <= now]:
            name, _, address = self._asked.pop(req_id)
            log.info("no describe_stream reply for '%s' from %s within %.1f s; asking again",
                     name, address, self.request_timeout_s)
            self.coordinators.failed(address, Timeout(f"no reply from {address}"))
            self._wanted.setdefault(name, now)

    # ------------------------------------------------------------------ replies
    def on_describe(self, name: str, header: dict, now: float) -> StreamInfo:
        """Apply a `describe_stream` reply for `name` and return the descriptor; raises the
        reply's error (UnknownStream forgets the stream) or BadRequest for a garbled one."""
        try:
            wire.raise_for_reply(header)
        except UnknownStream:
            self.forget(name)
            raise UnknownStream(f"no stream named '{name}'") from None
        info = schema.stream_descriptor(header.get("stream"))
        if info.name != name:
            raise BadRequest(f"asked for stream '{name}', coordinator described '{info.name}'")
        self.store(info, now)
        return info

    def store(self, info: StreamInfo, now: float) -> None:
        old = self.by_name.get(info.name)
        if old is not None and old.id != info.id:
            self.by_id.pop(old.id, None)
        self.by_name[info.name] = info
        self.by_id[info.id] = info
        self._fetched_at[info.name] = now
        self._aged_at = min(self._aged_at, now + self.max_age_s)
        if old is None or old.version != info.version:
            log.debug("stream '%s' (id %d) at version %d: placement %s", info.name, info.id,
                      info.version, info.placement)

    def forget(self, name: str) -> None:
        old = self.by_name.pop(name, None)
        if old is not None:
            self.by_id.pop(old.id, None)
        self._fetched_at.pop(name, None)
