"""Seeking by time against real daemons: offsets_for_times lands on exactly the first record at
or after T in every group of every streamlet (at, between and beyond the produced times, with
records out of time order), seek_to_time reads from there, and a restarted broker (whose index
is rebuilt from what it reloaded) gives the same answers."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest

from kera import Consumer, Producer
from kera.errors import BadRequest

BASE_MS = 1_800_000_000_000    # 2027-01-15: any fixed time in the accepted range
STREAMLETS = 2
BATCHES = 4
PER_BATCH = 5
# A record sent late with an old time: Kafka's semantics put it after the returned position
# whenever its offset is later, whatever its time.
LATE_MS = BASE_MS + 5


def ts_ms(sl: int, batch: int, i: int) -> int:
    return BASE_MS + 1000 * batch + 10 * i + sl


def produce(bootstrap: str, stream: str) -> None:
    """BATCHES flushed batches (separate chunks) per streamlet, from two producers (two slots,
    so two groups per streamlet); then one late record per streamlet."""
    producers = [Producer(bootstrap, producer_id=pid) for pid in (1, 2)]
    try:
        for batch in range(BATCHES):
            p = producers[batch % 2]
            for sl in range(STREAMLETS):
                for i in range(PER_BATCH):
                    p.send(stream, f"{sl}-{batch}-{i}".encode(), streamlet=sl,
                           timestamp_ms=ts_ms(sl, batch, i))
            p.flush()
        for sl in range(STREAMLETS):
            producers[0].send(stream, f"{sl}-late".encode(), streamlet=sl, timestamp_ms=LATE_MS)
        producers[0].flush()
    finally:
        for p in producers:
            p.close()


def read_all(bootstrap: str, stream: str, start, expected: int, timeout_s: float = 30.0) -> list:
    """Every record from `start`, once `expected` arrived and nothing more comes."""
    out = []
    with Consumer(bootstrap, stream, start=start) as c:
        deadline = time.monotonic() + timeout_s
        while len(out) < expected:
            assert time.monotonic() < deadline, f"read {len(out)} of {expected} records"
            r = c.poll(timeout_s=0.5)
            if r is not None:
                out.append(r)
        assert c.poll(timeout_s=0.5) is None, "read more records than expected"
    return out


def expected_positions(records: list, t_ms: int) -> dict:
    """{(streamlet, group): offset} of the first record at or after t_ms in offset order, or
    the group's end: the answer by brute force over everything stored."""
    out: dict = {}
    for r in sorted(records, key=lambda r: (r.streamlet, r.group, r.offset)):
        key = (r.streamlet, r.group)
        found, end = out.get(key, (None, 0))
        if found is None and r.timestamp_ms >= t_ms:
            found = r.offset
        out[key] = (found, r.offset + 1)
    return {key: end if found is None else found for key, (found, end) in out.items()}


def check_answers(bootstrap: str, stream: str, everything: list) -> None:
    times = [BASE_MS - 1, BASE_MS, BASE_MS + 1, LATE_MS, ts_ms(1, 1, 2), BASE_MS + 1500,
             ts_ms(0, BATCHES - 1, PER_BATCH - 1), ts_ms(1, BATCHES - 1, PER_BATCH - 1) + 1]
    with Consumer(bootstrap, stream, start="latest") as c:
        for t in times:
            positions = c.offsets_for_times({(stream, sl): t for sl in range(STREAMLETS)})
            assert positions == c.offsets_for_times(stream=stream, timestamp_ms=t)
            want = expected_positions(everything, t)
            got = {(p.streamlet, p.group): p.offset for p in positions}
            # A group past the stored ones (all of them finished and before t: a restarted
            # broker closed them) is where later records will go: from its start.
            assert all(off == 0 for k, off in got.items() if k not in want), t
            assert {k: v for k, v in want.items() if k in got} == {
                k: v for k, v in got.items() if k in want}, t
            # Groups the positions leave out: below the lowest listed, finished and wholly
            # before t (at their end); above the highest, wholly at or after t (at 0).
            low = {sl: min(g for s, g in got if s == sl) for sl in range(STREAMLETS)}
            assert all(want[sl, g] == (end_of(everything, (sl, g)) if g < low[sl] else 0)
                       for sl, g in want if (sl, g) not in got), t
            # Reading from the positions gets exactly the records at or past them.
            after = [r for r in everything if r.offset >= want[(r.streamlet, r.group)]]
            read = read_all(bootstrap, stream, positions, len(after))
            assert sorted(ident(r) for r in read) == sorted(ident(r) for r in after), t


def end_of(records: list, key: tuple) -> int:
    return 1 + max(r.offset for r in records if (r.streamlet, r.group) == key)


def ident(r) -> tuple:
    return r.streamlet, r.group, r.offset, r.value, r.timestamp_ms


def test_offsets_for_times_lands_on_the_first_record_at_or_after(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING")
    stream = "seek-time"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=STREAMLETS, active_groups=2)
    produce(cluster.bootstrap, stream)
    total = STREAMLETS * (BATCHES * PER_BATCH + 1)
    everything = read_all(cluster.bootstrap, stream, "earliest", total)
    assert len({(r.streamlet, r.group) for r in everything}) == 2 * STREAMLETS
    check_answers(cluster.bootstrap, stream, everything)

    # seek_to_time on a live consumer: the next records are the ones at or after T.
    t = ts_ms(0, 2, 0)
    with Consumer(cluster.bootstrap, stream, streamlets=[0]) as c:
        c.seek_to_time(t)
        want = [r for r in everything if r.streamlet == 0
                and r.offset >= expected_positions(everything, t)[(0, r.group)]]
        got = [c.poll(timeout_s=10) for _ in want]
        assert sorted(map(ident, got)) == sorted(map(ident, want))
        assert {r.value for r in got} >= {b"0-2-0", b"0-3-4", b"0-late"}
        with pytest.raises(BadRequest, match="not assigned"):
            c.seek_to_time(t, parts=[(stream, 1)])
        with pytest.raises(BadRequest, match="milliseconds"):
            c.seek_to_time(t * 1000)

    # An orderly restart (R=1: reloaded from the broker's disk): the index is rebuilt.
    d = cluster.brokers[0]
    d.signal(15)
    assert d.wait(30.0) == 0
    cluster.restart_broker(0)
    with cluster.admin() as admin:
        admin.wait_ready(stream, 20.0)
    check_answers(cluster.bootstrap, stream, everything)


def kera_cli(bootstrap: str, *args) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "kera", *args, "--bootstrap", bootstrap],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_consume_from_time_and_group_reset_to_datetime(local_cluster):
    cluster = local_cluster(brokers=1, log_level="WARNING")
    stream = "seek-cli"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=1)
    with Producer(cluster.bootstrap) as p:
        for i in range(10):
            p.send(stream, b"r%d" % i, timestamp_ms=BASE_MS + 1000 * i)
        p.flush()
    # ISO 8601 without a zone is UTC; milliseconds work too.
    iso = datetime.fromtimestamp((BASE_MS + 5000) / 1000, timezone.utc).replace(tzinfo=None)
    code, out, err = kera_cli(cluster.bootstrap, "consume", stream, "--from-time",
                              iso.isoformat(), "--timeout-s", "1")
    assert code == 0, err
    assert out.split() == [f"r{i}" for i in range(5, 10)]
    code, out, err = kera_cli(cluster.bootstrap, "consume", stream, "--from-time",
                              str(BASE_MS + 5500), "--timeout-s", "1")
    assert (code, out.split()) == (0, [f"r{i}" for i in range(6, 10)]), err
    code, _, err = kera_cli(cluster.bootstrap, "consume", stream, "--from-time", "yesterday")
    assert code == 1 and "ISO 8601" in err
    code, _, err = kera_cli(cluster.bootstrap, "consume", stream, "--from-time",
                            str(BASE_MS // 1000))
    assert code == 1 and "milliseconds" in err

    group = "seek-cli-group"
    code, out, err = kera_cli(cluster.bootstrap, "group", "reset-positions", group, "--stream",
                              stream, "--to-datetime", f"{iso.isoformat()}Z", "--execute")
    assert code == 0, err
    assert "first records at or after" in out
    with Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=None) as c:
        got = [c.poll(timeout_s=20) for _ in range(5)]
        assert [r.value for r in got] == [b"r%d" % i for i in range(5, 10)]
        assert c.poll(timeout_s=0.5) is None


def test_empty_streamlets_and_a_group_member_seeking_by_time(local_cluster):
    cluster = local_cluster(brokers=1, log_level="WARNING")
    stream = "seek-member"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=2)
    with Consumer(cluster.bootstrap, stream, streamlets=[]) as c:
        # No data yet: every streamlet from its start (records produced later are read).
        assert [(p.streamlet, p.group, p.offset) for p in
                c.offsets_for_times(stream=stream, timestamp_ms=BASE_MS)] == [(0, 0, 0), (1, 0, 0)]
        with pytest.raises(BadRequest, match="streamlets 0..1, not 2"):
            c.offsets_for_times({(stream, 2): BASE_MS})
    with Producer(cluster.bootstrap) as p:
        for i in range(10):
            p.send(stream, b"m%d" % i, timestamp_ms=BASE_MS + 1000 * i, streamlet=i % 2)
        p.flush()
    with Consumer(cluster.bootstrap, stream, group="seek-member-group",
                  auto_commit_interval_ms=None) as c:
        deadline = time.monotonic() + 20
        while len(c.assignment()) < 2:
            assert time.monotonic() < deadline, "no assignment"
            c.poll(timeout_s=0.2)
        c.seek_to_time(BASE_MS + 6000)   # what is assigned: both streamlets
        got = sorted(c.poll(timeout_s=20).value for _ in range(4))
        assert got == [b"m6", b"m7", b"m8", b"m9"]
        assert c.poll(timeout_s=0.5) is None
