"""Cleanup policies against a real local cluster (issue 38's first slice, docs/COMPACTION.md):
`kera stream create/alter/describe` carry the policy and the compaction settings, keyed
records are stored on a compacted stream and keyless ones refused with a clear error (nothing
of them stored), and a `delete` stream still takes keyless records."""

from __future__ import annotations

import json
import time

import pytest

from kera import Consumer, Producer
from kera.errors import KeylessRecord

from tests.integration.test_cli import kera

WAIT_S = 20.0
_names = iter(range(10**6))


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=1, log_level="WARNING")


def name() -> str:
    return f"cp-{next(_names)}"


def read_all(cluster, stream, n):
    got = []
    deadline = time.monotonic() + WAIT_S
    with Consumer(cluster.bootstrap, stream, start="earliest") as c:
        while len(got) < n:
            assert time.monotonic() < deadline, f"read {len(got)} of {n}"
            r = c.poll(timeout_s=0.2)
            if r is not None:
                got.append((r.key, r.value))
        assert c.poll(timeout_s=0.5) is None, "a record past those written"
    return got


def test_cli_create_alter_describe(cluster):
    s = name()
    made = kera("stream", "create", s, "--cleanup-policy", "delete,compact",
                "--delete-retention-ms", "2h", "--min-cleanable-dirty-ratio", "0.25", "--json",
                bootstrap=cluster.bootstrap)
    assert made.returncode == 0, made.stderr
    d = json.loads(made.stdout)
    assert (d["cleanup_policy"], d["delete_retention_ms"], d["min_cleanable_dirty_ratio"],
            d["max_compaction_lag_ms"]) == ("compact,delete", 2 * 3_600_000, 0.25, 0)
    altered = kera("stream", "alter", s, "--cleanup-policy", "compact",
                   "--min-compaction-lag-ms", "1000", bootstrap=cluster.bootstrap)
    assert altered.returncode == 0 and "cleanup_policy compact" in altered.stdout, altered.stderr
    described = kera("stream", "describe", s, bootstrap=cluster.bootstrap)
    assert described.returncode == 0, described.stderr
    lines = {ln.split()[0]: ln.split()[1:] for ln in described.stdout.splitlines() if ln.strip()}
    assert lines["cleanup_policy"] == ["compact"] and lines["min_compaction_lag_ms"] == ["1000"]
    bad = kera("stream", "alter", s, "--cleanup-policy", "forever", bootstrap=cluster.bootstrap)
    assert bad.returncode == 1 and "cleanup_policy must be one of" in bad.stderr, bad.stderr
    plain = kera("stream", "create", name(), "--json", bootstrap=cluster.bootstrap)
    assert json.loads(plain.stdout)["cleanup_policy"] == "delete"


def test_keyless_records_refused_on_a_compacted_stream(cluster):
    s = name()
    with cluster.admin() as admin:
        admin.create_stream(s, replication=2, cleanup_policy="compact")
    with Producer(cluster.bootstrap) as p:
        p.send_batch(s, [b"v%d" % i for i in range(10)], keys=[b"k%d" % i for i in range(10)])
        p.flush()
        assert p.stats["acked"] == 10
    bad = Producer(cluster.bootstrap)
    try:
        bad.send(s, b"no key")
        with pytest.raises(KeylessRecord, match="give every record a key"):
            bad.flush(timeout=WAIT_S)
        assert bad.stats["records_failed"] == 1
    finally:
        bad.close()
    assert read_all(cluster, s, 10) == [(b"k%d" % i, b"v%d" % i) for i in range(10)]


def test_a_delete_stream_takes_keyless_records(cluster):
    s = name()
    with cluster.admin() as admin:
        admin.create_stream(s, replication=2)
    with Producer(cluster.bootstrap) as p:
        p.send_batch(s, [b"a", b"b"])
        p.flush()
        assert p.stats["acked"] == 2
    assert read_all(cluster, s, 2) == [(None, b"a"), (None, b"b")]
