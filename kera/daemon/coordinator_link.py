"""A daemon's link to the leading coordinator: a kera.daemon.coordinator_session run on the server loop.

Brokers and backups both keep their session through it: a timer at the heartbeat interval
sends what the session says is due (register, then heartbeats) through a
kera.daemon.coordinator_peer.CoordinatorPeer, which follows the leader over the bootstrap list; every
request has a timeout, so a dead coordinator never blocks the loop, and the daemon serves all the
while. The daemon gives narrow hooks: the extra fields of its heartbeats, what to do once
registered, with each heartbeat reply, with a refusal it handles, and on a fatal refusal of its
identity. Its other coordinator requests (`call`) get the same one-in-flight, timeout and
stale-token rules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kera.codec import schema
from kera.daemon.coordinator_peer import CoordinatorPeer
from kera.daemon.coordinator_session import CoordinatorSession, Verdict
from kera.errors import KeraError
from kera.daemon.interval_timer import IntervalTimer

log = logging.getLogger(__name__)


@dataclass
class LinkHooks:
    """What the daemon does at each point of its session (all run on the server loop)."""
    heartbeat_fields: Callable[[], dict]                    # the daemon's extra heartbeat fields
    on_registered: Callable[[int], None]                    # its id, after every register
    on_heartbeat: Callable[[dict, dict], None]              # (reply header, fields sent)
    on_fatal: Callable[[KeraError], None]                   # identity refused: stop
    on_refused: Callable[[str, KeraError], None] | None = None   # (op, error) it handles


class CoordinatorLink:
    def __init__(self, server, bootstrap: str, session: CoordinatorSession, hooks: LinkHooks):
        self.session = session
        self.hooks = hooks
        self.peer = CoordinatorPeer(server, bootstrap)
        self._quiet = False    # "unreachable" logged once until the coordinator answers again
        self._timer = IntervalTimer(server, self.tick)

    @property
    def address(self) -> str:
        """The coordinator asked now."""
        return self.peer.address

    def start(self) -> None:
        """Register now, then tick at the heartbeat interval."""
        self._timer.arm(self.session.heartbeat_interval_s)
        self.tick()

    def tick(self) -> None:
        op = self.session.due()
        if op == "register":
            self.call(op, self.session.register_fields(), self._registered)
        elif op == "heartbeat":
            fields = {**self.session.heartbeat_fields(), **self.hooks.heartbeat_fields()}
            self.call(op, fields, lambda header: self.hooks.on_heartbeat(header, fields))

    def call(self, op: str, fields: dict, on_reply: Callable[[dict], None]) -> bool:
        """Send `op` unless one is in flight (False then); `on_reply(header)` on success."""
        if not self.session.begin(op):
            return False
        sent_token = self.session.identity.token

        def done(header, frames, error):
            verdict = self.session.answered(op, error, sent_token)
            if verdict is Verdict.OK:
                self._quiet = False
                try:
                    on_reply(header)
                except KeraError as err:
                    log.warning("bad %s reply from the coordinator: %s", op, err)
            else:
                self._failed(op, verdict, error)

        self.peer.request(op, fields, [], self.session.timeout_s(op), done)
        return True

    def _failed(self, op: str, verdict: Verdict, error: KeraError) -> None:
        kind, where = self.session.kind, self.peer.address
        if verdict is Verdict.STALE:
            log.info("coordinator %s refused a %s sent before re-registering (%s): ignored",
                     where, op, error.code)
        elif verdict is Verdict.UNREACHABLE:
            log.log(logging.DEBUG if self._quiet else logging.WARNING,
                    "coordinator %s: %s failed: %s", where, op, error.code)
            self._quiet = True
        elif verdict is Verdict.FATAL:
            log.error("the coordinator %s refused this %s's identity (%s): %s; stopping, "
                      "nothing deleted", where, kind, error.code, error.message)
            self.hooks.on_fatal(error)
        elif verdict is Verdict.REGISTER:
            log.warning("the coordinator does not know %s %s (%s): registering again", kind,
                        self.session.wanted_id, error.message)
            self.tick()
        elif self.hooks.on_refused is not None:
            self.hooks.on_refused(op, error)
        else:
            log.warning("coordinator %s refused %s: %s: %s", where, op, error.code, error.message)

    def _registered(self, header: dict) -> None:
        reply = schema.register_reply(header)   # a bad reply: logged by `call`
        previous = self.session.wanted_id
        try:
            self.session.identity.registered(reply.daemon_id, reply.token, reply.cluster_id)
        except ValueError as bad:
            log.warning("register reply with a bad token or cluster id: %s", bad)
            return
        if self.session.registered_as(reply.daemon_id, reply.heartbeat_interval_ms):
            self._timer.arm(self.session.heartbeat_interval_s)   # the coordinator's interval
        if previous is not None and previous != reply.daemon_id:
            log.warning("registered as %s %d (was %d)", self.session.kind, reply.daemon_id,
                        previous)
        log.info("registered with %s as %s %d (%s)", self.peer.address, self.session.kind,
                 reply.daemon_id, self.session.address)
        self.hooks.on_registered(reply.daemon_id)
