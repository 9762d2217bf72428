"""The Kafka listener's shell: a TCP socket on the broker's loop, accepting connections and
handing each whole request to its API (kera.broker.kafka.apis).

A request that cannot be answered as Kafka would (an API or version not advertised, bytes
that do not decode) closes its connection, as a Kafka broker does; an ApiVersions request of
a version not supported is answered with UNSUPPORTED_VERSION and the versions that are, so
the client can retry with one of them. Connections are bounded in number, in all and per
client address, and each bounds its own memory (kera.broker.kafka.connection).

A secure cluster's listener is SASL_SSL only: every connection is TLS, logs in with SASL
(kera.broker.kafka.sasl) within LOGIN_TIMEOUT_S or is closed, and each request is then
authorized against kera's ACLs and quotas (kera.broker.kafka.authorize).
"""

from __future__ import annotations

import logging
import socket

import zmq

from kio.schema.errors import ErrorCode

from kera.broker.kafka import apis, authorize, sasl
from kera.broker.kafka.connection import Connection
from kera.broker.kafka.context import Call, Context
from kera.broker.kafka.messages import (UnsupportedVersion, decode_request, encode_response,
                                        peek_key_version, response)
from kera.errors import BadRequest

log = logging.getLogger(__name__)

# Open Kafka connections per broker: each holds a descriptor and up to its reply and request
# bounds in memory; Kafka clients keep one or two per broker.
CONNECTIONS_MAX = 4096
# Open connections from one client address: one misbehaving host cannot take them all.
CONNECTIONS_PER_SOURCE_MAX = 1024
ACCEPT_BACKLOG = 128
# Connections taken per readiness event of the listening socket.
ACCEPTS_PER_EVENT = 64
# How often connections still logging in are checked against sasl.LOGIN_TIMEOUT_S.
LOGIN_CHECK_INTERVAL_S = 1.0


class KafkaListener:
    def __init__(self, server, ctx: Context, host: str, port: int):
        self.server = server
        self.ctx = ctx
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(ACCEPT_BACKLOG)
        self.sock.setblocking(False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.connections: set[Connection] = set()
        self.per_source: dict[str, int] = {}
        server.watch(self.sock.fileno(), self._accept, zmq.POLLIN)
        self.security = ctx.settings.security
        if self.security is not None:
            server.every(LOGIN_CHECK_INTERVAL_S, self._close_stalled)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self, mask: int) -> None:
        for _ in range(ACCEPTS_PER_EVENT):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:   # out of descriptors: the client retries
                log.warning("kafka listener: accept failed: %s", exc)
                return
            self._admit(sock, addr[0], f"{addr[0]}:{addr[1]}")

    def _admit(self, sock: socket.socket, source: str, peer: str) -> None:
        if len(self.connections) >= CONNECTIONS_MAX or \
                self.per_source.get(source, 0) >= CONNECTIONS_PER_SOURCE_MAX:
            log.warning("kafka listener: refused a connection from %s (%d open, %d from it)",
                        peer, len(self.connections), self.per_source.get(source, 0))
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = None if self.security is None else self.security.tls
        try:
            conn = Connection(sock, peer, self.server, self._on_frame, self._on_close, tls)
        except OSError as exc:   # gone before TLS could wrap it
            log.info("kafka listener: dropped a connection from %s: %s", peer, exc)
            sock.close()
            return
        conn.state["source"] = source
        conn.state["opened_s"] = self.ctx.clock.monotonic()
        self.connections.add(conn)
        self.per_source[source] = self.per_source.get(source, 0) + 1

    def _close_stalled(self) -> None:
        """Close connections that have not logged in within sasl.LOGIN_TIMEOUT_S (a TLS
        handshake or a SASL exchange that stalls)."""
        now = self.ctx.clock.monotonic()
        for conn in [c for c in self.connections if sasl.expired(c, now)]:
            log.info("kafka listener: closing %s: no login within %.0f s", conn.peer,
                     sasl.LOGIN_TIMEOUT_S)
            conn.close("no login in time")

    def _on_close(self, conn: Connection) -> None:
        self.connections.discard(conn)
        source = conn.state["source"]
        self.per_source[source] -= 1
        if not self.per_source[source]:
            del self.per_source[source]
        for forget in conn.state.get("on_close", ()):
            forget()

    def _on_frame(self, conn: Connection, frame: bytes) -> None:
        try:
            req = decode_request(frame, apis.supported)
        except UnsupportedVersion as exc:
            self._unsupported(conn, frame, exc)
            return
        except BadRequest as exc:
            log.info("kafka listener: closing %s: %s", conn.peer, exc.message)
            conn.close(exc.message)
            return
        if not sasl.admit(self.ctx, conn, req.api_key):
            return
        call = Call(conn, req, conn.reserve())
        if authorize.admit(self.ctx, call):
            apis.dispatch(self.ctx, call)

    def _unsupported(self, conn: Connection, frame: bytes, exc: UnsupportedVersion) -> None:
        key, version, correlation_id = peek_key_version(frame)
        if key != apis.API_VERSIONS:
            log.info("kafka listener: closing %s: %s", conn.peer, exc.message)
            conn.close(exc.message)
            return
        # Kafka answers with a v0 ApiVersions response, which every client can read.
        entity = response(apis.API_VERSIONS, 0, apis.api_versions(ErrorCode.unsupported_version))
        conn.fill(conn.reserve(), encode_response(correlation_id, entity))

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close("the broker is stopping")
        self.server.unwatch(self.sock.fileno())
        self.sock.close()
