"""Consumer groups against a real local cluster: members share a stream's streamlets, hand
them over with no duplicate and no gap, commit positions that survive a coordinator kill -9,
are refused when stale, survive a broker failover, and show their lag.

Values are `b"<n>"`: every record read names which one it is, so a test counts exactly.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from kera import Consumer, Producer

from kera.net import rpc
from kera.errors import BadRequest, GroupNotEmpty, StaleMemberEpoch, UnknownMember

STREAMLETS = 4
SETTLE_TIMEOUT_S = 30.0
_names = itertools.count()


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=1, log_level="WARNING")


def new_stream(cluster, records=0):
    name = f"grp-{next(_names)}"
    with cluster.admin() as admin:
        admin.create_stream(name, streamlets=STREAMLETS)
    produce(cluster, name, 0, records)
    return name


def produce(cluster, stream, start, n):
    with Producer(cluster.bootstrap) as p:
        for i in range(start, start + n):
            p.send(stream, str(i).encode(), key=str(i).encode())
        p.flush()


def until(condition, what, timeout_s=SETTLE_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def read(consumers, values: list, until_count: int, timeout_s=SETTLE_TIMEOUT_S):
    """Poll every consumer in turn until `values` holds `until_count` records."""
    deadline = time.monotonic() + timeout_s
    while len(values) < until_count:
        assert time.monotonic() < deadline, f"{len(values)} of {until_count} records read"
        for c in consumers:
            r = c.poll(timeout_s=0.05)
            if r is not None:
                values.append(int(r.value))


def call(cluster, op, **fields):
    return rpc.call(cluster.bootstrap, op, fields)[0]


def test_members_share_the_streamlets_and_hand_over_without_duplicates(cluster):
    stream = new_stream(cluster, records=400)
    group = f"g-{stream}"
    values: list[int] = []
    a = Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=100)
    try:
        until(lambda: len(a.assignment()) == STREAMLETS, "the lone member gets every streamlet")
        read([a], values, 150)
        b = Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=100)
        try:
            # Keep both polling while the group moves half of a's streamlets to b.
            def settled():
                read([a, b], values, len(values) + 1, timeout_s=0.2) if len(values) < 400 else None
                return len(a.assignment()) == len(b.assignment()) == STREAMLETS // 2
            until(settled, "two members with two streamlets each")
            assert set(a.assignment()).isdisjoint(b.assignment())
            read([a, b], values, 400)
            produce(cluster, stream, 400, 200)
            read([a, b], values, 600)
        finally:
            b.close()
        until(lambda: len(a.assignment()) == STREAMLETS, "b's streamlets come back to a")
        produce(cluster, stream, 600, 100)
        read([a], values, 700)
    finally:
        a.close()
    assert sorted(values) == list(range(700)), "every record exactly once across the handovers"


def test_a_new_member_resumes_from_the_commits_after_a_coordinator_kill(fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING")
    stream = new_stream(cluster, records=300)
    group = "resume"
    values: list[int] = []
    with Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=None) as a:
        until(lambda: len(a.assignment()) == STREAMLETS, "assignment")
        read([a], values, 120)
        a.commit()
        committed = a.committed()
        assert {(p.stream, p.streamlet) for p in committed} == set(a.assignment())
    cluster.kill_coordinator()
    cluster.restart_coordinator()
    with Consumer(cluster.bootstrap, stream, group=group) as b:
        read([b], values, 300)
        assert b.poll(timeout_s=0.5) is None
    assert sorted(values) == list(range(300)), "no gap, no duplicate across the kill -9"


PAUSE_S = 1.5              # the coordinator stopped: three of the commit's request timeouts
COMMIT_REQUEST_TIMEOUT_S = 0.5


def test_a_commit_outlasts_a_coordinator_that_stops_answering_for_a_moment(cluster):
    stream = new_stream(cluster, records=100)
    values: list[int] = []
    with Consumer(cluster.bootstrap, stream, group=f"g-{stream}", auto_commit_interval_ms=None,
                  request_timeout_s=COMMIT_REQUEST_TIMEOUT_S) as c:
        until(lambda: len(c.assignment()) == STREAMLETS, "assignment")
        read([c], values, 100)
        held = c.positions()
        coordinator = cluster.coordinators[0]
        coordinator.signal(signal.SIGSTOP)
        resume = threading.Timer(PAUSE_S, coordinator.signal, (signal.SIGCONT,))
        resume.start()
        try:
            c.commit(timeout_s=PAUSE_S + SETTLE_TIMEOUT_S)   # first tries time out; one lands
        finally:
            resume.cancel()
            coordinator.signal(signal.SIGCONT)
        assert sorted(c.committed()) == sorted(held)
        assert len(c.assignment()) == STREAMLETS      # still a member: no rebalance


def test_stale_members_and_busy_groups_are_refused(cluster):
    stream = new_stream(cluster)
    group = f"g-{stream}"
    with Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=None) as a:
        until(lambda: len(a.assignment()) == STREAMLETS, "assignment")
        with pytest.raises(UnknownMember):
            rpc.call(cluster.bootstrap, "group_commit", {
                "group": group, "member_id": "impostor", "member_epoch": 1,
                "positions": [[stream, 0, [[0, 0, None]]]]})
        m = a._membership
        with pytest.raises(StaleMemberEpoch):
            rpc.call(cluster.bootstrap, "group_commit", {
                "group": group, "member_id": m.member_id, "member_epoch": m.member_epoch + 5,
                "positions": [[stream, 0, [[0, 0, None]]]]})
        with pytest.raises(GroupNotEmpty):
            call(cluster, "group_delete", group=group)
        a.commit()     # a group with commits outlives its members (one without is forgotten)
        described = call(cluster, "group_describe", group=group)
        assert described["state"] == "stable"
        assert [len(m["assignment"]) for m in described["members"]] == [STREAMLETS]
    until(lambda: call(cluster, "group_describe", group=group)["members"] == [],
          "a closed consumer leaves its group at once")
    call(cluster, "group_delete", group=group)
    assert group not in [g["group"] for g in call(cluster, "group_list")["groups"]]


def kera_cli(cluster, *args):
    proc = subprocess.run([sys.executable, "-m", "kera", *args, "--bootstrap", cluster.bootstrap],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_group_command_shows_lag_resets_and_deletes(cluster):
    stream = new_stream(cluster, records=100)
    group = f"g-{stream}"
    values: list[int] = []
    with Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=None) as c:
        until(lambda: len(c.assignment()) == STREAMLETS, "assignment")
        read([c], values, 100)
        c.commit()
        code, out = kera_cli(cluster, "group", "delete", group)
        assert code == 1 and "live members" in out and "(group_not_empty)" in out
    produce(cluster, stream, 100, 40)
    code, out = kera_cli(cluster, "group", "describe", group, "--json")
    assert code == 0, out
    assert sum(n for _s, _sl, n in json.loads(out)["lag"]) == 40, "40 records behind the commits"
    behind_bytes = sum(n for _s, _sl, n in json.loads(out)["lag_bytes"])
    assert 0 < behind_bytes < stored_bytes(cluster, stream), "the new chunks only"
    code, out = kera_cli(cluster, "group", "list")
    assert code == 0 and group in out and "empty" in out
    code, out = kera_cli(cluster, "group", "reset-positions", group, "--stream", stream,
                         "--to", "earliest")   # a dry run: the plan, nothing changed
    assert code == 0 and "NEW-OFFSET" in out, out
    code, out = kera_cli(cluster, "group", "describe", group, "--json")
    assert code == 0 and sum(n for _s, _sl, n in json.loads(out)["lag"]) == 40, out
    lags = {(s, sl): n for s, sl, n in json.loads(out)["lag"]}
    ahead = {k: max(n - 3, 0) for k, n in lags.items()}     # clamped at the end
    lags = {k: n + 3 for k, n in ahead.items()}             # 100 records before: no clamp
    for shift, want in ((3, ahead), (-3, lags)):
        code, out = kera_cli(cluster, "group", "reset-positions", group, "--stream", stream,
                             "--shift-by", str(shift), "--execute")
        assert code == 0, out
        code, out = kera_cli(cluster, "group", "describe", group, "--json")
        assert {(s, sl): n for s, sl, n in json.loads(out)["lag"]} == want, shift
    code, out = kera_cli(cluster, "group", "reset-positions", group, "--stream", stream,
                         "--to-current", "--execute")
    assert code == 0 and "their committed positions" in out, out
    code, out = kera_cli(cluster, "group", "describe", group, "--json")
    assert {(s, sl): n for s, sl, n in json.loads(out)["lag"]} == lags
    code, out = kera_cli(cluster, "group", "reset-positions", group, "--all-streams",
                         "--to", "earliest", "--execute")
    assert code == 0, out
    code, out = kera_cli(cluster, "group", "describe", group, "--json")
    assert sum(n for _s, _sl, n in json.loads(out)["lag"]) == 140
    assert sum(n for _s, _sl, n in json.loads(out)["lag_bytes"]) == stored_bytes(cluster, stream)
    code, out = kera_cli(cluster, "group", "describe", group)
    assert code == 0 and "LAG BYTES" in out, out
    with Consumer(cluster.bootstrap, stream, group=group) as c:
        again: list[int] = []
        read([c], again, 140)
    assert sorted(again) == list(range(140))
    assert kera_cli(cluster, "group", "delete", group)[0] == 0
    assert group not in kera_cli(cluster, "group", "list")[1]


def stored_bytes(cluster, stream) -> int:
    """Bytes of every chunk of `stream`, as stored (read from the start, batch by batch)."""
    total, records = 0, 0
    with Consumer(cluster.bootstrap, stream, start="earliest") as c:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            batches = c.poll_batch(timeout_s=0.5)
            if not batches and records and sum(c.lag().values()) == 0:
                return total
            for b in batches:
                assert b.skip == 0, "read from the start: whole chunks"
                total += b.chunk.header.size
                records += len(b)
    raise AssertionError(f"{stream} not read to its end within {SETTLE_TIMEOUT_S} s")


def test_a_pattern_member_reads_streams_created_after_it_joined(cluster):
    first = new_stream(cluster, records=30)
    group = f"g-pattern-{first}"
    values: list[int] = []
    with Consumer(cluster.bootstrap, [], group=group, pattern=f"{first}.*") as c:
        read([c], values, 30)
        with cluster.admin() as admin:
            admin.create_stream(f"{first}-later", streamlets=2)
        produce(cluster, f"{first}-later", 100, 20)
        read([c], values, 50)
        assert {s for s, _ in c.assignment()} == {first, f"{first}-later"}
    assert sorted(values) == list(range(30)) + list(range(100, 120))


def scrape(port: int) -> str:
    from urllib.request import urlopen
    return urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SETTLE_TIMEOUT_S).read().decode()


def gauges(text: str, name: str, group: str) -> dict:
    """{(stream, streamlet): value} of a labelled gauge for one group."""
    out = {}
    for line in text.splitlines():
        if line.startswith(f'{name}{{group="{group}"'):
            labels, value = line.rsplit(" ", 1)
            stream = labels.split('stream="')[1].split('"')[0]
            out[(stream, int(labels.split('streamlet="')[1].split('"')[0]))] = int(float(value))
    return out


def test_the_coordinator_exports_each_committed_parts_lag(fresh_cluster):
    from kera.cli.local import free_port
    port = free_port()
    cluster = fresh_cluster(brokers=1, backups=1, log_level="WARNING",
                            extra_coordinator_args=["--metrics-port", str(port),
                                                    "--metrics-stream-labels"])
    stream = new_stream(cluster, records=100)
    values: list[int] = []
    with Consumer(cluster.bootstrap, stream, group="lagging", auto_commit_interval_ms=None) as c:
        read([c], values, 100)
        c.commit()
    produce(cluster, stream, 100, 40)
    # The gauges follow the commits within a coordinator tick plus the scrape cache.
    seen = {}
    until(lambda: seen.update(text=scrape(port)) or sum(
        gauges(seen["text"], "kera_group_lag_records", "lagging").values()) == 40,
        "the commits' lag exported")
    text = seen["text"]
    records = gauges(text, "kera_group_lag_records", "lagging")
    assert set(records) == {(stream, sl) for sl in range(STREAMLETS)}
    size = gauges(text, "kera_group_lag_bytes", "lagging")
    assert all((size[p] > 0) == (records[p] > 0) for p in records), text



def fail_over(cluster, stream) -> None:
    """kill -9 the broker holding streamlet 0; return once its streamlets are served again."""
    with cluster.admin() as admin:
        victim = admin.describe_stream(stream)["placement"][0]
        cluster.kill_broker(victim)
        until(lambda: victim not in admin.describe_stream(stream)["placement"],
              "the dead broker's streamlets placed elsewhere")
        admin.wait_ready(stream, SETTLE_TIMEOUT_S)


def replicated_stream(cluster) -> str:
    stream = f"grp-failover-{next(_names)}"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=STREAMLETS, replication=2)
    return stream


def test_committed_positions_survive_a_broker_failover(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=1, log_level="WARNING")
    stream = replicated_stream(cluster)
    produce(cluster, stream, 0, 400)
    values: list[int] = []
    with Consumer(cluster.bootstrap, stream, group="survivor", auto_commit_interval_ms=None) as a:
        until(lambda: len(a.assignment()) == STREAMLETS, "assignment")
        read([a], values, 250)
        a.commit()
    before = call(cluster, "group_describe", group="survivor")["positions"]
    fail_over(cluster, stream)
    assert call(cluster, "group_describe", group="survivor")["positions"] == before
    produce(cluster, stream, 400, 100)    # to every streamlet, the moved ones included
    again: list[int] = []
    with Consumer(cluster.bootstrap, stream, group="survivor", auto_commit_interval_ms=None) as b:
        read([b], again, 500 - len(values))
        assert b.poll(timeout_s=0.5) is None
    assert not set(again) & set(values), "no record before the commit is read again"
    assert sorted(values + again) == list(range(500)), "and none after it is missed"


def test_a_member_reading_through_a_failover_commits_positions_a_successor_resumes(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=1, log_level="WARNING")
    stream = replicated_stream(cluster)
    produce(cluster, stream, 0, 300)
    values: list[int] = []
    with Consumer(cluster.bootstrap, stream, group="through", auto_commit_interval_ms=None) as a:
        until(lambda: len(a.assignment()) == STREAMLETS, "assignment")
        read([a], values, 150)
        a.commit()
        fail_over(cluster, stream)
        produce(cluster, stream, 300, 100)
        read([a], values, 320)            # from the new owner of the moved streamlets
        a.commit()
    again: list[int] = []
    with Consumer(cluster.bootstrap, stream, group="through", auto_commit_interval_ms=None) as b:
        read([b], again, 400 - len(values))
        assert b.poll(timeout_s=0.5) is None
    assert not set(again) & set(values), "no record before the last commit is read again"
    assert sorted(values + again) == list(range(400))


def test_commit_of_a_message_and_an_asynchronous_commit_as_confluent_kafka_has_them(cluster):
    stream = new_stream(cluster, records=40)
    group = f"g-{stream}"
    with Consumer(cluster.bootstrap, stream, group=group, auto_commit_interval_ms=None) as c:
        until(lambda: len(c.assignment()) == STREAMLETS, "assignment")
        records = []
        while len(records) < 40:
            r = c.poll(timeout_s=0.5)
            if r is not None:
                records.append(r)
        target = records[10]
        c.commit(message=target)      # that record's streamlet: resume right after it
        mine = [p for p in c.committed([(stream, target.streamlet)])]
        assert [(p.group, p.offset) for p in mine] == [(target.group, target.offset + 1)]
        c.commit(asynchronous=True)   # everything handed out, without waiting
        until(lambda: sum(c.lag_of(c.committed()).values()) == 0, "the asynchronous commit")
        with pytest.raises(BadRequest, match="positions or message"):
            c.commit(c.positions(), message=target)
