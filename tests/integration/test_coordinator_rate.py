"""A client key cannot keep a secure coordinator busy for everyone else (issue 37 item 9):
`kera coordinator --client-ops-per-s N` refuses its requests over N a second `throttled`
(retriable, naming the wait), while an admin is served throughout (another client key is
served too: tests/unit/test_request_rate.py)."""

from __future__ import annotations

import time

import pytest

from kera.errors import Throttled
from kera.net import rpc

CLIENT_OPS_PER_S = 20     # low, so that one Python loop crosses it at once
CALLS = 3 * CLIENT_OPS_PER_S


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=0, backups=0, secure=True, log_level="WARNING",
                         extra_coordinator_args=["--client-ops-per-s", str(CLIENT_OPS_PER_S)])


def calls(cluster, key_file: str, n: int) -> tuple[int, list[str]]:
    """(served, refusal messages) of `n` list_streams calls made back to back."""
    served, refused = 0, []
    with rpc.Connection(cluster.bootstrap, timeout_s=5.0, key_file=key_file) as conn:
        for _ in range(n):
            try:
                conn.call("list_streams")
                served += 1
            except Throttled as exc:
                refused.append(exc.message)
    return served, refused


def test_a_client_over_its_rate_is_throttled_and_others_are_served(cluster):
    keys = cluster.keys
    served, refused = calls(cluster, str(keys.secret("client")), CALLS)
    assert refused, f"{CALLS} calls at once were all served: no limit applied"
    assert served >= CLIENT_OPS_PER_S - 1, "the burst of a full bucket was not served"
    assert f"over its {CLIENT_OPS_PER_S} coordinator requests per second" in refused[0]
    assert "retry in" in refused[0]
    # The same moment: the admin is not limited.
    assert calls(cluster, str(keys.admin), CALLS) == (CALLS, [])
    time.sleep(1.0)   # a full bucket again: the client key is served as before
    served, refused = calls(cluster, str(keys.secret("client")), CLIENT_OPS_PER_S // 2)
    assert (served, refused) == (CLIENT_OPS_PER_S // 2, [])
