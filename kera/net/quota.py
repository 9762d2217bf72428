"""Per-principal byte-rate quotas on produce and fetch (Kafka's quota shape), sans-IO.

A quota is a rate in bytes per second for one principal (or `*`, the default for principals
without their own). Each broker meters what each principal sends (produce) and is sent (fetch)
with a token bucket holding at most QUOTA_BURST_S seconds of its rate. A request is charged after
it is admitted, so the bucket can go into debt; while it is in debt the principal's next
requests of that kind are refused with a retriable `throttled` saying how long to wait. The
client slows down to the quota and loses nothing: it never gets a non-retriable error or a
dropped connection for going too fast. Quotas apply per broker, as Kafka's do.
"""

from __future__ import annotations

from kera.errors import BadRequest, Throttled
from kera.net.keys import check_principal

KINDS = ("produce", "fetch")
DEFAULT_PRINCIPAL = "*"
# Seconds of its rate a principal may send in one burst after being idle: enough for a
# producer's request window, short enough that the average holds over a few seconds.
QUOTA_BURST_S = 1.0
# Quotas one cluster holds (they travel with the ACLs in broker heartbeats).
QUOTAS_MAX = 10_000
RATE_MAX_BYTES_PER_S = 2**50


class Quotas:
    """The cluster's quotas ({principal: {kind: bytes_per_s}}) and one broker's buckets."""

    def __init__(self):
        self.rates: dict[str, dict[str, int]] = {}
        self.buckets = Buckets(QUOTA_BURST_S)   # by (name, kind)

    def set(self, principal: str, kind: str, bytes_per_s: int | None) -> None:
        if principal != DEFAULT_PRINCIPAL:
            check_principal(principal)
        if kind not in KINDS:
            raise BadRequest(f"quota kind {kind!r} is not one of {', '.join(KINDS)}")
        if bytes_per_s is None:
            self.rates.get(principal, {}).pop(kind, None)
            if not self.rates.get(principal, True):
                del self.rates[principal]
            return
        if not isinstance(bytes_per_s, int) or not 1 <= bytes_per_s <= RATE_MAX_BYTES_PER_S:
            raise BadRequest(f"a quota is 1-{RATE_MAX_BYTES_PER_S} bytes per second")
        if principal not in self.rates and len(self.rates) >= QUOTAS_MAX:
            raise BadRequest(f"the cluster already holds quotas for {QUOTAS_MAX} principals")
        self.rates.setdefault(principal, {})[kind] = bytes_per_s

    def replace(self, rates: dict) -> None:
        fresh = Quotas()
        if not isinstance(rates, dict):
            raise BadRequest("'quotas' must map principals to {kind: bytes_per_s}")
        for principal, kinds in rates.items():
            if not isinstance(kinds, dict):
                raise BadRequest("'quotas' must map principals to {kind: bytes_per_s}")
            for kind, rate in kinds.items():
                fresh.set(principal, kind, rate)
        self.rates = fresh.rates
        self.buckets.keep(lambda key: self.rate(*key) is not None)

    def rate(self, name: str, kind: str) -> int | None:
        own = self.rates.get(name)
        if own is not None and kind in own:
            return own[kind]
        return self.rates.get(DEFAULT_PRINCIPAL, {}).get(kind)

    def admit(self, name: str, kind: str, now: float, nbytes: int = 0) -> None:
        """Raise Throttled while `name` owes bytes of `kind`; BadRequest for a request of
        `nbytes` larger than the bucket holds, which would put it ever deeper in debt with
        one request (the bucket bounds what one request may take: rate x QUOTA_BURST_S)."""
        rate = self.rate(name, kind)
        if rate is None:
            return
        capacity = rate * QUOTA_BURST_S
        if nbytes > capacity:
            raise BadRequest(f"a {kind} request of {nbytes} bytes is larger than principal "
                             f"{name!r}'s quota allows in one burst ({rate} bytes/s x "
                             f"{QUOTA_BURST_S:g} s = {capacity:.0f} bytes): send smaller "
                             f"batches, or raise the quota (kera quota set)")
        tokens = self.buckets.level((name, kind), rate, now)
        if tokens < 0:
            wait_ms = max(1, round(-tokens / rate * 1000))
            raise Throttled(f"principal {name!r} is over its {kind} quota of {rate} bytes/s: "
                            f"retry in {wait_ms} ms")

    def delay_ms(self, name: str, kind: str, now: float) -> int:
        """How long `name` should wait before its next request of `kind`: 0 unless it owes
        bytes (Kafka clients are told this as throttle_time_ms rather than refused)."""
        rate = self.rate(name, kind)
        if rate is None:
            return 0
        tokens = self.buckets.level((name, kind), rate, now)
        return 0 if tokens >= 0 else max(1, round(-tokens / rate * 1000))

    def charge(self, name: str, kind: str, nbytes: int, now: float) -> None:
        rate = self.rate(name, kind)
        if rate is not None:
            self.buckets.take((name, kind), rate, nbytes, now)


class Buckets:
    """Token buckets by key: each fills at its rate (units per second) up to `burst_s` seconds
    of it, starts full, and may go into debt (a request charged after it was admitted)."""

    def __init__(self, burst_s: float):
        self.burst_s = burst_s
        self._levels: dict[object, list[float]] = {}   # key -> [tokens, when last filled]

    def level(self, key, rate: float, now: float) -> float:
        """The tokens in `key`'s bucket at `now`."""
        bucket = self._levels.get(key)
        if bucket is None:
            bucket = self._levels[key] = [rate * self.burst_s, now]
        bucket[0] = min(rate * self.burst_s, bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        return bucket[0]

    def take(self, key, rate: float, amount: float, now: float) -> None:
        self._levels[key] = [self.level(key, rate, now) - amount, now]

    def keep(self, wanted) -> None:
        """Forget the buckets whose key `wanted(key)` refuses."""
        self._levels = {k: v for k, v in self._levels.items() if wanted(k)}


# Control requests one client principal may make of the coordinator per second, by default
# (`kera coordinator --client-ops-per-s`): far above what its consumers' heartbeats and commits
# and a transactional producer's few ops per transaction need, yet one key cannot keep the
# coordinator busy for everyone else. Brokers and backups (their heartbeats, Kafka listeners'
# group ops) and admins are not limited.
CLIENT_OPS_PER_S = 5000
# Seconds of its rate a principal may spend at once after being idle.
CLIENT_OPS_BURST_S = 1.0


class RequestRate:
    """Requests per second per principal: over its rate, a request is refused `throttled`
    (retriable, naming the wait) and changes nothing."""

    def __init__(self, per_s: int = CLIENT_OPS_PER_S, burst_s: float = CLIENT_OPS_BURST_S):
        if per_s < 1:
            raise ValueError("a request rate is at least 1 per second")
        self.per_s = per_s
        self.buckets = Buckets(burst_s)

    def admit(self, name: str, now: float) -> None:
        tokens = self.buckets.level(name, self.per_s, now)
        if tokens < 1:
            wait_ms = max(1, round((1 - tokens) / self.per_s * 1000))
            raise Throttled(f"principal {name!r} is over its {self.per_s} coordinator "
                            f"requests per second: retry in {wait_ms} ms")
        self.buckets.take(name, self.per_s, 1, now)
