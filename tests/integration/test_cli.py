"""The `kera` command line: help for every command, stream administration against a real
coordinator, one-line errors."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kera.cli import main as cli
from kera.cli.local import LocalCluster

from test_client_wrong_address import refused_address
from kera.net.probe import PROBE_TIMEOUT_S

LOW_SOFT_OPEN_FILES = 256   # a daemon started under a soft limit well below any hard one

COMMANDS = [
    [], ["coordinator"], ["broker"], ["backup"], ["local"], ["stream"], ["stream", "create"],
    ["stream", "describe"], ["stream", "list"], ["stream", "delete"], ["cluster"],
    ["cluster", "deregister"], ["cluster", "rebalance"], ["stream", "alter"], ["stats"],
    ["produce"], ["consume"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "kera")
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kera") and len(out.splitlines()) > 3


def test_a_daemon_process_tunes_its_collector_allocator_and_file_limit_and_says_so(tmp_path):
    """`kera coordinator|broker|backup` are kera's own processes: kera.daemon.gc_policy,
    kera.daemon.malloc_policy and kera.daemon.file_limit apply (started here with a soft open-file limit of
    256, as a system with a low default would start it)."""
    import resource
    import threading

    from kera.daemon import file_limit

    from kera.daemon import gc_policy

    from kera.daemon import malloc_policy
    from kera.cli.local import free_port
    soft_started, hard = LOW_SOFT_OPEN_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raised = file_limit.OPEN_FILES_MAX if hard == resource.RLIM_INFINITY else \
        min(hard, file_limit.OPEN_FILES_MAX)
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "kera", "coordinator", "--host", "127.0.0.1",
                             "--port", str(port), "--dir", str(tmp_path), "--log-level", "DEBUG"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                  (soft_started, hard)))
    watchdog = threading.Timer(60.0, proc.kill)   # a coordinator that never serves ends the read
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:   # ends when the process does
            lines.append(line)
            if "serving on" in line:
                break
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=30)
    said = [line for line in lines if "kera.daemon.gc_policy" in line]
    assert said and f"thresholds ({gc_policy.YOUNG_COLLECTION_OBJECTS}," in said[0], "".join(lines)
    said = [line for line in lines if "kera.daemon.malloc_policy" in line]
    assert said and f"mmap threshold {malloc_policy.MMAP_THRESHOLD_BYTES} bytes" in said[0], \
        "".join(lines)
    said = [line for line in lines if "kera.daemon.file_limit" in line]
    assert said and f"raised from {soft_started} to {raised}" in said[0], "".join(lines)
    open_files = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert open_files.split()[3] == str(raised), limits


def test_entry_points_run():
    for argv in ([sys.executable, "-m", "kera", "--help"], ["kera", "stream", "--help"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "usage: kera" in proc.stdout


def kera(*args, bootstrap=None, input=None, timeout_s=60):
    env = dict(os.environ)
    if bootstrap:
        env["KERA_BOOTSTRAP"] = bootstrap
    return subprocess.run([sys.executable, "-m", "kera", *args], capture_output=True, text=True,
                          input=input, timeout=timeout_s, env=env)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cli"), brokers=0, backups=1, log_level="WARNING",
                      heartbeat_interval_ms=50) as cluster:
        yield cluster


def test_stream_commands(coordinator, fake_daemons):
    boot = coordinator.bootstrap
    fake_daemons(boot, address="127.0.0.1:7301", node="a")
    fake_daemons(boot, address="127.0.0.1:7302", node="b")

    made = kera("stream", "create", "clicks", "--streamlets", "4", "--active-groups", "2",
                "--replication", "2", "--durability", "disk", "--group-segments", "8",
                "--segment-size-bytes", "65536", bootstrap=boot)
    assert made.returncode == 0, made.stderr
    assert "created stream 'clicks'" in made.stdout and "ready" in made.stdout

    described = kera("stream", "describe", "clicks", "--json", "--bootstrap", boot)
    assert described.returncode == 0, described.stderr
    stream = json.loads(described.stdout)
    assert (stream["streamlets"], stream["active_groups"], stream["replication"],
            stream["durability"], stream["group_segments"], stream["segment_size_bytes"]) == (
        4, 2, 2, "disk", 8, 65536)
    assert stream["ready"] is True and len(stream["placement"]) == 4

    again = kera("stream", "create", "clicks", bootstrap=boot)
    assert again.returncode == 1 and "exists" in again.stderr
    again = kera("stream", "create", "clicks", "--streamlets", "9", "--if-not-exists",
                 bootstrap=boot)
    assert again.returncode == 0 and "exists already" in again.stderr, again.stderr
    typo = kera("stream", "describe", "clikcs", bootstrap=boot)
    assert typo.returncode == 1 and "did you mean 'clicks'" in typo.stderr, typo.stderr
    aged = kera("stream", "create", "aged", "--retention-ms", "7d", "--json", bootstrap=boot)
    assert aged.returncode == 0 and json.loads(aged.stdout)["retention_ms"] == 7 * 86_400_000
    assert kera("stream", "delete", "aged", bootstrap=boot).returncode == 0
    bad = kera("stream", "create", "x", "--retention-ms", "7 days", bootstrap=boot)
    assert bad.returncode == 2 and "not a duration" in bad.stderr

    table = kera("stream", "describe", "clicks", bootstrap=boot)
    assert table.returncode == 0 and "STREAMLET  OWNER" in table.stdout
    assert table.stdout.count("serving") == 4 and stream["states"] == ["serving"] * 4

    assert kera("stream", "create", "views", "--no-wait", bootstrap=boot).returncode == 0
    listed = kera("stream", "list", bootstrap=boot)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAME", "ID"]
    assert [line.split()[0] for line in lines[1:]] == ["clicks", "views"]

    deleted = kera("stream", "delete", "views", bootstrap=boot)
    assert deleted.returncode == 0 and "deleted" in deleted.stdout
    listed = kera("stream", "list", "--json", bootstrap=boot)
    assert [s["name"] for s in json.loads(listed.stdout)] == ["clicks"]

    cluster = kera("cluster", bootstrap=boot)
    assert cluster.returncode == 0
    assert "127.0.0.1:7301" in cluster.stdout and "backup" in cluster.stdout


@pytest.mark.parametrize("args, message", [
    (["stream", "describe", "nope"], "no stream named 'nope' (unknown_stream)"),
    (["stream", "delete", "nope"], "(unknown_stream)"),
    (["stream", "create", "bad name"], "stream name"),
    (["stream", "create", "x", "--streamlets", "0"], "streamlets"),
    (["stream", "create", "x", "--replication", "5"], "(not_ready)"),
])
def test_errors_are_one_line(coordinator, fake_daemons, args, message):
    fake_daemons(coordinator.bootstrap, address="127.0.0.1:7303")
    proc = kera(*args, bootstrap=coordinator.bootstrap)
    assert proc.returncode == 1
    assert proc.stderr.startswith("kera: error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# Seconds a wrong address may take to be told apart: the probe's own bound plus the start of a
# Python interpreter on a loaded 2-core machine.
WRONG_ADDRESS_BUDGET_S = PROBE_TIMEOUT_S + 3.0




@pytest.mark.parametrize("address,expected", [
    (lambda c, refused: refused, "connection refused"),
    (lambda c, refused: "no-such-host.invalid:7000", "unknown host"),
    (lambda c, refused: c.backups[0].address, "not the coordinator"),
], ids=["refused", "unknown-host", "daemon-not-coordinator"])
def test_wrong_address_told_apart_quickly(coordinator, address, expected):
    started = time.monotonic()
    with refused_address() as refused:
        proc = kera("stream", "list", "--bootstrap", address(coordinator, refused),
                    "--timeout-s", "10")
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 1 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and elapsed_s < WRONG_ADDRESS_BUDGET_S


@pytest.mark.parametrize("command", [["stream", "list"], ["group", "list"], ["cluster"]])
def test_a_bootstrap_list_goes_on_past_a_dead_address(coordinator, command):
    with refused_address() as dead:
        proc = kera(*command, "--bootstrap", f"{dead},{coordinator.bootstrap}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the live coordinator answered"


def test_silent_listener_told_apart_quickly():
    """Something that accepts TCP and never speaks (a proxy, a stuck service): named within
    the probe's bound, not after the 10 s request timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = "127.0.0.1:%d" % listener.getsockname()[1]
        started = time.monotonic()
        proc = kera("stream", "list", "--bootstrap", address, "--timeout-s", "10")
        elapsed_s = time.monotonic() - started
    assert proc.returncode == 1 and "no ZeroMQ greeting" in proc.stderr, proc.stderr
    assert elapsed_s < WRONG_ADDRESS_BUDGET_S


def test_usage_errors_exit_two():
    assert kera("stream", "create").returncode == 2
    assert kera("no-such-command").returncode == 2
    assert kera("stream", "list", "--bogus").returncode == 2


def test_stats_table(tmp_path):
    with LocalCluster(tmp_path, brokers=0, backups=1, log_level="WARNING") as cluster:
        proc = kera("stats", bootstrap=cluster.bootstrap)
        as_json = kera("stats", "--json", bootstrap=cluster.bootstrap)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "== coordinator ==" and "== backups ==" in lines
    headers = [line.split() for line in lines if line.startswith("COUNTER")]
    assert ["COUNTER", "UNIT", "coordinator"] in headers and ["COUNTER", "UNIT", "backup-0"] in headers
    assert any(line.split()[:2] == ["streams", "count"] for line in lines)
    assert any(line.startswith("metadata: ") for line in lines)   # a group's legend
    data = json.loads(as_json.stdout)
    assert set(data) == {"brokers", "backups", "coordinator"} and list(data["backups"]) == ["0"]


def has_data_path() -> bool:
    try:
        import kera.broker.server  # noqa: F401
        from kera.consumer import Consumer  # noqa: F401
        from kera.producer import Producer  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not has_data_path(), reason="broker, producer or consumer not built yet")
def test_produce_then_consume(tmp_path):
    with LocalCluster(tmp_path, brokers=1, backups=0, log_level="WARNING") as cluster:
        boot = cluster.bootstrap
        assert kera("stream", "create", "lines", bootstrap=boot).returncode == 0
        lines = [f"line {i}" for i in range(2000)]
        produced = kera("produce", "lines", "-o", "linger_ms=2", bootstrap=boot,
                        input="\n".join(lines) + "\n")
        assert produced.returncode == 0, produced.stderr
        assert "produced 2000 records to 'lines'" in produced.stderr

        consumed = kera("consume", "lines", "--from", "earliest", "--max-records", "2000",
                        "--timeout-s", "20", bootstrap=boot)
        assert consumed.returncode == 0, consumed.stderr
        assert consumed.stdout.splitlines() == lines

        # Keys, and an idle timeout that ends a read of everything.
        assert kera("produce", "lines", "--key-sep", ":", "--quiet", bootstrap=boot,
                    input="k1:v1\nno key here\n").returncode == 0
        keyed = kera("consume", "lines", "--from", "earliest", "--timeout-s", "1",
                     "--print-key", "--key-sep", "=", bootstrap=boot)
        assert keyed.returncode == 0, keyed.stderr
        assert keyed.stdout.splitlines()[-2:] == ["k1=v1", "=no key here"]
        assert len(keyed.stdout.splitlines()) == 2002

        # A group: a first read commits what it printed, the next resumes right after it.
        first = kera("consume", "lines", "--group", "cli-g", "--from", "earliest",
                     "--max-records", "1500", "--timeout-s", "20", bootstrap=boot)
        assert first.returncode == 0, first.stderr
        assert "committed 1500 records' positions in group 'cli-g'" in first.stderr
        rest = kera("consume", "lines", "--group", "cli-g", "--timeout-s", "2", bootstrap=boot)
        assert rest.returncode == 0, rest.stderr
        assert sorted(first.stdout.splitlines() + rest.stdout.splitlines()) == \
            sorted(lines + ["v1", "no key here"])

        missing = kera("consume", "nope", "--timeout-s", "1", bootstrap=boot)
        assert missing.returncode == 1 and "(unknown_stream)" in missing.stderr

        # kcat-style --format: each field of the record the consumer API returns.
        fmt = kera("consume", "lines", "--from", "earliest", "--timeout-s", "1",
                   "-f", r"%t|%S|%g|%o|%n|%T|%k|%s\n", bootstrap=boot)
        assert fmt.returncode == 0, fmt.stderr
        from kera.consumer import Consumer
        with_key = [line for line in fmt.stdout.splitlines() if "|k1|" in line]
        consumer = Consumer(boot, "lines", start="earliest")
        try:
            record = next(r for r in iter(lambda: consumer.poll(timeout_s=20), None)
                          if r.key == b"k1")
        finally:
            consumer.close()
        assert with_key == [f"lines|{record.streamlet}|{record.group}|{record.offset}|"
                            f"{record.number}|{record.timestamp // 1000}|k1|v1"]
        bad = kera("consume", "lines", "-f", "%x", bootstrap=boot)
        assert bad.returncode == 1 and "unknown field %x" in bad.stderr
