"""A Spark standalone cluster started from the pyspark package: one master and two workers,
each its own JVM (`spark-class ...deploy.master.Master` / `...deploy.worker.Worker`), on free
loopback ports with private work and log dirs. Executors the workers launch are their child
JVMs, each with its own Python workers, so a test can kill -9 one of them.

    with StandaloneSpark(tmp_dir) as cluster:
        session = cluster.session("app")     # master spark://127.0.0.1:P, 1 core per executor
        cluster.executor_pids()              # this cluster's executor JVMs
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from kera.cli.local import free_port

HOST = "127.0.0.1"
WORKERS = 2
WORKER_CORES = 1
WORKER_MEMORY = "1g"
EXECUTOR_MEMORY = "512m"      # two executors and the driver fit a small test machine
# Three JVMs starting on a loaded 2-core machine take tens of seconds.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
HTTP_TIMEOUT_S = 5.0          # one request to the master's web UI
POLL_S = 0.25
EXECUTOR_MAIN = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


class StandaloneError(RuntimeError):
    """The standalone cluster did not come up (its logs are in the work dir)."""


def spark_home() -> str:
    import pyspark
    return os.path.dirname(pyspark.__file__)


def wait_until(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns something truthy (returned) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    raise StandaloneError(f"timed out after {timeout_s:g} s waiting for {what}")


def _children(pid: int) -> list[int]:
    # A JVM starts processes from any of its threads; each thread lists its own children.
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.extend(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class StandaloneSpark:
    """Master and workers as subprocesses in their own sessions; stopped (with the executors
    they launched) by `stop()`."""

    def __init__(self, work_dir: Path):
        self.work_dir = Path(work_dir)
        self.port, self.ui_port = free_port(), free_port()
        self.url = f"spark://{HOST}:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "StandaloneSpark":
        self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", HOST,
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        wait_until(self._master_json, START_TIMEOUT_S, "the Spark master's web UI")
        for i in range(WORKERS):
            work = self.work_dir / f"worker{i}"
            work.mkdir(parents=True, exist_ok=True)
            self._spawn(f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.url,
                        "--host", HOST, "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY,
                        "--webui-port", str(free_port()), "--work-dir", str(work))
        wait_until(lambda: self.alive_workers() >= WORKERS, START_TIMEOUT_S,
                   f"{WORKERS} workers registered with the master")
        return self

    def _spawn(self, name: str, main_class: str, *args: str) -> None:
        home = spark_home()
        log = self.work_dir / f"{name}.log"
        self.logs.append(log)
        env = {**os.environ, "SPARK_HOME": home, "SPARK_LOCAL_IP": HOST,
               "SPARK_LOG_DIR": str(self.work_dir), "SPARK_LOCAL_DIRS": str(self.work_dir / "local"),
               "SPARK_WORKER_DIR": str(self.work_dir)}
        with open(log, "ab") as out:
            self.procs.append(subprocess.Popen(
                [os.path.join(home, "bin", "spark-class"), main_class, *args], env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))   # its own group: stop() takes its executors too

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_S)
        self.procs.clear()

    def __enter__(self) -> "StandaloneSpark":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ state

    def _master_json(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.ui_port}/json",
                                        timeout=HTTP_TIMEOUT_S) as reply:
                return json.load(reply)
        except OSError:
            return None
        except json.JSONDecodeError:
            # Spark 4.3's master answers /json with its HTML page for a moment while its web UI
            # is still attaching handlers: not up yet.
            return None

    def alive_workers(self) -> int:
        state = self._master_json() or {}
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def executor_pids(self) -> list[int]:
        """Executor JVMs running under this cluster's workers (not anyone else's)."""
        pids = []
        for worker in self.procs[1:]:
            stack = [worker.pid]
            while stack:
                pid = stack.pop()
                if EXECUTOR_MAIN in _cmdline(pid):
                    pids.append(pid)
                stack.extend(_children(pid))
        return pids

    def log_tails(self, lines: int = 30) -> str:
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"== {log.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    # ------------------------------------------------------------------ driver

    def session(self, app: str, **conf: str):
        """A SparkSession on this cluster: one executor per worker, each with 1 core."""
        from pyspark.sql import SparkSession
        builder = (SparkSession.builder.master(self.url).appName(app)
                   .config("spark.ui.enabled", "false")
                   .config("spark.driver.host", HOST).config("spark.driver.bindAddress", HOST)
                   .config("spark.driver.memory", "1g")
                   .config("spark.executor.memory", EXECUTOR_MEMORY)
                   .config("spark.executor.cores", str(WORKER_CORES))
                   .config("spark.cores.max", str(WORKERS * WORKER_CORES))
                   .config("spark.sql.shuffle.partitions", str(WORKERS))
                   .config("spark.default.parallelism", str(WORKERS))
                   .config("spark.sql.session.timeZone", "UTC")
                   .config("spark.sql.streaming.stopTimeout", "30s")
                   .config("spark.local.dir", str(self.work_dir / "driver-local")))
        for key, value in conf.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()


def stop_active_spark() -> None:
    """Stop this process's SparkContext, whichever kind it is (local or standalone). Here,
    not in conftest.py: `from conftest import` finds whichever test directory's conftest
    pytest loaded last (tests/hosts' when it is collected after this directory)."""
    from pyspark import SparkContext
    active = SparkContext._active_spark_context
    if active is not None:
        active.stop()
