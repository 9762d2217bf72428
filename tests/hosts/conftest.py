"""Fixtures of the tests across test hosts (network namespaces, see netns.py).

    def test_x(multihost):                 # six hosts and a cluster laid out on them
        hosts, cluster = multihost(heartbeat_interval_ms=100)

    def test_y(test_hosts):                # just hosts
        hosts = test_hosts(2)

Both skip (saying why) where namespaces cannot be made: not root, or no iproute2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The fault tests' helpers (faultkit) are shared with tests/faults, the Kafka clients' helpers
# (kafkit) with tests/kafka_listener.
for _shared in ("faults", "kafka_listener"):
    _dir = str(Path(__file__).resolve().parents[1] / _shared)
    if _dir not in sys.path:
        sys.path.insert(0, _dir)


@pytest.fixture
def test_hosts():
    """Factory `make(count) -> netns.TestHosts`, created; all removed after the test."""
    import netns

    why = netns.unavailable()
    if why:
        pytest.skip(why)
    made: list = []

    def make(count: int):
        hosts = netns.TestHosts(count)
        made.append(hosts)
        return hosts.create()

    yield make
    for hosts in made:
        hosts.destroy()


@pytest.fixture
def multihost(test_hosts, fresh_cluster):
    """Factory `make(layout_of=host_layout.layout, **LocalCluster kwargs) -> (hosts, cluster)`:
    host_layout.HOSTS test hosts and a started cluster laid out on them by `layout_of`. The
    cluster stops (its daemon logs printed if the test failed) before the hosts are removed."""
    import host_layout as layout

    def make(layout_of=layout.layout, **kw):
        hosts = test_hosts(layout.HOSTS)
        kw.setdefault("brokers", len(layout.BROKER_HOSTS))
        kw.setdefault("backups", len(layout.BACKUP_HOSTS))
        return hosts, fresh_cluster(where=layout.placement(hosts, layout_of), **kw)

    return make
