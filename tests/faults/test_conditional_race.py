"""Conditional appends racing from several processes across a broker kill -9 (issue 16): writer
processes append with locks and high-water marks to one streamlet while its broker is killed
and the streamlet fails over. Read back afterwards, the stream holds exactly the appends the
brokers accepted, numbered 0..N-1 with none twice, and

* none of them conflicts with an earlier one (no lock of it was written after its mark);
* every refused append had a real conflict in the stream (its lock written after its mark);
* every writer's answer matches the stream (an accepted append is there at the number it was
  told; a refused one is not there at all);
* a lock written before the failover still refuses a stale writer after it (the new owner
  rebuilt the lock table from the replicated records)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import faultkit as fk
from faultkit import call, wait_for

from kera import Consumer

from kera.codec import chunk
from kera.services.conditional import ConditionalAppender
from kera.errors import LockConflict

STREAM = "ledger"
WRITERS = 4
APPENDS = 120            # per writer: a few seconds of appends, with a failover in the middle
LOCKS = 6                # few locks among four writers: many conflicts
KILL_AFTER_RESULTS = 150
WRITERS_TIMEOUT_S = 240.0
PROBE = 99               # the test's own writer id; its lock is none of the writers'
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Writer:
    def __init__(self, cluster, w: int):
        self.results: list[dict] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.conditional_writer", cluster.bootstrap, STREAM,
             str(w), str(APPENDS), str(LOCKS), str(1000 + w)],
            stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.results.append(json.loads(line))


def read_back(bootstrap: str, expected_min: int) -> list:
    """Every record, as (number, value, headers), once no more arrive."""
    out: list = []
    with Consumer(bootstrap, STREAM, request_timeout_s=3.0) as c:
        deadline = time.monotonic() + fk.WAIT_S
        quiet = 0
        while quiet < 10 or len(out) < expected_min:
            r = c.poll(timeout_s=0.2)
            quiet = quiet + 1 if r is None else 0
            if r is not None:
                out.append((r.number, r.value, r.headers))
            assert time.monotonic() < deadline, f"read {len(out)} of at least {expected_min}"
    return out


def appends_of(records) -> list[dict]:
    """The stored appends in number order: writer, index, locks, mark, first and last number."""
    out = []
    for number, value, headers in sorted(records, key=lambda r: r[0]):
        w, i, k = map(int, value.split(b"-"))
        if k == 0:
            found = dict(headers[:2])
            locks = [int(x) for x in
                     memoryview(found[chunk.CONDITION_LOCKS_HEADER]).cast("Q").tolist()]
            hwm = int.from_bytes(found[chunk.CONDITION_HWM_HEADER], "little", signed=True)
            out.append({"w": w, "i": i, "locks": locks, "hwm": hwm, "first": number, "last": number})
        else:
            assert out and (out[-1]["w"], out[-1]["i"]) == (w, i), f"append {w}-{i} split"
            out[-1]["last"] = number
    return out


def check_history(appends: list[dict]) -> dict[int, list[int]]:
    """No stored append conflicts with an earlier one; returns each lock's write numbers."""
    written: dict[int, list[int]] = {}
    for a in appends:
        for lock in a["locks"]:
            last = written.get(lock, [-1])[-1]
            assert last <= a["hwm"], (f"append {a['w']}-{a['i']} at {a['first']} with mark "
                                      f"{a['hwm']} was accepted though lock {lock} was written at {last}")
        for lock in a["locks"]:
            written.setdefault(lock, []).append(a["last"])
    return written


def test_racing_conditional_appends_keep_exactly_the_non_conflicting_ones_across_a_failover(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=2, heartbeat_interval_ms=100, log_level="INFO",
                            extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=1, replication=2)
    writers = [Writer(cluster, w) for w in range(WRITERS)]
    wait_for(lambda: sum(len(w.results) for w in writers) >= KILL_AFTER_RESULTS,
             "the writers to get going")
    probe = ConditionalAppender(cluster.bootstrap, timeout_s=60.0, request_timeout_s=3.0)
    before = probe.append(STREAM, [b"%d-0-0" % PROBE], locks=[LOCKS], high_water_mark=-1)
    owner = call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]["placement"][0]
    cluster.kill_broker(owner)
    killed_at = sum(len(w.results) for w in writers)
    wait_for(lambda: call(cluster.bootstrap, "recovery_status")["failed"], "the failover")
    try:
        probe.append(STREAM, [b"%d-1-0" % PROBE], locks=[LOCKS], high_water_mark=before.number - 1)
        raise AssertionError("a stale append of a lock written before the failover was accepted")
    except LockConflict as err:
        assert (err.lock, err.number) == (LOCKS, before.number)
    after = probe.append(STREAM, [b"%d-2-0" % PROBE], locks=[LOCKS], high_water_mark=before.number)
    probe.close()
    cluster.restart_broker(owner)
    for w in writers:
        w.proc.wait(WRITERS_TIMEOUT_S)
        w.reader.join(10)
    results = [r for w in writers for r in w.results]
    assert len(results) == WRITERS * APPENDS
    assert killed_at < len(results), "the kill came after every append"
    ok = {(r["w"], r["i"]): r for r in results if "ok" in r}
    ok[(PROBE, 0)] = {"ok": before.number, "n": 1}
    ok[(PROBE, 2)] = {"ok": after.number, "n": 1}
    refused = [r for r in results if "conflict" in r]
    uncertain = {(r["w"], r["i"]) for r in results if "uncertain" in r}
    assert ok and refused, (len(ok), len(refused))

    records = read_back(cluster.bootstrap, sum(r["n"] for r in ok.values()))
    numbers = sorted(n for n, _, _ in records)
    assert numbers == list(range(len(numbers))), "record numbers not dense, or one given twice"
    appends = appends_of(records)
    written = check_history(appends)
    stored = {(a["w"], a["i"]): a for a in appends}
    assert len(stored) == len(appends), "an append stored twice"
    for key, r in ok.items():
        assert key in stored and stored[key]["first"] == r["ok"], f"accepted {key} not at {r['ok']}"
    for key in stored:
        assert key in ok or key in uncertain, f"{key} stored, but its writer was told it was refused"
    for r in refused:
        lock, number = r["conflict"]
        assert lock in r["locks"] and number > r["hwm"]
        assert any(n > r["hwm"] for n in written.get(lock, [])), (
            f"{r['w']}-{r['i']} refused on lock {lock}, never written after {r['hwm']}")
    print(f"{len(ok)} accepted, {len(refused)} refused, {len(uncertain)} uncertain; "
          f"{len(numbers)} records; broker {owner} killed after {killed_at} answers")


OUTAGE_S = 6.0   # the coordinator down: longer than two of the append's request timeouts


def test_a_conditional_append_rides_out_a_coordinator_outage_and_a_failover(fresh_cluster):
    """The streamlet's broker dies while the coordinator is down: the append's attempts fail,
    and so do its placement refreshes, until the coordinator is back and has failed the
    streamlet over. The append then lands once, numbered right after the one before."""
    cluster = fresh_cluster(brokers=2, backups=2, heartbeat_interval_ms=100, log_level="INFO",
                            extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=1, replication=2)
    appender = ConditionalAppender(cluster.bootstrap, timeout_s=90.0, request_timeout_s=2.0)
    first = appender.append(STREAM, [b"%d-0-0" % PROBE], locks=[1], high_water_mark=-1)
    owner = call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]["placement"][0]
    cluster.kill_coordinator()
    cluster.kill_broker(owner)
    outcome: dict = {}

    def append() -> None:
        try:
            outcome["ok"] = appender.append(STREAM, [b"%d-1-0" % PROBE], locks=[1],
                                            high_water_mark=first.number)
        except Exception as err:   # the assertion below shows it
            outcome["error"] = err
    thread = threading.Thread(target=append, daemon=True)
    thread.start()
    time.sleep(OUTAGE_S)
    assert thread.is_alive(), f"the append ended during the outage: {outcome}"
    cluster.restart_coordinator()
    thread.join(fk.WAIT_S)
    appender.close()
    assert "ok" in outcome, outcome
    assert outcome["ok"].number == first.number + 1
    cluster.restart_broker(owner)
    records = read_back(cluster.bootstrap, 2)
    assert sorted(n for n, _, _ in records) == [0, 1]


LONG_REQUEST_TIMEOUT_S = 60.0   # far longer than a failover (~3 s here)


def test_an_append_to_a_killed_owner_goes_to_the_new_owner_without_waiting_out_its_timeout(
        fresh_cluster):
    """The owner dies with the writer connected to it: the writer notices the streamlet moved
    (it asks while it waits) and appends at the new owner, long before its request timeout."""
    cluster = fresh_cluster(brokers=2, backups=2, heartbeat_interval_ms=100, log_level="INFO",
                            extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=1, replication=2)
    appender = ConditionalAppender(cluster.bootstrap, timeout_s=2 * LONG_REQUEST_TIMEOUT_S,
                                   request_timeout_s=LONG_REQUEST_TIMEOUT_S)
    try:
        first = appender.append(STREAM, [b"%d-0-0" % PROBE], locks=[1], high_water_mark=-1)
        owner = call(cluster.bootstrap, "describe_stream",
                     {"name": STREAM})["stream"]["placement"][0]
        cluster.kill_broker(owner)
        started = time.monotonic()
        second = appender.append(STREAM, [b"%d-1-0" % PROBE], locks=[1],
                                 high_water_mark=first.number)
        waited_s = time.monotonic() - started
    finally:
        appender.close()
    assert second.number == first.number + 1
    assert waited_s < LONG_REQUEST_TIMEOUT_S / 2, f"waited {waited_s:.1f} s for a dead owner"
    cluster.restart_broker(owner)
    assert sorted(n for n, _, _ in read_back(cluster.bootstrap, 2)) == [0, 1]
