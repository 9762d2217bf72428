"""A daemon's requests to the leading coordinator: kera.net.server peers over a bootstrap list.

Brokers and backups take `--coordinator a:7000,b:7000,c:7000`. Requests go to the list's current
address (kera.net.coordinators.CoordinatorList); a reply of `not_leader` or `fenced`, or none
before the timeout, moves the list on, so the daemon's next request (its next heartbeat tick)
goes to the next coordinator and a new leader is found within one pass. The callback still
gets the error: callers keep their own retry timing. A heartbeat with no reply in time also
closes the connection, so the next one does not queue behind a stalled one.
"""

from __future__ import annotations

import logging
from typing import Callable

from kera.net.coordinators import CoordinatorList
from kera.errors import KeraError, Timeout

log = logging.getLogger(__name__)


class CoordinatorPeer:
    def __init__(self, server, bootstrap: str):
        self.server = server
        self.coordinators = CoordinatorList(bootstrap)

    @property
    def address(self) -> str:
        return self.coordinators.current

    def request(self, op: str, fields: dict | None, frames, timeout_s: float,
                callback: Callable[[dict, list, KeraError | None], None]) -> None:
        address = self.coordinators.current
        peer = self.server.peer(address)

        def done(header, payload, error):
            if op == "heartbeat" and isinstance(error, Timeout):
                # After a network cut the old TCP connection resends with a doubling backoff:
                # heartbeats queued behind it could reach the coordinator seconds after the
                # network healed, and the daemon be declared dead meanwhile (found on test
                # hosts). A fresh connection's first packet goes out at once; Kafka's clients
                # likewise disconnect on a request timeout.
                self.server.reconnect(address, peer)
            if error is not None and self.coordinators.failed(address, error) \
                    and self.coordinators.current != address:
                log.info("coordinator %s: %s on %s; asking %s next", address, error.code, op,
                         self.coordinators.current)
            callback(header, payload, error)

        peer.request(op, fields, frames, timeout_s, done)
