"""The coordinator killed with SIGKILL and restarted: brokers and backups reconnect, no stream,
placement or recovery marker is lost, and the data path keeps working meanwhile."""

from __future__ import annotations

import pytest

import faultkit as fk
from faultkit import call, wait_for

from kera import Producer

# Run against plaintext and CURVE clusters (tests/conftest.py).
pytestmark = pytest.mark.security_modes


def test_coordinator_restart_loses_no_stream_or_placement(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=3, heartbeat_interval_ms=100, log_level="INFO",
                            extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        for name, n in (("a", 3), ("b", 1), ("c", 4)):
            admin.create_stream(name, streamlets=n, replication=3)
        before = {s["name"]: s for s in admin.list_streams()}
    with Producer(cluster.bootstrap, request_timeout_s=3.0) as p:
        p.send_batch("a", fk.values(0, 0, 3000))
        p.flush(60)
        cluster.kill_coordinator()
        # Brokers and backups keep serving what they know while it is down.
        p.send_batch("a", fk.values(0, 3000, 3000))
        p.flush(60)
        cluster.restart_coordinator()     # waits until every daemon is registered again
        with cluster.admin() as admin:
            after = {s["name"]: s for s in admin.list_streams()}
            assert set(after) == set(before)
            for name, s in after.items():
                assert (s["id"], s["placement"], s["streamlets"], s["replication"]) == (
                    before[name]["id"], before[name]["placement"], before[name]["streamlets"],
                    before[name]["replication"])
            wait_for(lambda: all(admin.describe_stream(n)["ready"] for n in after),
                     "every stream to be ready again")
            cluster_view = admin.cluster()
        assert all(m["alive"] for m in cluster_view["brokers"] + cluster_view["backups"])
        # No broker was failed over: they only reconnected.
        assert call(cluster.bootstrap, "recovery_status")["failed"] == []
        p.send_batch("a", fk.values(0, 6000, 3000))
        p.flush(60)
    everything = fk.read_everything(cluster.bootstrap, "a", 9000)
    fk.check_exactly_once(everything, [9000], [set()], "reader")
