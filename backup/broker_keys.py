"""Which key may act as which broker on this backup (secure clusters), sans-IO.

The coordinator binds a broker id to the principal that registered it and sends the bindings in
every backup heartbeat reply (kera.coordinator.acl_ops). A replica op names a broker id: only
that broker's principal may write (`replicate`) or drop (`drop_replica`) its replicas, so a
stolen or misconfigured broker key cannot overwrite or delete another broker's data. Reads and
listings stay open to every broker key: recovering a dead broker's streamlets is reading them.
"""

from __future__ import annotations

from kera.errors import BadRequest, NotAuthorized, NotReady
from kera.net.keys import Principal

# Bindings one reply may carry: one per registered broker (validate.DAEMONS_MAX is 2048).
BINDINGS_MAX = 4096


class BrokerKeys:
    def __init__(self):
        self.bound: dict[int, str] = {}

    def update(self, bindings) -> None:
        if not isinstance(bindings, dict) or len(bindings) > BINDINGS_MAX or \
                not all(isinstance(k, str) and k.isdigit() and isinstance(v, str)
                        for k, v in bindings.items()):
            raise BadRequest("heartbeat reply with malformed 'broker_principals'")
        self.bound = {int(k): v for k, v in bindings.items()}

    def check(self, principal: Principal | None, broker_id: int, op: str) -> None:
        if principal is None:
            return   # plaintext
        owner = self.bound.get(broker_id)
        if owner is None:
            raise NotReady(f"this backup does not know broker {broker_id}'s key yet (it learns "
                           "it from the coordinator within a heartbeat): retry", retriable=True)
        if owner != principal.name:
            raise NotAuthorized(f"principal {principal} may not {op} replicas of broker "
                                f"{broker_id}: they belong to principal {owner!r}")
