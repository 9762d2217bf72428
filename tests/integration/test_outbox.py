"""The outbox harvester (kera.services.outbox.harvester) against a real PostgreSQL and a real kera cluster, with
harvesters as `python -m kera outbox run` child processes: every committed row is published,
once per row id, in id order per key, by one leader at a time, through kill -9 of the leader,
a paused (partitioned) leader and killed database connections."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kera.consumer import Consumer
from kera.cli.local import PARENT_PID_ENV, free_port
from kera.services.outbox.harvester import APPLICATION_NAME
from kera.config import DEFAULT_MAX_RECORD_BYTES
from kera.services.outbox.core import PARKED_LEADER_ID, ROW_ID_HEADER, record_headers
from kera.services.outbox.db import OutboxTable, create_schema
from kera.services.outbox.tail import end_positions
from kera.services.outbox.term import LEADER_HEADER
from kera.producer import Producer

REPO = Path(__file__).resolve().parents[2]
SESSION_TIMEOUT_MS = 2_000       # the coordinator's minimum is 1 s; takeovers take about this
DRAIN_TIMEOUT_S = 60.0           # every row written -> every row published and purged
LEADER_TIMEOUT_S = 20.0          # harvesters started -> one says it leads
POLL_S = 0.05
STOP_TIMEOUT_S = 30.0           # SIGTERM -> exit: step-down and group leave, on a loaded CI
KEYS = 16
KILL_TRIES_MAX = 20
IN_FLIGHT_MAX = 64               # per harvester: bounds what a frozen leader still sends
MARK_WAIT_S = 5.0                # a marking statement that is not blocked answers within this


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1)


@pytest.fixture
def outbox(postgres, cluster, request):
    """(table, stream): a fresh outbox table and a 2-streamlet stream named after the test."""
    name = request.node.name.replace("test_", "ob_")[:40]
    with postgres.connect() as conn:
        create_schema(conn, name)
    cluster.admin().create_stream(name, streamlets=2)
    return name, name


class Harvesters:
    """`python -m kera outbox run` child processes, each logging to its own file."""

    def __init__(self, tmp_path: Path, dsn: str, bootstrap: str, table: str):
        self.tmp_path, self.dsn, self.bootstrap, self.table = tmp_path, dsn, bootstrap, table
        self.procs: list[subprocess.Popen] = []

    def start(self) -> int:
        i = len(self.procs)
        args = [sys.executable, "-m", "kera", "outbox", "run", "--dsn", self.dsn,
                "--bootstrap", self.bootstrap, "--stream", self.table, "--table", self.table,
                "--session-timeout-ms", str(SESSION_TIMEOUT_MS), "--poll-interval-ms", "20",
                "--checkpoint-interval-s", "0.5", "--in-flight-max", str(IN_FLIGHT_MAX)]
        # PYTHONFAULTHANDLER: a harvester that does not stop in time is sent SIGABRT, which
        # prints every thread's stack into its log before it dies.
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "PYTHONFAULTHANDLER": "1"}
        with open(self.log(i), "wb") as logf:
            self.procs.append(subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env, cwd=REPO))
        return i

    def log(self, i: int) -> Path:
        return self.tmp_path / f"harvester-{i}.log"

    def times_elected(self, i: int) -> int:
        return self.log(i).read_text().count("became leader")

    def wait_leader(self, among=None, timeout_s: float = LEADER_TIMEOUT_S) -> int:
        among = range(len(self.procs)) if among is None else among
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leading = [i for i in among if "took over" in self.log(i).read_text()]
            if leading:
                return leading[0]
            time.sleep(POLL_S)
        raise AssertionError(f"no harvester took over in {timeout_s} s: "
                             + "\n".join(self.log(i).read_text()[-2000:] for i in among))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)   # its stacks, into its log
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_TIMEOUT_S)


@pytest.fixture
def harvesters(tmp_path, postgres, cluster, outbox):
    made = Harvesters(tmp_path, postgres.dsn, cluster.bootstrap, outbox[0])
    yield made
    made.stop()


class Writer(threading.Thread):
    """Writes `rows` outbox rows over KEYS keys in small transactions, `pause_s` apart; keeps
    the ids it committed per key, in commit order."""

    def __init__(self, postgres, table: str, rows: int, batch: int = 10, pause_s: float = 0.005):
        super().__init__(daemon=True)
        self.postgres, self.table, self.rows = postgres, table, rows
        self.batch, self.pause_s = batch, pause_s
        self.ids: dict[str, list[int]] = {}

    def run(self) -> None:
        with self.postgres.connect() as conn:
            for start in range(0, self.rows, self.batch):
                with conn.transaction():
                    for n in range(start, min(start + self.batch, self.rows)):
                        key = f"k{n % KEYS}"
                        row_id = conn.execute(
                            f'INSERT INTO "{self.table}" (key, value) VALUES (%s, %s) '
                            "RETURNING id", (key, b"v%d" % n)).fetchone()[0]
                        self.ids.setdefault(key, []).append(row_id)
                time.sleep(self.pause_s)

    def all_ids(self) -> set[int]:
        return {i for ids in self.ids.values() for i in ids}


def wait_drained(postgres, table: str, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    with postgres.connect(autocommit=True) as conn:
        while time.monotonic() < deadline:
            left = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
            if left == 0:
                return
            time.sleep(POLL_S)
    raise AssertionError(f"{left} outbox rows still in '{table}' after {timeout_s} s")


def read_stream(bootstrap: str, stream: str) -> list:
    """Every record of the stream, per streamlet in stream order."""
    out = []
    with Consumer(bootstrap, stream, start="earliest") as consumer:
        while True:
            record = consumer.poll(POLL_S)
            if record is None:
                if not any(consumer.lag().values()):
                    return out
                continue
            out.append(record)


def check_published(records: list, writer_ids: dict[str, list[int]], in_doubt_max: int = 0):
    """Every committed row, in id order per key, by one term at a time; with `in_doubt_max`,
    at most that many records published twice or after a later term began (first copies
    still in order)."""
    row_ids = [int(dict(r.headers)[ROW_ID_HEADER]) for r in records]
    assert set(row_ids) == {i for ids in writer_ids.values() for i in ids}
    twice = len(row_ids) - len(set(row_ids))
    assert twice <= in_doubt_max, f"{twice} rows published twice"
    by_key: dict[str, list[int]] = {}
    seen: set[int] = set()
    for record, row_id in zip(records, row_ids):
        if row_id not in seen:
            seen.add(row_id)
            by_key.setdefault(record.key.decode(), []).append(row_id)
    assert by_key == writer_ids
    late = late_records(records)
    assert late <= in_doubt_max, f"{late} records of a term published after a later term's"


def late_records(records: list) -> int:
    """Per streamlet, the records of a term that come after a later term's records."""
    late = 0
    for streamlet in {r.streamlet for r in records}:
        terms: list[str] = []
        for r in records:
            if r.streamlet != streamlet:
                continue
            term = dict(r.headers)[LEADER_HEADER].decode()
            if term in terms[:-1]:
                late += 1
            elif not terms or terms[-1] != term:
                terms.append(term)
    return late


def test_rows_written_while_harvesting_are_all_published_in_key_order(
        postgres, cluster, outbox, harvesters):
    table, stream = outbox
    harvesters.start()
    harvesters.start()
    harvesters.wait_leader()
    writer = Writer(postgres, table, rows=1500)
    writer.start()
    writer.join()
    wait_drained(postgres, table)
    check_published(read_stream(cluster.bootstrap, stream), writer.ids)
    harvesters.stop()   # SIGTERM: a leader steps down, saying what its term published
    logs = harvesters.log(0).read_text() + harvesters.log(1).read_text()
    published = re.findall(r"stepped down \(published (\d+) rows", logs)
    # leadership may move when a member joins
    assert sum(map(int, published)) == 1500, logs[-8000:]


def test_cli_init_creates_the_outbox_table_and_may_run_again(postgres):
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "kera", "outbox", "init", "--dsn",
                               postgres.dsn, "--table", "ob_cli_init"],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        assert done.returncode == 0, done.stderr
    with postgres.connect() as conn:
        conn.execute("INSERT INTO ob_cli_init (key, value) VALUES ('k', 'v')")
        assert conn.execute("SELECT count(*) FROM ob_cli_init_leaders").fetchone() == (0,)


def test_two_markers_at_once_never_take_the_same_row(postgres):
    """A frozen leader resuming marks beside its successor: while one marking transaction holds
    its rows, another marks only other rows, and no mark is overwritten once the first commits
    (it used to wait on the locks, then take the same rows)."""
    table = "ob_two_markers"
    FIRST, SECOND = "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222"
    with postgres.connect() as conn:
        create_schema(conn, table)
        for i in range(10):
            conn.execute(f"INSERT INTO {table} (key, value) VALUES (%s, 'v')", (f"k{i}",))
    with postgres.connect() as first, postgres.connect() as second:
        took_first = [r.id for r in OutboxTable(first, table).mark(FIRST, 4)]   # not committed
        took_second: list[int] = []
        marking = threading.Thread(target=lambda: took_second.extend(
            r.id for r in OutboxTable(second, table).mark(SECOND, 4)))
        marking.start()
        marking.join(MARK_WAIT_S)
        first.commit()
        marking.join(MARK_WAIT_S)
        second.commit()
    assert len(took_first) == 4 and not set(took_first) & set(took_second)
    with postgres.connect() as conn:
        marks = dict(conn.execute(f"SELECT id, leader_id::text FROM {table}").fetchall())
    assert all(marks[i] == FIRST for i in took_first)
    assert all(marks[i] == SECOND for i in took_second)


def test_kill_9_of_the_leader_another_takes_over_none_lost_none_twice(
        postgres, cluster, outbox, harvesters):
    table, stream = outbox
    first = harvesters.wait_leader([harvesters.start()])
    other = harvesters.start()
    writer = Writer(postgres, table, rows=3000, pause_s=0.002)
    writer.start()
    wait_published_some(cluster.bootstrap, stream)
    harvesters.procs[first].send_signal(signal.SIGKILL)
    assert harvesters.wait_leader([other]) == other
    writer.join()
    wait_drained(postgres, table)
    check_published(read_stream(cluster.bootstrap, stream), writer.ids)


def test_a_paused_leader_steps_down_and_sends_nothing_new_beside_its_successor(
        postgres, cluster, outbox, harvesters):
    """SIGSTOP stands for a partition: the leader hears nothing for longer than its session;
    the other harvester takes over; resumed, the old leader steps down at once and sends
    nothing new. What its producer held when it froze (at most --in-flight-max records) is
    sent on resuming, after its successor looked for them: those may be published twice (the
    residual window kera.services.outbox.harvester documents)."""
    table, stream = outbox
    first = harvesters.wait_leader([harvesters.start()])
    other = harvesters.start()
    writer = Writer(postgres, table, rows=3000, pause_s=0.002)
    writer.start()
    wait_published_some(cluster.bootstrap, stream)
    harvesters.procs[first].send_signal(signal.SIGSTOP)
    try:
        harvesters.wait_leader([other])
    finally:
        harvesters.procs[first].send_signal(signal.SIGCONT)
    writer.join()
    wait_drained(postgres, table)
    check_published(read_stream(cluster.bootstrap, stream), writer.ids,
                    in_doubt_max=IN_FLIGHT_MAX)


def test_killed_database_connections_harvesting_resumes(postgres, cluster, outbox, harvesters):
    table, stream = outbox
    harvesters.wait_leader([harvesters.start()])
    writer = Writer(postgres, table, rows=3000, pause_s=0.002)
    writer.start()
    killed = 0
    for _ in range(KILL_TRIES_MAX):
        wait_published_some(cluster.bootstrap, stream, at_least=200 * (killed + 1))
        # between terms (a second's backoff, then a new connection) there is no session to
        # kill: wait for the next term's; it may still end before the kill, so try again
        postgres.wait_session(APPLICATION_NAME, timeout_s=LEADER_TIMEOUT_S)
        killed += postgres.terminate(APPLICATION_NAME)
        if killed >= 3:
            break
    writer.join()
    after = Writer(postgres, table, rows=300, pause_s=0.002)   # written after the last kill
    after.run()
    wait_drained(postgres, table)
    assert killed >= 3
    assert harvesters.log(0).read_text().count("took over") >= 2
    written = {key: writer.ids.get(key, []) + after.ids.get(key, [])
               for key in writer.ids.keys() | after.ids.keys()}
    check_published(read_stream(cluster.bootstrap, stream), written)


def test_kill_9_of_a_broker_none_lost_none_twice(postgres, fresh_cluster, tmp_path):
    """A broker dies mid-harvest: its streamlet fails over to the other broker (rebuilt from
    the backups); records in doubt end the term and the next looks them up."""
    cluster = fresh_cluster(brokers=2, backups=2, log_level="WARNING")
    table = stream = "ob_broker_kill"
    with postgres.connect() as conn:
        create_schema(conn, table)
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=2, replication=2)
    harvesters = Harvesters(tmp_path, postgres.dsn, cluster.bootstrap, table)
    try:
        harvesters.wait_leader([harvesters.start()])
        writer = Writer(postgres, table, rows=3000, pause_s=0.002)
        writer.start()
        wait_published_some(cluster.bootstrap, stream)
        cluster.kill_broker(0)
        writer.join()
        wait_drained(postgres, table)
        check_published(read_stream(cluster.bootstrap, stream), writer.ids)
    finally:
        harvesters.stop()


def test_a_leader_that_cannot_reach_the_database_lets_another_lead(
        postgres, cluster, outbox, harvesters):
    table, stream = outbox
    good_dsn = harvesters.dsn
    harvesters.dsn = f"host=127.0.0.1 port={free_port()} user=postgres dbname=postgres"
    cut_off = harvesters.start()                 # elected alone, then fails its terms
    wait_logged(harvesters.log(cut_off), "3 leader terms failed in a row: leaving the group")
    harvesters.dsn = good_dsn
    harvesters.start()
    writer = Writer(postgres, table, rows=300)
    writer.start()
    writer.join()
    wait_drained(postgres, table)
    check_published(read_stream(cluster.bootstrap, stream), writer.ids)


def wait_logged(path: Path, text: str, timeout_s: float = LEADER_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{path} never said {text!r}"
        time.sleep(POLL_S)


def test_a_new_leader_purges_rows_an_earlier_term_published_and_resets_the_rest(
        postgres, cluster, outbox, harvesters):
    """A term that died after publishing rows 1..5 but before purging them, with rows 6..10
    marked and unpublished: the new leader publishes 6..10 only."""
    table, stream = outbox
    dead = "00000000-0000-0000-0000-00000000dead"
    with postgres.connect(autocommit=True) as conn:
        for n in range(10):
            conn.execute(f'INSERT INTO "{table}" (key, value) VALUES (%s, %s)', ("k", b"%d" % n))
        db = OutboxTable(conn, table)
        db.save_checkpoint(dead, end_positions(cluster.bootstrap, stream))
        rows = db.mark(dead, 10)
    with Producer(cluster.bootstrap) as producer:
        for row in sorted(rows)[:5]:
            producer.send(stream, row.value, key=b"k",
                          headers=[*record_headers(row), (LEADER_HEADER, dead.encode())])
    harvesters.start()
    wait_drained(postgres, table)
    ids = sorted(r.id for r in rows)
    check_published(read_stream(cluster.bootstrap, stream), {"k": ids})
    assert "10 rows left marked by earlier terms, 5 were published (purged) and 5 reset" \
        in harvesters.log(0).read_text()


def test_a_row_too_large_to_publish_is_parked_and_its_key_goes_on(
        postgres, cluster, outbox, harvesters):
    table, stream = outbox
    too_large = b"x" * (DEFAULT_MAX_RECORD_BYTES + 1)
    with postgres.connect(autocommit=True) as conn:
        ids = [conn.execute(f'INSERT INTO "{table}" (key, value) VALUES (%s, %s) RETURNING id',
                            ("k", value)).fetchone()[0] for value in (b"1", too_large, b"3")]
        harvesters.start()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] > 1:
            assert time.monotonic() < deadline, "rows 1 and 3 not published"
            time.sleep(POLL_S)
        left = conn.execute(f'SELECT id, leader_id::text FROM "{table}"').fetchall()
    assert left == [(ids[1], PARKED_LEADER_ID)]
    check_published(read_stream(cluster.bootstrap, stream), {"k": [ids[0], ids[2]]})
    assert f"row {ids[1]} refused" in harvesters.log(0).read_text()


def test_outbox_service_example(postgres, cluster):
    done = subprocess.run([sys.executable, str(REPO / "examples" / "outbox_service.py"),
                           "--dsn", postgres.dsn, "--bootstrap", cluster.bootstrap,
                           "--stream", "orders", "--orders", "40"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "published 36 of 36 orders" in done.stdout
    assert done.stdout.count("order-placed") == 36


def wait_published_some(bootstrap: str, stream: str, at_least: int = 200,
                        timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    with Consumer(bootstrap, stream, start="earliest") as consumer:
        while time.monotonic() < deadline:
            low_high = [consumer.watermarks(stream, sl) for sl in consumer.streamlets]
            if sum(high - low for low, high in low_high) >= at_least:
                return
            time.sleep(POLL_S)
    raise AssertionError(f"fewer than {at_least} records published in {timeout_s} s")




@pytest.mark.parametrize("command", [["outbox"], ["outbox", "init"], ["outbox", "run"]])
def test_outbox_help(command, capsys):
    from kera.cli import main as cli
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kera outbox")
    if command[-1] == "run":
        assert "elect one leader" in out and "--session-timeout-ms" in out
