"""Staying registered with the coordinator: register until it answers, then heartbeat.

Runs on the server loop through a kera.server.Peer: one request in flight at a time, each with a
timeout, so a dead or slow coordinator never blocks the loop; the daemon serves requests all the
while. The daemon's identity travels as `daemon_id` (docs/PROTOCOL.md). A heartbeat answered
with an error (the coordinator restarted and does not know this id: `not_ready`) makes it
register again, asking for the same id. Every register presents what the daemon remembers of
its identity (cluster id, incarnation token: kera.identity) and every heartbeat the token; a
refusal of that identity (`id_in_use`, `wrong_cluster`) is fatal: `on_fatal` stops the daemon.
"""

from __future__ import annotations

import logging
from typing import Callable

from kera import config, schema
from kera.coordinator_peer import CoordinatorPeer
from kera.errors import Fenced, IdInUse, KeraError, NotAuthorized, NotLeader, Timeout, WrongCluster
from kera.identity import Identity
from kera.interval_timer import IntervalTimer
from kera.server import Server

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 1.0
# A heartbeat is given up after this many heartbeat intervals (as a broker's, see
# kera.broker.server), not after REQUEST_TIMEOUT_S: with one request in flight at a time, two
# lost heartbeats of 1 s each would outlast the coordinator's dead window (20 x 100 ms).
HEARTBEAT_TIMEOUT_INTERVALS = 3


class Registration:
    def __init__(self, server: Server, coordinator: str, kind: str, address: str, node: str,
                 daemon_id: int | None = None, stats: Callable[[], dict] | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S,
                 fields: Callable[[], dict] | None = None,
                 on_heartbeat: Callable[[dict], None] | None = None,
                 identity: Identity | None = None,
                 on_fatal: Callable[[KeraError], None] | None = None):
        self.kind = kind
        self.address = address
        self.node = node
        self.id = daemon_id
        self.registered = False
        self.identity = identity or Identity()
        self._on_fatal = on_fatal          # the coordinator refused this daemon's identity
        self.fatal = False
        self.heartbeat_interval_s = config.HEARTBEAT_INTERVAL_S
        self.registrations = 0
        self.heartbeats = 0
        self._stats = stats
        self._fields = fields              # more heartbeat fields (e.g. `held`)
        self._on_heartbeat_reply = on_heartbeat   # gets each heartbeat reply's header
        self._timeout_s = timeout_s
        self._server = server
        self._peer = CoordinatorPeer(server, coordinator)   # follows the leader
        self._busy = False
        self._unreachable_logged = False
        self._timer = IntervalTimer(server, self.tick)
        self._timer.arm(self.heartbeat_interval_s)

    def tick(self) -> None:
        if self._busy:
            return
        if not self.registered:
            fields = {"kind": self.kind, "address": self.address, "node": self.node,
                      **self.identity.register_fields(self.id)}
            if self.id is not None:
                fields["daemon_id"] = self.id
            self._send("register", fields, self._on_registered)
            return
        fields = {"kind": self.kind, "daemon_id": self.id, "metadata_version": 0,
                  "token": self.identity.token}
        if self._stats is not None:
            fields["stats"] = self._stats()
        if self._fields is not None:
            fields.update(self._fields())
        self._send("heartbeat", fields, self._on_heartbeat, self.heartbeat_timeout_s)

    @property
    def heartbeat_timeout_s(self) -> float:
        return min(self._timeout_s, HEARTBEAT_TIMEOUT_INTERVALS * self.heartbeat_interval_s)

    def _send(self, op: str, fields: dict, callback, timeout_s: float | None = None) -> None:
        self._busy = True
        self._peer.request(op, fields, (), self._timeout_s if timeout_s is None else timeout_s,
                           callback)

    def _on_registered(self, header, frames, err: KeraError | None) -> None:
        self._busy = False
        if self._fatal(err):
            return
        if err is not None:
            self._unreachable(f"register failed: {err.code}: {err.message}", err)
            return
        try:
            reply = schema.register_reply(header)
            daemon_id = reply.daemon_id
            interval_ms = reply.heartbeat_interval_ms or config.HEARTBEAT_INTERVAL_S * 1000
            self.identity.registered(daemon_id, reply.token, reply.cluster_id)
        except (KeraError, ValueError) as bad:
            log.error("coordinator sent a bad register reply: %s", bad)
            return
        self.id = daemon_id
        if interval_ms / 1000 != self.heartbeat_interval_s:
            self.heartbeat_interval_s = interval_ms / 1000
            self._timer.arm(self.heartbeat_interval_s)  # the coordinator's interval, not our default
        self.registered = True
        self.registrations += 1
        self._unreachable_logged = False
        log.info("registered with the coordinator as %s %d", self.kind, self.id)

    def _on_heartbeat(self, header, frames, err: KeraError | None) -> None:
        self._busy = False
        if err is None:
            self.heartbeats += 1
            self._unreachable_logged = False
            if self._on_heartbeat_reply is not None:
                self._on_heartbeat_reply(header)
            return
        if isinstance(err, (Timeout, NotLeader, Fenced)):
            # No answer, or a standby / deposed coordinator: the next tick asks the next one
            # (kera.coordinator_peer), which knows this daemon if it leads now.
            self._unreachable(f"heartbeat failed: {err.code}", err)
            return
        if self._fatal(err):
            return
        # The coordinator answered but does not take this heartbeat (typically `not_ready`:
        # it restarted and forgot us): register again under the same id.
        log.warning("coordinator refused a heartbeat (%s: %s); registering again", err.code, err.message)
        self.registered = False

    def _fatal(self, err: KeraError | None) -> bool:
        """Is `err` a refusal of this daemon's identity? Then it must stop (and does, through
        `on_fatal`): another process holds its id, or it holds data of another cluster."""
        if not isinstance(err, (IdInUse, WrongCluster, NotAuthorized)):
            return False
        log.error("the coordinator %s refused this %s's identity (%s): %s; stopping, nothing "
                  "deleted", self._peer.address, self.kind, err.code, err.message)
        self._busy = True   # no further request
        self.fatal = True
        if self._on_fatal is not None:
            self._on_fatal(err)
        return True

    def _unreachable(self, what: str, err: KeraError) -> None:
        level = logging.DEBUG if self._unreachable_logged else logging.WARNING
        log.log(level, "coordinator %s: %s", self._peer.address, what)
        self._unreachable_logged = True
