"""Which key may act as which broker on this backup (secure clusters), sans-IO.

The coordinator binds a broker id to the principal that registered it and sends the bindings in
every backup heartbeat reply (kera.coordinator.acl_ops). A replica op names a broker id: only
that broker's principal may write (`replicate`) or drop (`drop_replica`) its replicas, so a
stolen or misconfigured broker key cannot overwrite or delete another broker's data. Reads and
listings stay open to every broker key: recovering a dead broker's streamlets is reading them.
A listing that fences incarnations needs, per incarnation, the coordinator's token saying it
failed that incarnation over (kera.net.fence): a broker key alone fences nothing.
"""

from __future__ import annotations

from kera.errors import BadRequest, NotAuthorized, NotReady
from kera.net.fence import valid_token
from kera.net.keys import Principal

# Bindings one reply may carry: one per registered broker (validate.DAEMONS_MAX is 2048).
BINDINGS_MAX = 4096


class BrokerKeys:
    def __init__(self):
        self.bound: dict[int, str] = {}
        self.fence_key: str | None = None   # the coordinator's, from its heartbeat replies

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

    def update_fence_key(self, key) -> None:
        if key is not None:
            if not isinstance(key, str):
                raise BadRequest("heartbeat reply with a malformed 'fence_key'")
            self.fence_key = key

    def check_fence(self, principal: Principal | None, broker_id: int, epochs: list[int],
                    tokens) -> None:
        """Refuse a fence of any incarnation the coordinator did not fail over: each of
        `epochs` needs its token, in the same order (secure clusters only)."""
        if principal is None or not epochs:
            return   # plaintext: anyone may do anything anyway
        if self.fence_key is None:
            raise NotReady("this backup has not heard from the coordinator yet and cannot "
                           "check a fence: retry", retriable=True)
        if not isinstance(tokens, list) or len(tokens) != len(epochs):
            tokens = [None] * len(epochs)
        forged = [e for e, t in zip(epochs, tokens)
                  if not valid_token(self.fence_key, broker_id, e, t)]
        if forged:
            raise NotAuthorized(f"principal {principal} may not fence broker {broker_id} "
                                f"epoch(s) {forged}: the coordinator failed none of them over")
