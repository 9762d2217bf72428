"""`kera bench` stopped with SIGTERM while its Kafka cluster is still starting stops that
cluster's JVMs on the way out (the run unwinds as after Ctrl-C) and exits 130."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

JVM_START_WAIT_S = 120.0   # the jars are built by the suite's Kafka fixtures; a JVM starts in s
STOP_WAIT_S = 60.0


def _jvms_under(marker: str) -> list[int]:
    """Pids of java processes whose command line names `marker` (the run's work dir)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"java" in cmdline and marker.encode() in cmdline:
            pids.append(int(entry))
    return pids


def test_sigterm_while_kafka_starts_leaves_no_jvm(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kera", "bench", "--preset", "quick", "--systems", "kafka",
         "--repeats", "1", "--no-ceiling", "--no-plots", "--plain", "--work-dir", str(work),
         "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + JVM_START_WAIT_S
        while not _jvms_under(str(work)):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no Kafka JVM started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_WAIT_S) == 130
        deadline = time.monotonic() + STOP_WAIT_S
        while _jvms_under(str(work)):
            assert time.monotonic() < deadline, f"JVMs left running: {_jvms_under(str(work))}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _jvms_under(str(work)):
            os.kill(pid, signal.SIGKILL)
