"""A daemon's requests to the leading coordinator: kera.server peers over a bootstrap list.

Brokers and backups take `--coordinator a:7000,b:7000,c:7000`. Requests go to the list's current
address (kera.coordinators.CoordinatorList); a reply of `not_leader` or `fenced`, or none
before the timeout, moves the list on, so the daemon's next request (its next heartbeat tick)
goes to the next coordinator and a new leader is found within one pass. The callback still
gets the error: callers keep their own retry timing.
"""

from __future__ import annotations

import logging
from typing import Callable

from kera.coordinators import CoordinatorList
from kera.errors import KeraError

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

        def done(header, payload, error):
            if error is not None and self.coordinators.failed(address, error) \
                    and self.coordinators.current != address:
                log.info("coordinator %s: %s on %s; asking %s next", address, error.code, op,
                         self.coordinators.current)
            callback(header, payload, error)

        self.server.peer(address).request(op, fields, frames, timeout_s, done)
