"""Per-principal quotas (kera.net.quota): a token bucket of QUOTA_BURST_S of the rate."""

import pytest

from kera.errors import BadRequest, Throttled
from kera.net.quota import QUOTA_BURST_S, Quotas

RATE = 1000   # bytes per second


def quotas(**rates) -> Quotas:
    q = Quotas()
    for principal, rate in rates.items():
        q.set(principal, "produce", rate)
    return q


def test_a_principal_in_debt_is_throttled_until_the_rate_repays_it():
    q = quotas(alice=RATE)
    q.admit("alice", "produce", 0.0, 800)
    q.charge("alice", "produce", 800, 0.0)
    q.admit("alice", "produce", 0.0, 800)        # 200 left: admitted, then in debt
    q.charge("alice", "produce", 800, 0.0)
    with pytest.raises(Throttled, match="retry in 600 ms"):
        q.admit("alice", "produce", 0.0, 1)
    q.admit("alice", "produce", 0.6, 1)          # repaid at the rate


def test_one_request_larger_than_the_burst_is_refused_not_admitted_into_debt():
    q = quotas(alice=RATE)
    capacity = int(RATE * QUOTA_BURST_S)
    q.admit("alice", "produce", 0.0, capacity)   # exactly one burst: allowed
    with pytest.raises(BadRequest, match=f"{capacity + 1} bytes is larger than .*alice"):
        q.admit("alice", "produce", 0.0, capacity + 1)
    assert q.delay_ms("alice", "produce", 0.0) == 0   # nothing was charged for it


def test_the_default_quota_applies_to_principals_without_their_own():
    q = Quotas()
    q.set("*", "produce", RATE)
    with pytest.raises(BadRequest):
        q.admit("bob", "produce", 0.0, 10 * RATE)
    q.admit("bob", "fetch", 0.0, 10 * RATE)      # no fetch quota: any size
