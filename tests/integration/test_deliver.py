"""kera deliver against a real cluster, a real PostgreSQL, a SQLite file and a local HTTP
receiver (examples/deliver_receiver.py): under continuous production, with the deliverer
(`python -m kera deliver`) killed with SIGKILL and restarted, the HTTP target failing for a
while and the PostgreSQL target's connection terminated, every target ends with every record
exactly once, in order per streamlet, and a failing or dead target does not hold up the
others."""

from __future__ import annotations

import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kera.services.deliver.targets import DEFAULT_TABLE_PREFIX, PG_APPLICATION_NAME
from kera.cli.local import PARENT_PID_ENV, free_port
from kera.producer import Producer

REPO = Path(__file__).resolve().parents[2]
RECORDS = 8_000
KEYS = 8
SEND_STEP = 50                   # records per step of the producer (about 1,500 records/s)
assert RECORDS // 2 % SEND_STEP == 0   # the producer pauses at a step boundary
SEND_PAUSE_S = 0.03
PROGRESS_TIMEOUT_S = 30.0        # a wanted count of applied records is reached within it
DRAIN_TIMEOUT_S = 60.0           # production ended -> every target has every record
POLL_S = 0.1
STOP_TIMEOUT_S = 10.0
PADDED_BYTES = 1_000             # 2,000 of them: 2 MB, many times a target reader's cache
FAILING_LEAD_RECORDS = 500       # others' progress while the HTTP target fails, at least


def _load_receiver():
    spec = importlib.util.spec_from_file_location(
        "deliver_receiver", REPO / "examples" / "deliver_receiver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Receiver


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1)


@pytest.fixture
def receiver(tmp_path):
    server = _load_receiver()(free_port(), str(tmp_path / "http.db"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class DelivererProcess:
    """`python -m kera deliver` as a child process, logging to one file."""

    def __init__(self, tmp_path: Path, args: list[str]):
        self.args, self.log = args, tmp_path / "deliver.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "kera", "deliver", *self.args],
                                         stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=REPO)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)


def _sqlite_rows(path) -> list[tuple]:
    with sqlite3.connect(path, timeout=5.0) as conn:
        return conn.execute(f"SELECT streamlet, grp, off, v FROM {DEFAULT_TABLE_PREFIX}_records "
                            f"ORDER BY streamlet, grp, off").fetchall()


def _pg_rows(postgres) -> list[tuple]:
    with postgres.connect() as conn:
        return [(sl, g, o, bytes(v)) for sl, g, o, v in conn.execute(
            f"SELECT streamlet, grp, off, v FROM {DEFAULT_TABLE_PREFIX}_records "
            f"ORDER BY streamlet, grp, off").fetchall()]


def _numbers(connect) -> dict[int, list[int]]:
    """{streamlet: the stored records' numbers in position order} of a SQL target."""
    with connect() as conn:
        rows = conn.execute(f"SELECT streamlet, num FROM {DEFAULT_TABLE_PREFIX}_records "
                            f"ORDER BY streamlet, grp, off").fetchall()
    out: dict[int, list[int]] = {}
    for sl, num in rows:
        out.setdefault(sl, []).append(num)
    return out


def _counts(readers) -> dict[str, int]:
    out = {}
    for name, read in readers.items():
        try:
            out[name] = len(read())
        except Exception:   # the table is created by the deliverer's first session
            out[name] = 0
    return out


def _wait(predicate, timeout_s: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            tail = "" if log is None else f"; deliverer log:\n{log.read_text()[-4000:]}"
            raise AssertionError(f"timed out waiting for {what}{tail}")
        time.sleep(POLL_S)


def _produce(bootstrap: str, stream: str, halfway: threading.Event,
             done: threading.Event) -> None:
    """RECORDS records at about 1,500/s; after the first half, waits for `halfway`."""
    with Producer(bootstrap, linger_ms=5) as producer:
        for start in range(0, RECORDS, SEND_STEP):
            if start == RECORDS // 2:
                producer.flush()
                assert halfway.wait(DRAIN_TIMEOUT_S)
            for i in range(start, min(RECORDS, start + SEND_STEP)):
                producer.send(stream, str(i).encode(), key=str(i % KEYS).encode())
            time.sleep(SEND_PAUSE_S)
        producer.flush()
    done.set()


def _check_exactly_once_in_order(name: str, rows: list[tuple]) -> None:
    values = [int(v) for _, _, _, v in rows]
    assert sorted(values) == list(range(RECORDS)), f"{name}: records missing or twice"
    for sl in {r[0] for r in rows}:
        mine = [int(v) for s, _, _, v in rows if s == sl]
        assert mine == sorted(mine), f"{name}: streamlet {sl} out of order"


def test_three_targets_get_every_record_once_in_order_through_kill9_and_a_failing_target(
        cluster, postgres, receiver, tmp_path):
    stream = "deliver_kill"
    cluster.admin().create_stream(stream, streamlets=2)
    sqlite_path = tmp_path / "target.db"
    http_url = f"http://127.0.0.1:{receiver.server_address[1]}/"
    deliverer = DelivererProcess(tmp_path, [
        "--bootstrap", cluster.bootstrap, "--stream", stream, "--target", f"sqlite:{sqlite_path}",
        "--target", postgres.dsn, "--target", http_url, "--progress-interval-s", "1",
        "--batch-records-max", "200"])
    readers = {"sqlite": lambda: _sqlite_rows(sqlite_path),
               "postgresql": lambda: _pg_rows(postgres), "http": lambda: _sqlite_rows(tmp_path / "http.db")}
    halfway, produced = threading.Event(), threading.Event()
    producer = threading.Thread(target=_produce,
                                args=(cluster.bootstrap, stream, halfway, produced),
                                daemon=True)
    try:
        deliverer.start()
        producer.start()
        _wait(lambda: min(_counts(readers).values()) >= 500, PROGRESS_TIMEOUT_S,
              "500 records on every target", deliverer.log)
        deliverer.kill9()
        deliverer.start()

        receiver.fail(True)
        held = _counts(readers)["http"]
        others_before = _counts(readers)
        _wait(lambda: all(_counts(readers)[n] >= others_before[n] + FAILING_LEAD_RECORDS
                          for n in ("sqlite", "postgresql")), PROGRESS_TIMEOUT_S,
              "the other targets to go on while the HTTP target fails", deliverer.log)
        assert _counts(readers)["http"] == held   # nothing reached the failing receiver
        receiver.fail(False)

        deliverer.kill9()
        deliverer.start()
        # The first half applied, PostgreSQL's connection dies under the deliverer: the second
        # half's first batch to it fails and is retried.
        _wait(lambda: _counts(readers)["postgresql"] == RECORDS // 2, PROGRESS_TIMEOUT_S,
              "the first half on PostgreSQL after the restart", deliverer.log)
        assert postgres.terminate(PG_APPLICATION_NAME) >= 1
        halfway.set()
        assert produced.wait(DRAIN_TIMEOUT_S), "the producer did not finish"
        _wait(lambda: all(c == RECORDS for c in _counts(readers).values()), DRAIN_TIMEOUT_S,
              f"{RECORDS} records on every target", deliverer.log)
        for name, read in readers.items():
            _check_exactly_once_in_order(name, read())
        # Each target stored every record's number, dense from 0 per streamlet.
        for connect in (lambda: sqlite3.connect(sqlite_path), postgres.connect,
                        lambda: sqlite3.connect(tmp_path / "http.db")):
            assert all(nums == list(range(len(nums)))
                       for nums in _numbers(connect).values())
        log = deliverer.log.read_text()
        assert f"target {http_url} failed" in log and "caught up" in log
        assert f"target {postgres.dsn} failed" in log
    finally:
        deliverer.stop()


def test_a_dead_target_is_given_up_while_the_others_get_everything(cluster, tmp_path):
    from kera.services.deliver.deliverer import Deliverer
    from kera.services.deliver.http import HttpTarget
    from kera.services.deliver.targets import SqliteTarget
    stream = "deliver_dead"
    cluster.admin().create_stream(stream, streamlets=2)
    with Producer(cluster.bootstrap) as producer:
        for i in range(1_000):
            producer.send(stream, str(i).encode(), key=str(i % KEYS).encode())
        producer.flush()
    sqlite_path = tmp_path / "alive.db"
    dead = HttpTarget(f"http://127.0.0.1:{free_port()}/", timeout_s=1.0)   # nobody listens
    with Deliverer(cluster.bootstrap, stream, [SqliteTarget(str(sqlite_path)), dead],
                   retries_max=3) as deliverer:
        _wait(lambda: _counts({"alive": lambda: _sqlite_rows(sqlite_path)})["alive"] == 1_000,
              PROGRESS_TIMEOUT_S, "every record on the live target")
        _wait(lambda: deliverer.status()[dead.name]["gave_up"], PROGRESS_TIMEOUT_S,
              "the dead target to be given up")
    assert sorted(int(v) for *_, v in _sqlite_rows(sqlite_path)) == list(range(1_000))
    assert deliverer.status()[dead.name]["applied"] == 0



class BlockedTarget:
    """An in-memory target whose apply blocks until released: a target that is very slow."""

    name = "blocked"

    def __init__(self):
        self.release, self.records = threading.Event(), []

    def last_applied(self) -> dict:
        return {}

    def apply(self, records) -> None:
        assert self.release.wait(DRAIN_TIMEOUT_S)
        self.records += records

    def close(self) -> None:
        pass


def test_a_blocked_target_holds_up_nobody_and_catches_up_when_released(cluster, tmp_path):
    from kera.services.deliver.deliverer import Deliverer
    from kera.services.deliver.targets import SqliteTarget
    stream = "deliver_slow"
    cluster.admin().create_stream(stream, streamlets=2)
    sqlite_path, blocked = tmp_path / "fast.db", BlockedTarget()
    alive = {"fast": lambda: _sqlite_rows(sqlite_path)}
    with Deliverer(cluster.bootstrap, stream, [SqliteTarget(str(sqlite_path)), blocked],
                   batch_records_max=100):
        with Producer(cluster.bootstrap) as producer:
            for i in range(2_000):   # padded: far more than a reader's bounded cache holds
                producer.send(stream, str(i).encode().ljust(PADDED_BYTES),
                              key=str(i % KEYS).encode())
            producer.flush()
        _wait(lambda: _counts(alive)["fast"] == 2_000, PROGRESS_TIMEOUT_S,
              "every record on the fast target while the other is blocked")
        assert blocked.records == []
        blocked.release.set()
        _wait(lambda: len(blocked.records) == 2_000, PROGRESS_TIMEOUT_S,
              "the released target to catch up")
    values = [int(r.value) for r in blocked.records]
    assert sorted(values) == list(range(2_000))
    for sl in (0, 1):
        mine = [int(r.value) for r in blocked.records if r.streamlet == sl]
        assert mine == sorted(mine)


class IndexTarget:
    """A target keeping only the number of the last record it applied per streamlet, as a
    LogPlayer target keeps its index; starts as if it had applied up to `start_after`."""

    name = "index"

    def __init__(self, stream: str, start_after: dict[int, int]):
        self.stream, self.records = stream, []
        self.last = dict(start_after)

    def last_applied(self) -> dict:
        from kera.services.deliver.core import Applied
        return {(self.stream, sl): Applied(self.stream, sl, None, None, n)
                for sl, n in self.last.items()}

    def apply(self, records) -> None:
        self.records += records
        for r in records:
            self.last[r.streamlet] = r.number

    def close(self) -> None:
        pass


def test_a_target_keeping_only_an_index_resumes_after_it_across_groups(cluster):
    from kera.services.deliver.deliverer import Deliverer
    stream = "deliver_index"
    # Small segments and groups: the resume points fall in later groups than the first.
    cluster.admin().create_stream(stream, streamlets=2, segment_size_bytes=64 * 1024,
                                  group_segments=1)
    with Producer(cluster.bootstrap, linger_ms=5) as producer:
        for i in range(3_000):
            producer.send(stream, b"%d" % i + b"." * 100, streamlet=i % 2)
    target = IndexTarget(stream, {0: 1_234, 1: 99})
    with Deliverer(cluster.bootstrap, stream, [target], batch_records_max=100):
        _wait(lambda: len(target.records) >= 3_000 - 1_235 - 100, PROGRESS_TIMEOUT_S,
              "the records after each index")
    for sl, after in ((0, 1_234), (1, 99)):
        got = [r.number for r in target.records if r.streamlet == sl]
        assert got == list(range(after + 1, 1_500)), f"streamlet {sl}"
    assert {r.group for r in target.records if r.streamlet == 0} != {0}


RETENTION_MS = 1_000   # the smallest the coordinator takes: groups go within seconds


def test_a_target_behind_records_retention_deleted_is_given_up_naming_the_numbers(cluster):
    from kera.consumer import Consumer
    from kera.services.deliver.deliverer import Deliverer
    stream = "deliver_gap"
    cluster.admin().create_stream(stream, streamlets=1, segment_size_bytes=64 * 1024,
                                  group_segments=1, retention_ms=RETENTION_MS)
    with Producer(cluster.bootstrap, linger_ms=5) as producer:
        for i in range(3_000):
            producer.send(stream, b"%d" % i + b"." * 100)
    with Consumer(cluster.bootstrap, stream, start="earliest") as consumer:
        _wait(lambda: consumer.offsets_for_number(stream, 0, 0)[0].group > 0,
              PROGRESS_TIMEOUT_S, "retention to delete the first group")
    with Producer(cluster.bootstrap) as producer:   # retention may have deleted everything
        producer.send(stream, b"after").result(PROGRESS_TIMEOUT_S)
    target = IndexTarget(stream, {0: 0})   # applied number 0 only, long ago
    with Deliverer(cluster.bootstrap, stream, [target]) as deliverer:
        _wait(lambda: deliverer.status()["index"]["gave_up"], PROGRESS_TIMEOUT_S,
              "the target to be given up")
    assert target.records == []   # never fed past the hole


def test_the_example_read_model_counts_each_deposit_once(cluster):
    done = subprocess.run([sys.executable, str(REPO / "examples" / "deliver_service.py"),
                           "--bootstrap", cluster.bootstrap, "--stream", "deliver_example",
                           "--deposits", "500"], capture_output=True, text=True,
                          timeout=DRAIN_TIMEOUT_S + STOP_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "balances match the 500 deposits" in done.stdout


def _deliver_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kera", "deliver", *args], capture_output=True,
                          text=True, timeout=DRAIN_TIMEOUT_S, cwd=REPO,
                          env={**os.environ, PARENT_PID_ENV: str(os.getpid())})


def test_the_command_refuses_what_it_cannot_deliver_in_order_and_ends_when_all_gave_up(
        cluster):
    admin = cluster.admin()
    admin.create_stream("deliver_parallel", active_groups=2)
    admin.create_stream("deliver_cli")
    refused = _deliver_cli("--bootstrap", cluster.bootstrap, "--stream", "deliver_parallel",
                           "--target", "sqlite:/nonexistent/never.db")
    assert refused.returncode != 0 and "active_groups=1" in refused.stderr
    unknown = _deliver_cli("--bootstrap", cluster.bootstrap, "--stream", "deliver_cli",
                           "--target", "ftp://x")
    assert unknown.returncode != 0 and "unknown target 'ftp://x'" in unknown.stderr
    dead_url = f"http://127.0.0.1:{free_port()}/"
    gave_up = _deliver_cli("--bootstrap", cluster.bootstrap, "--stream", "deliver_cli",
                           "--target", dead_url, "--retries-max", "2")
    assert gave_up.returncode == 1
    assert f"target {dead_url}: giving up after 3 failed attempts" in gave_up.stderr
