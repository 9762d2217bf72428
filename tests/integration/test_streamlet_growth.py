"""Raising a stream's streamlet count on a running cluster (`kera stream alter --streamlets`):
the new streamlets are placed on live brokers and served; a running producer starts sending
keyed records to them, a running consumer of all streamlets reads them from their beginning
and a group assigns them, with every record read exactly once; lowering is refused.

Values are `b"<n>"`: every record read names which one it is, so the test counts exactly.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest

from kera import Consumer, Producer

pytestmark = pytest.mark.timeout(300)

BEFORE, AFTER = 2, 5          # streamlet counts
MAX_AGE_MS = 300              # the clients' metadata max age: growth seen within a second
SETTLE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=1, log_level="WARNING")


def kera(cluster, *args):
    env = {**os.environ, "KERA_BOOTSTRAP": cluster.bootstrap}
    return subprocess.run([sys.executable, "-m", "kera", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def drain(consumers, seen: dict, deadline_s: float) -> None:
    """Poll each consumer once; record (value -> streamlets it was read from) per consumer."""
    for i, c in enumerate(consumers):
        while True:
            r = c.poll(timeout_s=0.02)
            if r is None:
                break
            seen[i].append((int(r.value), r.streamlet))
    assert time.monotonic() < deadline_s, "records not read in time"


def test_a_raised_streamlet_count_reaches_running_producers_and_consumers(cluster):
    stream = "grow"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=BEFORE, replication=2)
    numbers = itertools.count()
    seen: dict[int, list] = {0: [], 1: []}
    opts = {"metadata_max_age_ms": MAX_AGE_MS}
    with Producer(cluster.bootstrap, linger_ms=1, **opts) as p, \
            Consumer(cluster.bootstrap, stream, **opts) as everything, \
            Consumer(cluster.bootstrap, stream, group="g-grow", auto_commit_interval_ms=100,
                     **opts) as member:
        def send(n):
            for _ in range(n):
                i = next(numbers)
                p.send(stream, str(i).encode(), key=b"k%d" % i)
            p.flush()

        send(200)
        lowered = kera(cluster, "stream", "alter", stream, "--streamlets", "1")
        assert lowered.returncode != 0 and "only be raised" in lowered.stderr, lowered.stderr
        raised = kera(cluster, "stream", "alter", stream, "--streamlets", str(AFTER))
        assert raised.returncode == 0, raised.stderr
        assert f"{AFTER} streamlets" in raised.stdout and "ready" in raised.stdout

        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        # Keyed records reach the new streamlets once the producer's descriptor is refreshed.
        while not any(sl >= BEFORE for _, sl in seen[0]) or len(member.assignment()) < AFTER:
            send(50)
            drain([everything, member], seen, deadline)
        send(200)
        total = next(numbers)
        while min(len(seen[0]), len(seen[1])) < total:
            drain([everything, member], seen, deadline)
        time.sleep(0.5)   # a duplicate would arrive after the count: give it the chance
        drain([everything, member], seen, deadline)

    for got in seen.values():
        values = sorted(v for v, _ in got)
        assert values == list(range(total)), "every record read exactly once"
        assert {sl for _, sl in got} == set(range(AFTER))
    with cluster.admin() as admin:
        d = admin.describe_stream(stream)
    assert d["streamlets"] == AFTER and len(d["placement"]) == AFTER
    assert set(d["placement"]) == {0, 1} and d["states"] == ["serving"] * AFTER
