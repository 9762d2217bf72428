"""Which coordinator to ask: a bootstrap list (`a:7000,b:7000,c:7000`) and the one that answered
last. Sans-IO.

With several coordinators on etcd one leads and the others stand by, answering `not_leader`
(kera.coordinator.leadership). Every client and daemon keeps a CoordinatorList: it asks
`current`, and after a timeout, an unreachable address, `not_leader` or `fenced` (the leader
just lost its leadership) it moves on to the next address (`failed`). One pass over the list
reaches the leader when there is one; callers bound their retries by a deadline.
"""

from __future__ import annotations

from kera.errors import BadRequest, Fenced, KeraError, NotLeader, Timeout

# Errors that mean "ask another coordinator": it is standing by, deposed, or not answering.
MOVE_ON = (NotLeader, Fenced, Timeout)


def parse_addresses(bootstrap: str) -> list[str]:
    """`host:port[,host:port...]` -> the addresses; BadRequest with the expected form."""
    out = []
    for item in (bootstrap or "").split(","):
        address = item.strip()
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise BadRequest(f"bootstrap address must be host:port[,host:port...], not {bootstrap!r}")
        out.append(address)
    return out


class CoordinatorList:
    def __init__(self, bootstrap: str):
        self.addresses = parse_addresses(bootstrap)
        self._i = 0

    @property
    def current(self) -> str:
        return self.addresses[self._i]

    def __len__(self) -> int:
        return len(self.addresses)

    def prefer(self, address: str) -> None:
        """Ask `address` first (the leader as last seen), if it is in the list."""
        if address in self.addresses:
            self._i = self.addresses.index(address)

    def failed(self, address: str, error: KeraError) -> bool:
        """`address` answered `error` (or none): move on if that means another coordinator
        should be asked. Returns whether the caller should retry (on the new current)."""
        if not isinstance(error, MOVE_ON):
            return False
        if address == self.current and len(self.addresses) > 1:
            self._i = (self._i + 1) % len(self.addresses)
        return True
