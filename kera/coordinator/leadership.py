"""One leader among several coordinators on one etcd prefix, and what the others do meanwhile.

`kera coordinator --metadata etcd://...` may run two or three times. Each *campaigns*: it takes
a lease of `lease_ttl_s` and, in one transaction, creates `/kera/<name>/leader` (its advertised
address) bound to that lease, only if the key does not exist. The winner leads: a thread renews the
lease every third of its TTL from then on, and it loads the metadata and serves, its commits
guarded by the leader key's revision (EtcdStore.use_fence). The others *stand by*: they answer every
request with `not_leader` (naming the leader), so clients and daemons move on to the next
address of their bootstrap list (kera.net.coordinators), and campaign again every
CAMPAIGN_INTERVAL_S.

When the leader dies its lease expires after at most `lease_ttl_s`; etcd deletes the key and a
standby wins the next campaign. A leader that cannot renew (etcd unreachable from it, a
partition) stops serving SELF_FENCE_FRACTION into the lease it last renewed, before etcd can let
anyone else lead; should it still write, its commits are refused (`fenced`): the key it guards
by is gone or newer. Then, and when a commit is refused so (deposed while loading or serving), it
stands by like the others, its state discarded: it loads the metadata afresh when it wins again.
"""

from __future__ import annotations

import logging
import threading
import time

from kera.coordinator.etcd_client import ETCD_CONNECT_TIMEOUT_S, EtcdClient, b64
from kera.coordinator.metadata import DEFAULT_LEADER_LEASE_TTL_S
from kera.errors import KeraError, NotLeader, StorageError

log = logging.getLogger(__name__)

LEADER_KEY = "leader"
# Whole seconds (etcd's unit): bounds how long creates, joins and failovers wait after a crash.
DEFAULT_LEASE_TTL_S = DEFAULT_LEADER_LEASE_TTL_S
LEASE_TTL_S_MIN = 2
# A leader stops serving once this fraction of the lease it last renewed has passed (measured
# from before its renewal was sent, so etcd's own count can only end later).
SELF_FENCE_FRACTION = 0.8
RENEWALS_PER_TTL = 3
# How often a standby tries to take over (each try is one etcd transaction).
CAMPAIGN_INTERVAL_S = 0.5
# One renewal's etcd deadline: it must fail well inside the lease so the leader can step down.
RENEW_DEADLINE_S = 1.0
# A renewal under way ends within its deadline plus one request's connect timeout.
KEEPER_STOP_TIMEOUT_S = RENEW_DEADLINE_S + ETCD_CONNECT_TIMEOUT_S + 1.0


class Leadership:
    """The campaign and the lease of one coordinator (`me`: its advertised address)."""

    def __init__(self, client: EtcdClient, prefix: str, me: str,
                 lease_ttl_s: int = DEFAULT_LEASE_TTL_S, clock=time):
        if lease_ttl_s < LEASE_TTL_S_MIN:
            raise ValueError(f"leader lease of {lease_ttl_s} s: at least {LEASE_TTL_S_MIN} s")
        self.client = client
        self.key = prefix + LEADER_KEY
        self.me = me
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        self.lease_id: int | None = None
        self.revision: int | None = None        # the leader key's mod revision while leading
        self.valid_until = 0.0                  # monotonic: stop serving at this time
        self.leader: str | None = None          # who leads, as last seen by a lost campaign

    def campaign(self) -> bool:
        """Try to become the leader once. Raises StorageError when etcd does not answer."""
        started = self.clock.monotonic()
        lease_id = self.client.lease_grant(self.lease_ttl_s)
        put = {"request_put": {"key": b64(self.key), "value": b64(self.me), "lease": lease_id}}
        absent = {"key": b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        won, revision = self.client.txn([absent], [put])
        if not won:
            self.client.lease_revoke(lease_id)
            found = self.client.get(self.key)
            self.leader = None if found is None else found[0]
            return False
        self.lease_id, self.revision, self.leader = lease_id, revision, self.me
        self.valid_until = started + self.lease_ttl_s * SELF_FENCE_FRACTION
        log.info("leading the cluster: %s holds %s at revision %d (lease %d s)", self.me,
                 self.key, revision, self.lease_ttl_s)
        return True

    def renew(self) -> bool:
        """Renew the lease; False once it is lost (expired, or etcd did not answer in time)."""
        started = self.clock.monotonic()
        try:
            ttl_s = self.client.lease_keepalive(self.lease_id, RENEW_DEADLINE_S)
        except StorageError as err:
            log.warning("cannot renew the leader lease: %s", err)
            return self.valid(self.clock.monotonic())
        if ttl_s <= 0:
            log.warning("the leader lease expired: another coordinator may lead now")
            self.valid_until = 0.0
            return False
        self.valid_until = started + ttl_s * SELF_FENCE_FRACTION
        return True

    def valid(self, now: float) -> bool:
        return now < self.valid_until

    def resign(self) -> None:
        """Give the leadership up now (a clean stop): a standby need not wait out the lease."""
        self.valid_until = 0.0
        if self.lease_id is not None:
            try:
                self.client.lease_revoke(self.lease_id)
            except StorageError as err:
                log.warning("could not revoke the leader lease (it expires by itself): %s", err)
            self.lease_id = None

    def not_leader(self) -> NotLeader:
        where = f"the leader is {self.leader}" if self.leader else "no coordinator leads right now"
        return NotLeader(f"coordinator {self.me} is standing by ({where}); ask the next "
                         f"coordinator of the bootstrap list")


class LeaseKeeper(threading.Thread):
    """Renews a leader's lease every TTL / RENEWALS_PER_TTL until stopped or lost (on a client
    of its own: the leader's loop keeps using its store's)."""

    def __init__(self, leadership: Leadership):
        super().__init__(name="kera-leader-lease", daemon=True)
        self.leadership = leadership
        self.stopped = threading.Event()

    def run(self) -> None:
        interval_s = self.leadership.lease_ttl_s / RENEWALS_PER_TTL
        while not self.stopped.wait(interval_s):
            if not self.leadership.renew():
                return

    def stop(self) -> None:
        """Stop renewing; returns once no renewal is under way (the next campaign uses the same
        etcd client)."""
        self.stopped.set()
        if self.is_alive():
            self.join(KEEPER_STOP_TIMEOUT_S)


def serve_standby(server, leadership: Leadership, ops) -> None:
    """Answer `ops` with not_leader and campaign every CAMPAIGN_INTERVAL_S until this
    coordinator wins (the server stops then) or the server is stopped."""
    def refuse(req):
        raise leadership.not_leader()

    for op in ops:
        server.on(op, refuse)

    def campaign() -> None:
        try:
            won = leadership.campaign()
        except KeraError as err:   # etcd unreachable from here: keep standing by
            log.warning("campaign for leadership failed: %s", err)
            return
        if won:
            server.stop()

    server.every(CAMPAIGN_INTERVAL_S, campaign)
    campaign()
    if not server.stopping:
        log.info("standing by: %s leads", leadership.leader or "nobody yet")
        server.run()
    else:
        server.close()
