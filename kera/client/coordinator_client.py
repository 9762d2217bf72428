"""Blocking calls to the cluster's leading coordinator, following a bootstrap list.

One connection per coordinator address, opened on first use. A call goes to the list's current
address; `not_leader` / `fenced` (and a timeout, when the list names several coordinators) move
on to the next address and try again, pausing RETRY_PAUSE_S after each full pass, until the
call's deadline. With one coordinator a timeout is raised at once, as before there were several.
Not thread-safe: one per thread (zmq sockets are not thread-safe either).
"""

from __future__ import annotations

import logging
import time

from kera.net import rpc
from kera.net.coordinators import CoordinatorList
from kera.errors import KeraError, PeerUnreachable, Timeout

log = logging.getLogger(__name__)

# After asking every coordinator in turn without finding the leader (an election under way:
# a dead leader's lease has a few seconds to run), wait this long before the next pass.
RETRY_PAUSE_S = 0.1
# With several coordinators, one that takes no request or sends no reply for this long is left
# for the next (a dead leader's address takes nothing). Coordinator requests are answered within
# one loop turn plus an etcd commit (milliseconds), so this only cuts off the dead.
MOVE_ON_AFTER_S = 2.0

# The coordinator that answered last, per bootstrap list, for this process: a new client asks
# it first instead of walking the list from a dead first entry again (a plain dict: a stale or
# racing entry only costs one move-on).
_last_leader: dict[tuple[str, ...], str] = {}


class CoordinatorClient:
    def __init__(self, bootstrap: str, *, timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
                 key_file: str | None = None, coordinators: CoordinatorList | None = None):
        self.coordinators = coordinators if coordinators is not None else CoordinatorList(bootstrap)
        self._key = tuple(self.coordinators.addresses)
        last = _last_leader.get(self._key)
        if last is not None:
            self.coordinators.prefer(last)
        self.timeout_s = timeout_s
        self.key_file = key_file
        self._conns: dict[str, rpc.Connection] = {}

    @property
    def address(self) -> str:
        return self.coordinators.current

    def call(self, op: str, fields: dict | None = None, frames=(),
             timeout_s: float | None = None) -> tuple[dict, list]:
        """Request `op` of the leader; raises the last error once the deadline passes, or at
        once when a first contact finds nothing listening at any address of the list."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        unreachable: dict[str, KeraError] = {}
        asked = 0
        while True:
            address = self.coordinators.current
            left = deadline - time.monotonic()
            if len(self.coordinators) > 1:   # leave time to ask the others within the budget
                left = min(left, MOVE_ON_AFTER_S, budget / len(self.coordinators))
            try:
                reply = self._conn(address).call(op, fields, frames, timeout_s=max(left, 0.001))
                _last_leader[self._key] = address
                return reply
            except KeraError as err:
                if isinstance(err, Timeout):
                    self._drop(address)   # late replies must not answer the next call
                if isinstance(err, PeerUnreachable):
                    unreachable[address] = err
                if len(unreachable) == len(self.coordinators):
                    raise _none_reachable(unreachable) from None
                if isinstance(err, Timeout) and len(self.coordinators) == 1:
                    raise
                if not self.coordinators.failed(address, err) or time.monotonic() >= deadline:
                    raise
                log.debug("coordinator %s: %s; asking %s", address, err, self.coordinators.current)
            asked += 1
            if asked % len(self.coordinators) == 0:
                time.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))

    def _conn(self, address: str) -> rpc.Connection:
        conn = self._conns.get(address)
        if conn is None:
            # Until a coordinator of this list has answered in this process, a connection that
            # is not up soon is probed, so a wrong address is named at once (as the CLI does).
            first_contact = self._key not in _last_leader
            conn = self._conns[address] = rpc.Connection(
                address, timeout_s=self.timeout_s, key_file=self.key_file,
                probe_after_s=rpc.FIRST_CONTACT_PROBE_AFTER_S if first_contact else None)
        return conn

    def _drop(self, address: str) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


def _none_reachable(errors: dict[str, KeraError]) -> PeerUnreachable:
    """One error naming every coordinator address and why each could not be reached."""
    if len(errors) == 1:
        return next(iter(errors.values()))
    reasons = "; ".join(err.message for err in errors.values())
    return PeerUnreachable(f"no coordinator of {len(errors)} could be reached: {reasons}")
