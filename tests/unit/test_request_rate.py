"""Coordinator requests per client principal (kera.net.quota.RequestRate, issue 37 item 9):
over its rate a client key is refused `throttled`, changing nothing, while other principals,
brokers and admins are served."""

from __future__ import annotations

import pytest

from kera.coordinator.core import Coordinator
from kera.errors import Throttled
from kera.net.keys import Principal
from kera.net.quota import RequestRate

CLIENT = Principal("etl", "client")
OTHER = Principal("reports", "client")
ADMIN = Principal("ops", "admin")


def test_a_principal_gets_its_burst_then_waits_for_its_rate():
    rate = RequestRate(per_s=10, burst_s=1.0)
    for _ in range(10):
        rate.admit("etl", 0.0)
    with pytest.raises(Throttled, match=r"'etl' is over its 10 coordinator requests per second: "
                                        r"retry in 100 ms"):
        rate.admit("etl", 0.0)
    rate.admit("other", 0.0)          # a bucket per principal
    rate.admit("etl", 0.1)            # one more after a tenth of a second
    with pytest.raises(Throttled):
        rate.admit("etl", 0.1)


def test_the_coordinator_refuses_a_client_over_its_rate_before_changing_anything():
    c = Coordinator(0.0, client_ops_per_s=5)
    c.register(0.0, "broker", "127.0.0.1:7000", "n0")     # somewhere to place a stream
    for _ in range(5):
        c.handle("list_streams", {}, 0.0, CLIENT)
    version = c.version
    with pytest.raises(Throttled):
        c.handle("create_stream", {"name": "s", "streamlets": 1}, 0.0, CLIENT)
    assert c.version == version and "s" not in c.streams
    c.handle("list_streams", {}, 0.0, OTHER)               # another key is served
    for _ in range(20):
        c.handle("list_streams", {}, 0.0, ADMIN)           # operators are not limited
        c.handle("list_streams", {}, 0.0, None)            # nor plaintext clusters
    c.handle("create_stream", {"name": "s", "streamlets": 1}, 0.2, CLIENT)   # once it waited
    assert "s" in c.streams


def test_zero_turns_the_limit_off():
    c = Coordinator(0.0, client_ops_per_s=0)
    for _ in range(100):
        c.handle("list_streams", {}, 0.0, CLIENT)
