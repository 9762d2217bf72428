"""A daemon's session with the leading coordinator, sans-IO: what to send when, and what each
answer means. Brokers and backups share it; kera.daemon.coordinator_link runs it on a server loop.

A daemon registers until the coordinator answers, then heartbeats every interval the register
reply names (HEARTBEAT_MS_MIN..HEARTBEAT_MS_MAX, else the daemon's own). Each op has at most one
request in flight, so a slow coordinator never piles requests up. An answer is one `Verdict`:

- no answer, `not_leader` or `fenced`: UNREACHABLE. The link has moved on to the next
  coordinator of the bootstrap list, which knows this daemon if it leads now;
- a refusal of the daemon's identity (`id_in_use`, `wrong_cluster`, `not_authorized`): FATAL,
  the daemon stops, nothing deleted;
- a heartbeat the coordinator does not know (`not_ready`: it restarted, or this incarnation
  was failed over): REGISTER, under the same id;
- a refusal of a request sent under the previous incarnation's token (a heartbeat overlapping a
  register): STALE, it says nothing about this incarnation;
- any other error: REFUSED, for the daemon to handle (a broker refetches its metadata when a
  heartbeat's metadata version is refused).
"""

from __future__ import annotations

import enum

from kera import config
from kera.errors import (Fenced, IdInUse, KeraError, NotAuthorized, NotLeader, NotReady, Timeout,
                         WrongCluster)
from kera.daemon.identity import Identity

# Heartbeat intervals accepted from the coordinator's register reply: 5 ms keeps a daemon's
# loop from spinning on heartbeats, 60 s bounds how long a dead daemon goes unnoticed.
HEARTBEAT_MS_MIN = 5
HEARTBEAT_MS_MAX = 60_000
# A request other than a heartbeat (register, metadata listings) is given up after this long;
# equal to the coordinator's default dead window (20 x 100 ms).
REQUEST_TIMEOUT_S = 2.0
# A heartbeat is given up after this many heartbeat intervals instead: with one in flight at a
# time, two lost heartbeats of REQUEST_TIMEOUT_S each would outlast the dead window; after one
# lost heartbeat the next ones must still reach the coordinator in time (found by tests/sim).
HEARTBEAT_TIMEOUT_INTERVALS = 3

_UNREACHABLE = (Timeout, NotLeader, Fenced)
_IDENTITY_REFUSED = (IdInUse, WrongCluster, NotAuthorized)


class Verdict(enum.Enum):
    OK = "ok"
    STALE = "stale"
    UNREACHABLE = "unreachable"
    REGISTER = "register"
    FATAL = "fatal"
    REFUSED = "refused"


class CoordinatorSession:
    """One daemon's session: `kind` ("broker", "backup"), advertised `address`, `node`."""

    def __init__(self, kind: str, address: str, node: str, identity: Identity,
                 daemon_id: int | None = None,
                 heartbeat_interval_s: float = config.HEARTBEAT_INTERVAL_S,
                 register_extra: dict | None = None):
        self.kind = kind
        self.register_extra = register_extra or {}   # e.g. a broker's `kafka_address`
        self.address = address
        self.node = node
        self.identity = identity
        self.wanted_id = daemon_id        # the id to (re-)register with
        self.registered = False
        self.fatal = False
        self.heartbeat_interval_s = heartbeat_interval_s
        self.in_flight: set[str] = set()
        self.registrations = 0
        self.heartbeats = 0

    def due(self) -> str | None:
        """The session request to send at a heartbeat tick: "register" until registered,
        then "heartbeat"; None while the previous one is in flight or after a fatal refusal."""
        op = "heartbeat" if self.registered else "register"
        return None if self.fatal or op in self.in_flight else op

    def register_fields(self) -> dict:
        fields = {"kind": self.kind, "address": self.address, "node": self.node,
                  **self.identity.register_fields(self.wanted_id), **self.register_extra}
        if self.wanted_id is not None:
            fields["daemon_id"] = self.wanted_id
        return fields

    def heartbeat_fields(self) -> dict:
        return {"kind": self.kind, "daemon_id": self.wanted_id, "token": self.identity.token}

    def timeout_s(self, op: str) -> float:
        if op == "heartbeat":
            return min(REQUEST_TIMEOUT_S, HEARTBEAT_TIMEOUT_INTERVALS * self.heartbeat_interval_s)
        return REQUEST_TIMEOUT_S

    def begin(self, op: str) -> bool:
        """Mark `op` sent; False (send nothing) while one is in flight already."""
        if op in self.in_flight or self.fatal:
            return False
        self.in_flight.add(op)
        return True

    def answered(self, op: str, error: KeraError | None, sent_token: str | None) -> Verdict:
        """`op`'s answer (`error` None: a reply), sent while the token was `sent_token`."""
        self.in_flight.discard(op)
        if error is None:
            self.heartbeats += op == "heartbeat"
            return Verdict.OK
        if sent_token != self.identity.token:
            return Verdict.STALE
        if isinstance(error, _UNREACHABLE):
            return Verdict.UNREACHABLE
        if isinstance(error, _IDENTITY_REFUSED):
            self.fatal = True
            return Verdict.FATAL
        if op == "heartbeat" and isinstance(error, NotReady):
            self.registered = False
            return Verdict.REGISTER
        return Verdict.REFUSED

    def registered_as(self, daemon_id: int, heartbeat_interval_ms: int | None) -> bool:
        """A register reply was taken: True when the heartbeat interval changed."""
        self.wanted_id = daemon_id
        self.registered = True
        self.registrations += 1
        if heartbeat_interval_ms is None or \
                not HEARTBEAT_MS_MIN <= heartbeat_interval_ms <= HEARTBEAT_MS_MAX:
            return False
        changed = heartbeat_interval_ms / 1000 != self.heartbeat_interval_s
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        return changed
