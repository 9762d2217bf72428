"""Record numbers and seeking by number against real daemons: with one active group per
streamlet, each streamlet's records are numbered 0..N-1 across many groups; offsets_for_number
and seek_to_number land on exactly the record asked for (at, inside and between groups, and
past the end, where the next record written is the first read); streams with several active
groups refuse it by name."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kera import Consumer, Producer
from kera.errors import BadRequest

REPO = Path(__file__).resolve().parents[2]
RECORDS = 600
PAD = b"x" * 100         # ~100-byte records: the 300 of a streamlet fill several 8 KiB groups
TIMEOUT_S = 30.0


def read_n(c: Consumer, n: int) -> list:
    out = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(out) < n:
        assert time.monotonic() < deadline, f"read {len(out)} of {n} records"
        r = c.poll(timeout_s=0.5)
        if r is not None:
            out.append(r)
    return out


def test_seek_to_number_lands_on_exactly_that_record(local_cluster):
    cluster = local_cluster(brokers=1)
    with cluster.admin() as admin:
        # Small segments and groups: the numbers run across many groups.
        admin.create_stream("numbered", streamlets=2, segment_size_bytes=4096, group_segments=2)
    with Producer(cluster.bootstrap, chunk_size_bytes=1024, linger_ms=1) as p:
        for i in range(RECORDS):
            p.send("numbered", b"v%d" % i + PAD, streamlet=i % 2)
    with Consumer(cluster.bootstrap, "numbered", start="earliest") as c:
        everything = read_n(c, RECORDS)
        for sl in (0, 1):
            mine = [r for r in everything if r.streamlet == sl]
            assert [r.number for r in mine] == list(range(RECORDS // 2))
            assert [r.value for r in mine] == [b"v%d" % (2 * n + sl) + PAD for n in range(RECORDS // 2)]
            groups = {r.group for r in mine}
            assert len(groups) > 3
            firsts = [min(r.number for r in mine if r.group == g) for g in groups]
            for number in sorted({0, 1, 37, RECORDS // 2 - 1, *firsts, *(f - 1 for f in firsts if f)}):
                c.seek_to_number("numbered", sl, number)
                r = c.poll(timeout_s=TIMEOUT_S)
                assert (r.streamlet, r.number, r.value) == (sl, number, b"v%d" % (2 * number + sl) + PAD)
                positions = c.offsets_for_number("numbered", sl, number)
                assert (positions[0].group, positions[0].offset) == (r.group, r.offset)
        # Past the end: the next record written is the first read.
        c.seek_to_number("numbered", 0, RECORDS)
        assert c.poll(timeout_s=0.5) is None
        with Producer(cluster.bootstrap) as p:
            md = p.send("numbered", b"later", streamlet=0).result(TIMEOUT_S)
        r = c.poll(timeout_s=TIMEOUT_S)
        assert (r.value, r.number) == (b"later", RECORDS // 2) and md.number == r.number


def test_several_active_groups_refuse_seeking_by_number(local_cluster):
    cluster = local_cluster(brokers=1)
    with cluster.admin() as admin:
        admin.create_stream("slotted", streamlets=1, active_groups=2)
    with Producer(cluster.bootstrap) as p:
        p.send("slotted", b"x").result(TIMEOUT_S)
    with Consumer(cluster.bootstrap, "slotted") as c:
        with pytest.raises(BadRequest, match="one active group per streamlet"):
            c.offsets_for_number("slotted", 0, 0)


def test_ledger_service_example(local_cluster):
    """examples/ledger_service.py: instances racing transfers with conditional appends end
    agreeing, with no account overdrawn and the total conserved."""
    cluster = local_cluster(brokers=1)
    done = subprocess.run([sys.executable, str(REPO / "examples" / "ledger_service.py"),
                           "--bootstrap", cluster.bootstrap, "--instances", "3",
                           "--transfers", "20"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no account overdrawn, total conserved" in done.stdout
    assert "conflicts re-executed" in done.stdout
    print(done.stdout.splitlines()[-1])
