"""A client's stream descriptors, shared by its application threads and its request thread.

The knowledge itself is kera.client.stream_cache.StreamCache (sans-IO). This shell adds the blocking
lookups an application thread makes (`stream`, `refresh`: a `describe_stream` call on the
thread's own coordinator connection, since zmq sockets are not thread-safe) and the lock that
lets the request thread drive the same cache asynchronously (kera.client.request_thread).
"""

from __future__ import annotations

import threading
import time

from kera import config

from kera.net import rpc

from kera.codec import schema
from kera.errors import ClientClosed, UnknownStream
from kera.client.coordinator_client import CoordinatorClient
from kera.net.coordinators import CoordinatorList
from kera.client.stream_cache import StreamCache

# The descriptor and its parser are the wire schema's.
StreamInfo = schema.StreamInfo
parse_stream = schema.stream_descriptor


class Metadata:
    def __init__(self, bootstrap: str, *, timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
                 key_file: str | None = None,
                 max_age_s: float = config.DEFAULT_METADATA_MAX_AGE_MS / 1000):
        self.coordinators = CoordinatorList(bootstrap)   # shared by every thread's client
        self.timeout_s = timeout_s
        self.key_file = key_file   # CURVE key (kera.net.keys): None is $KERA_KEY_FILE or plaintext
        self.lock = threading.Lock()   # around every use of `cache`
        self.cache = StreamCache(self.coordinators, timeout_s, max_age_s=max_age_s)
        self._local = threading.local()
        self._conns: list[CoordinatorClient] = []
        self._closed = False

    # ------------------------------------------------------------------ lookups
    def stream(self, name: str) -> StreamInfo:
        """The cached descriptor, asking the coordinator on first use. Raises UnknownStream."""
        info = self.cache.by_name.get(name)
        return info if info is not None else self.refresh(name)

    def by_id(self, stream_id: int) -> StreamInfo | None:
        return self.cache.by_id.get(stream_id)

    def address_of(self, stream_id: int, streamlet: int) -> str | None:
        return self.cache.address_of(stream_id, streamlet)

    def refresh(self, name: str) -> StreamInfo:
        """Ask the coordinator now, from the calling thread. A stream that no longer exists is
        dropped from the cache and raises UnknownStream."""
        try:
            header, _ = self._conn().call("describe_stream", {"name": name})
        except UnknownStream as err:
            with self.lock:
                self.cache.forget(name)
            raise UnknownStream(err.message) from None   # with the coordinator's "did you mean"
        with self.lock:
            return self.cache.on_describe(name, header, time.monotonic())

    def call(self, op: str, fields: dict | None = None, timeout_s: float | None = None) -> tuple:
        """Any request of the leading coordinator, from the calling thread."""
        return self._conn().call(op, fields, timeout_s=timeout_s)

    def forget(self, name: str) -> None:
        with self.lock:
            self.cache.forget(name)

    # ------------------------------------------------------------------ connections
    @property
    def coordinator(self) -> str:
        """The coordinator asked now (the leader, once one answered)."""
        return self.coordinators.current

    def _conn(self) -> CoordinatorClient:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise ClientClosed("metadata cache is closed")
            conn = CoordinatorClient("", timeout_s=self.timeout_s, key_file=self.key_file,
                                     coordinators=self.coordinators)
            self._local.conn = conn
            with self.lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Close every thread's coordinator connection; call once the threads are done."""
        self._closed = True
        with self.lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
