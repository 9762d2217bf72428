"""Client-side cache of stream descriptors, fetched from the coordinator with `describe_stream`.

Producers and consumers ask it where a streamlet lives (the owning broker's address) and
refresh an entry when a broker answers `not_owner` or `unknown_stream`. It may be used from
several threads: each thread talks to the coordinator on its own connection (zmq sockets are
not thread-safe), and the cache itself is replaced entry by entry under a lock.
"""

from __future__ import annotations

import logging
import threading
import time

from kera import rpc, schema
from kera.errors import BadRequest, UnknownStream

log = logging.getLogger(__name__)

# A stream's descriptor is asked for again at most this often when refreshes pile up (many
# chunks refused with not_owner at once must not flood the coordinator).
REFRESH_INTERVAL_S_MIN = 0.05


# The descriptor and its parser are the wire schema's.
StreamInfo = schema.StreamInfo
parse_stream = schema.stream_descriptor


class Metadata:
    def __init__(self, bootstrap: str, *, timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
                 key_file: str | None = None):
        from kera.admin import parse_bootstrap

        self.coordinator = parse_bootstrap(bootstrap)
        self.timeout_s = timeout_s
        self.key_file = key_file   # CURVE key (kera.keys): None is $KERA_KEY_FILE or plaintext
        self._lock = threading.Lock()
        self._by_name: dict[str, StreamInfo] = {}
        self._by_id: dict[int, StreamInfo] = {}
        self._fetched_at: dict[str, float] = {}
        self._local = threading.local()
        self._conns: list[rpc.Connection] = []
        self._closed = False

    # ------------------------------------------------------------------ lookups
    def stream(self, name: str) -> StreamInfo:
        """The cached descriptor, asking the coordinator on first use. Raises UnknownStream."""
        info = self._by_name.get(name)
        return info if info is not None else self.refresh(name)

    def by_id(self, stream_id: int) -> StreamInfo | None:
        return self._by_id.get(stream_id)

    def address_of(self, stream_id: int, streamlet: int) -> str | None:
        info = self._by_id.get(stream_id)
        return None if info is None else info.address_of(streamlet)

    def refresh(self, name: str, *, interval_s_min: float = 0.0) -> StreamInfo:
        """Ask the coordinator again (unless asked less than `interval_s_min` ago). A stream
        that no longer exists is dropped from the cache and raises UnknownStream."""
        if interval_s_min > 0:
            info = self._by_name.get(name)
            if info is not None and time.monotonic() - self._fetched_at.get(name, 0.0) < interval_s_min:
                return info
        try:
            header, _ = self._conn().call("describe_stream", {"name": name})
        except UnknownStream:
            self.forget(name)
            raise UnknownStream(f"no stream named '{name}'") from None
        info = parse_stream(header.get("stream"))
        if info.name != name:
            raise BadRequest(f"asked for stream '{name}', coordinator described '{info.name}'")
        with self._lock:
            old = self._by_name.get(name)
            if old is not None and old.id != info.id:
                self._by_id.pop(old.id, None)
            self._by_name[name] = info
            self._by_id[info.id] = info
            self._fetched_at[name] = time.monotonic()
        if old is None or old.version != info.version:
            log.debug("stream '%s' (id %d) at version %d: placement %s", name, info.id,
                      info.version, info.placement)
        return info

    def forget(self, name: str) -> None:
        with self._lock:
            old = self._by_name.pop(name, None)
            if old is not None:
                self._by_id.pop(old.id, None)
            self._fetched_at.pop(name, None)

    # ------------------------------------------------------------------ connections
    def _conn(self) -> rpc.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                from kera.errors import ClientClosed
                raise ClientClosed("metadata cache is closed")
            conn = rpc.Connection(self.coordinator, timeout_s=self.timeout_s, key_file=self.key_file)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Close every thread's coordinator connection; call once the threads are done."""
        self._closed = True
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
