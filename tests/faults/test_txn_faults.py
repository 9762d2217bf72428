"""Transactions across kill -9 (issue 39; docs/TRANSACTIONS.md, "The two phases and what
recovery does"): a read-process-write loop (tests/faults/txn_loop.py: consume A in a group,
write one record per input to B and one to C, join the positions, commit) runs as its own
process while the test feeds A.

* The loop itself is killed -9 at seeded random moments and restarted with the same
  transactional id, whose `init` fences the dead instance and ends what it left open.
* The broker owning an output streamlet, a backup, the coordinator (restarted from its
  --dir) or the leader of three coordinators on etcd is killed -9 under the running loop.

Afterwards, read_committed: B and C each hold one output of every input the group's committed
position has passed, exactly once, and none of any input at or after it (nothing of an aborted
or half-done transaction); then the loop drains A, and B and C hold each input's outputs
exactly once. Each loop run's events are kept in the cluster's log dir (txn-loop-N.log).

Also here: docs/TRANSACTIONS.md's loop as written there (`consumer.group_metadata()` read
after the batch), with the coordinator restarted between the poll and the commit, never
commits the batch's outputs without its positions (group_metadata() is the member's as of
the poll that handed the batch out, so the coordinator refuses it); and positions at a stale
member epoch make the transaction abortable at once.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import pytest

import faultkit as fk
from faultkit import call, wait_for

from kera import Consumer, Producer
from kera.consumer.membership import positions_from_wire
from kera.errors import InvalidTxnState, KeraError, StaleMemberEpoch

SOURCE, SINKS = "A", ("B", "C")
STREAMLETS = 2
GROUP = "enrich"
TID = "enrich-0"
FEED_PER_S = 400                # input records per second while the loop runs
FEED_BATCH = 20
LOOP_KILLS_FAST, LOOP_KILLS_FULL = 5, 20
KILL_AFTER_S = (0.3, 1.5)       # from the loop's start: before, during and after its init
STARTUP_KILL_EVERY = 4          # one kill in this many lands there; the others in a transaction
KILL_AFTER_COMMITS_MAX = 30
IN_TRANSACTION_S = 0.05         # after a commit: the next transaction is being sent or ended
FEED_AFTER_S = 0.5              # inputs after the last kill: left for the drain
DRAIN_IDLE_S = 2.0              # the draining loop stops after this long with nothing to read
DRAIN_RUNS_MAX = 5              # a drain that fails (a failover under it) is started again
LOOP_RESTARTS_MAX = 20          # a loop exiting on errors under one daemon kill
COMMITS_BEFORE_KILL = 3         # the victim dies under a loop that is committing
COMMITS_AFTER_KILL = 5          # and the loop must commit again afterwards
QUIET_S = 1.0                   # a read-back ends this long after the last record it expected
READ_TIMEOUT_S = fk.WAIT_S
LOOP_EXIT_S = 120.0             # a draining loop: the input left, plus a failover
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_prefixes = itertools.count()
_runs = itertools.count()


def txn_cluster(fresh_cluster, coordinators: int = 1, extra_coordinator_args=()):
    cluster = fresh_cluster(brokers=2, backups=2, heartbeat_interval_ms=100, log_level="INFO",
                            coordinators=coordinators, extra_coordinator_args=[
                                "--heartbeat-missed-max", "30", *extra_coordinator_args])
    with cluster.admin(timeout_s=fk.WAIT_S) as admin:
        for name in (SOURCE, *SINKS):
            admin.create_stream(name, streamlets=STREAMLETS, replication=2)
    return cluster


class Feeder:
    """A plain producer writing inputs b"in-%08d" to A until stopped; all acknowledged."""

    def __init__(self, bootstrap: str):
        self.sent = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bootstrap,), daemon=True)
        self._thread.start()

    def _run(self, bootstrap: str) -> None:
        try:
            with Producer(bootstrap, request_timeout_s=3.0, retries_max=1000, linger_ms=5,
                          send_timeout_s=120.0) as p:
                while not self._stop.wait(FEED_BATCH / FEED_PER_S):
                    values = [b"in-%08d" % n for n in range(self.sent, self.sent + FEED_BATCH)]
                    p.send_batch(SOURCE, values, keys=values)
                    self.sent += FEED_BATCH
                p.flush(timeout=120.0)
        except Exception as err:   # noqa: BLE001 - the test asserts there is none
            self.errors.append(repr(err))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(180)
        assert not self._thread.is_alive() and not self.errors, f"feeding A: {self.errors}"
        return self.sent


class Loop:
    """One run of tests/faults/txn_loop.py and the events it printed."""

    def __init__(self, cluster, idle_exit_s: float = 0.0):
        self.events: list[dict] = []
        self.log_path = cluster.log_dir / f"txn-loop-{next(_runs)}.log"   # kept for a failure
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.txn_loop", cluster.bootstrap, TID, GROUP,
             str(idle_exit_s)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.events.append(json.loads(line))

    def commits(self) -> int:
        return sum("committed" in e for e in self.events)

    def errors(self) -> list[str]:
        return [e["error"] for e in self.events if "error" in e]

    def kill(self) -> None:
        self.proc.kill()
        self.wait(10)

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout_s)
        self._reader.join(10)
        return rc


class Supervised:
    """The loop kept running (restarted when it exits on an error) until `stop()`, which kills
    it -9 wherever it is."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.runs: list[Loop] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.runs) <= LOOP_RESTARTS_MAX:
            loop = Loop(self.cluster)
            self.runs.append(loop)
            loop.proc.wait()

    def commits(self) -> int:
        return sum(run.commits() for run in self.runs)

    def stop(self) -> None:
        self._stop.set()
        self.runs[-1].kill()
        self._thread.join(30)
        assert not self._thread.is_alive()


def drain(cluster) -> None:
    """Run the loop until A is drained (it exits 0 when idle), again if a run fails."""
    for _ in range(DRAIN_RUNS_MAX):
        loop = Loop(cluster, idle_exit_s=DRAIN_IDLE_S)
        rc = loop.wait(LOOP_EXIT_S)
        if rc == 0:
            return
        print(f"draining loop exited {rc}: {loop.errors()}")
    raise AssertionError(f"the loop did not drain A in {DRAIN_RUNS_MAX} runs")


def read_values(bootstrap: str, stream: str, expected: int, start="earliest",
                isolation_level="read_committed") -> list[bytes]:
    """Every value of `stream` from `start`: at least `expected`, then until nothing more
    comes for QUIET_S."""
    out: list[bytes] = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    last = time.monotonic()
    with Consumer(bootstrap, stream, start=start, request_timeout_s=3.0,
                  isolation_level=isolation_level) as c:
        while len(out) < expected or time.monotonic() - last < QUIET_S:
            assert time.monotonic() < deadline, f"{stream}: read {len(out)} of {expected}"
            r = c.poll(timeout_s=0.1)
            if r is not None:
                out.append(r.value)
                last = time.monotonic()
    return out


def settle(cluster) -> None:
    """Fence the loop's last instance the way its successor would: once `init` returns,
    every transaction of the id is complete (committed with its markers, or aborted)."""
    with Producer(cluster.bootstrap, transactional_id=TID, request_timeout_s=3.0) as p:
        p.init_transactions(timeout_s=fk.WAIT_S)


def check_exactly_once(cluster, fed: int, who: str) -> int:
    """B and C hold one output of each input before the group's committed positions, once,
    and none of the inputs from there on. Returns how many inputs that is."""
    settle(cluster)
    inputs = read_values(cluster.bootstrap, SOURCE, fed)
    assert len(inputs) == len(set(inputs)) == fed, f"{who}: A holds {len(inputs)} of {fed}"
    committed = positions_from_wire(call(cluster.bootstrap, "group_offsets",
                                         {"group": GROUP})["positions"])
    remaining = read_values(cluster.bootstrap, SOURCE, 0, start=committed or "earliest")
    assert len(remaining) == len(set(remaining)) and set(remaining) <= set(inputs)
    done = set(inputs) - set(remaining)
    for sink in SINKS:
        outputs = collections.Counter(read_values(cluster.bootstrap, sink, len(done)))
        tag = sink.encode() + b":"
        twice = sorted(v for v, n in outputs.items() if n > 1)
        assert not twice, f"{who}: {len(twice)} outputs in {sink} twice, e.g. {twice[:3]}"
        got = {v[len(tag):] for v in outputs}
        assert all(v.startswith(tag) for v in outputs)
        lost = sorted(done - got)
        assert not lost, (f"{who}: {len(lost)} inputs before the committed position have no "
                          f"output in {sink}, e.g. {lost[:3]}")
        beyond = sorted(got - done)
        assert not beyond, (f"{who}: {len(beyond)} inputs at or after the committed position "
                            f"have an output in {sink}, e.g. {beyond[:3]}")
    print(f"{who}: {fed} inputs, {len(done)} processed exactly once into {' and '.join(SINKS)}, "
          f"{len(remaining)} left")
    return len(done)


def check_drained(cluster, fed: int, who: str) -> None:
    drain(cluster)
    assert check_exactly_once(cluster, fed, who) == fed, f"{who}: A was not drained"
    problems = fk.log_problems(cluster)
    assert not problems, f"{who}: daemon logs report errors: {problems}"


# ------------------------------------------------------------------ the loop killed -9

def kill_point(loop: Loop, rng) -> None:
    """Wait for a random point of the loop's life: its start and init (one kill in
    STARTUP_KILL_EVERY), else a random moment of a transaction after a few commits."""
    if rng.randrange(STARTUP_KILL_EVERY) == 0:
        time.sleep(rng.uniform(*KILL_AFTER_S))
        return
    commits = rng.randint(1, KILL_AFTER_COMMITS_MAX)
    wait_for(lambda: loop.commits() >= commits or loop.proc.poll() is not None,
             f"the loop to commit {commits} times")
    time.sleep(rng.uniform(0, IN_TRANSACTION_S))


def kill_loop_rounds(cluster, kills: int, rng) -> None:
    commits = 0
    for k in range(kills):
        loop = Loop(cluster)
        kill_point(loop, rng)
        if loop.proc.poll() is not None:
            print(f"kill {k}: the loop had exited: {loop.errors()}")
        loop.kill()
        commits += loop.commits()
        print(f"kill {k}: -9 after {loop.commits()} commits")
    assert commits > kills, f"only {commits} commits in {kills} runs: the kills came too early"


@pytest.mark.parametrize("kills", [
    pytest.param(LOOP_KILLS_FAST, id="5-kills"),
    pytest.param(LOOP_KILLS_FULL, id="20-kills", marks=pytest.mark.slow),
])
def test_a_loop_killed_at_random_points_outputs_each_input_once(fresh_cluster, kills):
    rng = fk.seeded(f"transactional loop, {kills} kills")
    cluster = txn_cluster(fresh_cluster)
    feeder = Feeder(cluster.bootstrap)
    kill_loop_rounds(cluster, kills, rng)
    time.sleep(FEED_AFTER_S)
    fed = feeder.stop()
    check_exactly_once(cluster, fed, f"after {kills} kills")
    check_drained(cluster, fed, "drained")
    stored = read_values(cluster.bootstrap, SINKS[0], fed, isolation_level="read_uncommitted")
    print(f"{SINKS[0]} stores {len(stored) - fed} outputs of aborted transactions")


# ------------------------------------------------------------------ a daemon killed -9

def owner_of_output(cluster) -> int:
    return call(cluster.bootstrap, "describe_stream", {"name": SINKS[0]})["stream"]["placement"][0]


def kill_output_owner(cluster) -> str:
    owner = owner_of_output(cluster)
    cluster.kill_broker(owner)
    wait_for(lambda: owner_of_output(cluster) != owner, f"{SINKS[0]}/0 to fail over")
    cluster.restart_broker(owner)
    return f"broker {owner} (owning {SINKS[0]}/0)"


def kill_backup(cluster) -> str:
    cluster.kill_backup(0)
    wait_for(lambda: not call(cluster.bootstrap, "cluster")["backups"][0]["alive"],
             "backup 0 to be declared dead")
    cluster.restart_backup(0)
    return "backup 0"


def kill_coordinator(cluster) -> str:
    cluster.kill_coordinator()
    time.sleep(1.0)
    cluster.restart_coordinator()
    return "the coordinator, restarted from its --dir"


def kill_leader(cluster) -> str:
    leader = wait_for(lambda: cluster.leader_index() is not None and [cluster.leader_index()],
                      "a coordinator leading")[0]
    cluster.kill_coordinator(leader)
    wait_for(lambda: cluster.leader_index() not in (None, leader), "a standby to take over")
    cluster.restart_coordinator(wait=False, i=leader)
    return f"coordinator {leader}, the leader of three on etcd"


VICTIMS = {"output-owner": kill_output_owner, "backup": kill_backup,
           "coordinator": kill_coordinator, "leader": kill_leader}


SLOW_VICTIMS = ("backup", "leader")   # `make test` keeps a broker and a coordinator kill


@pytest.mark.parametrize("victim", [
    pytest.param(v, marks=[pytest.mark.slow] if v in SLOW_VICTIMS else [])
    for v in sorted(VICTIMS)])
def test_a_daemon_killed_under_the_loop_leaves_each_input_output_once(fresh_cluster, request,
                                                                      victim):
    if victim == "leader":
        etcd = request.getfixturevalue("etcd_cluster")(members=1)
        cluster = txn_cluster(fresh_cluster, coordinators=3, extra_coordinator_args=[
            "--metadata", etcd.url, "--metadata-prefix", f"txn{next(_prefixes)}",
            "--leader-lease-s", "2"])
    else:
        cluster = txn_cluster(fresh_cluster)
    feeder = Feeder(cluster.bootstrap)
    loop = Supervised(cluster)
    wait_for(lambda: loop.commits() >= COMMITS_BEFORE_KILL, "the loop to commit")
    what = VICTIMS[victim](cluster)
    after = loop.commits()
    wait_for(lambda: loop.commits() >= after + COMMITS_AFTER_KILL,
             f"the loop to commit again after the kill of {what}")
    loop.stop()
    errors = [e for run in loop.runs for e in run.errors()]
    print(f"killed {what}: {loop.commits()} commits in {len(loop.runs)} runs; errors {errors}")
    fed = feeder.stop()
    check_drained(cluster, fed, f"kill -9 of {what}")


# ------------------------------------------------------------------ the member fenced mid-batch

MID_BATCH_INPUTS = 20
STALE_TIMEOUT_S = 10.0         # far longer than a refusal; a retry loop would end in Timeout


def read_records(consumer: Consumer, n: int) -> list:
    out: list = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} records read"
        r = consumer.poll(timeout_s=0.1)
        if r is not None:
            out.append(r)
    return out


def test_positions_of_a_member_fenced_after_its_poll_never_commit_with_its_outputs(
        fresh_cluster):
    """docs/TRANSACTIONS.md's loop, as written there (`consumer.group_metadata()` after the
    batch), with the coordinator restarted between the poll and the commit: either the commit
    is refused, or the group's position covers the batch whose outputs it committed."""
    cluster = txn_cluster(fresh_cluster)
    inputs = [b"in-%08d" % n for n in range(MID_BATCH_INPUTS)]
    with Producer(cluster.bootstrap) as p:
        p.send_batch(SOURCE, inputs, keys=inputs)
        p.flush()
    producer = Producer(cluster.bootstrap, transactional_id=TID, request_timeout_s=3.0)
    consumer = Consumer(cluster.bootstrap, SOURCE, group=GROUP, auto_commit_interval_ms=None,
                        request_timeout_s=3.0)
    try:
        producer.init_transactions()
        batch = read_records(consumer, len(inputs))
        before = consumer.group_metadata()
        cluster.kill_coordinator()
        cluster.restart_coordinator()
        wait_for(lambda: [m["member_id"] for m in call(cluster.bootstrap, "group_describe",
                                                        {"group": GROUP})["members"]]
                 not in ([], [before.member_id]),
                 "the consumer to rejoin the restarted coordinator's group")
        assert consumer.group_metadata() == before, "the member as of the poll, until a poll"
        producer.begin_transaction()
        for r in batch:
            producer.send(SINKS[0], SINKS[0].encode() + b":" + r.value, key=r.value)
        try:
            producer.send_positions_to_transaction(consumer.positions(),
                                                   consumer.group_metadata())
            producer.commit_transaction()
        except KeraError as err:
            print(f"refused, as it may be: {err!r}")
            return
    finally:
        consumer.close()
        producer.close()
    committed = positions_from_wire(call(cluster.bootstrap, "group_offsets",
                                         {"group": GROUP})["positions"])
    again = read_values(cluster.bootstrap, SOURCE, 0, start=committed or "earliest")
    assert not set(again) & {r.value for r in batch}, (
        f"the batch's outputs committed, but the group resumes before {len(again)} of its "
        f"inputs (committed positions {committed})")


def test_positions_at_a_stale_member_epoch_are_refused_at_once(fresh_cluster):
    """Retrying positions at an epoch the group has moved past can never succeed: the
    transaction becomes abortable at once instead of at its timeout."""
    cluster = txn_cluster(fresh_cluster)
    with Producer(cluster.bootstrap) as p:
        p.send(SOURCE, b"in-0", key=b"in-0")
        p.flush()
    with Consumer(cluster.bootstrap, SOURCE, group=GROUP, auto_commit_interval_ms=None) as c, \
            Producer(cluster.bootstrap, transactional_id=TID) as producer:
        read_records(c, 1)
        member = c.group_metadata()
        producer.init_transactions()
        producer.begin_transaction()
        with pytest.raises(StaleMemberEpoch):
            producer.send_positions_to_transaction(
                c.positions(), member._replace(member_epoch=member.member_epoch + 1),
                timeout_s=STALE_TIMEOUT_S)
        with pytest.raises(InvalidTxnState, match="abort"):
            producer.commit_transaction()
        producer.abort_transaction()
