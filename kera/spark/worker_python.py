"""Can Spark's Python workers import kera? Checked on the driver when the connector is
registered, because otherwise every task fails with "No module named 'kera'", four times.

Spark starts its Python workers (and the worker that plans a Python data source) with
`spark.pyspark.python`, else $PYSPARK_PYTHON, else `python3` on the PATH. With a `local`
master those workers run on this machine, so the check starts that interpreter and imports
kera. With any other master (a standalone, YARN or Kubernetes cluster) the executors are
elsewhere, so `check_executors` runs a small probe job instead: one task per core imports kera
on an executor and reports what failed, or the Python worker itself fails to start there.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from kera.errors import SparkSetupError

log = logging.getLogger(__name__)

SPARK_DEFAULT_PYTHON = "python3"     # what Spark runs when nothing is set
# Starting an interpreter and importing kera (numpy, pyarrow, zmq) on a loaded machine.
IMPORT_CHECK_TIMEOUT_S = 60.0
PROBE = "import kera.spark.columns"  # what a task needs: kera and its Arrow columns
# The probe job waits for executors (a busy cluster may take a while to grant cores); past
# this it is cancelled and the connector is registered unchecked, with a warning.
EXECUTOR_PROBE_TIMEOUT_S = 120.0
PROBE_JOB_GROUP = "kera-worker-import-check"


def worker_python(conf_python: str | None, env: dict) -> str:
    """The interpreter Spark starts Python workers with."""
    return conf_python or env.get("PYSPARK_PYTHON") or SPARK_DEFAULT_PYTHON


def import_problem(python: str) -> str | None:
    """Why `python` cannot import kera, or None if it can."""
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True,
                              timeout=IMPORT_CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"there is no interpreter {python!r}"
    except subprocess.TimeoutExpired:
        return f"{python!r} did not import kera within {IMPORT_CHECK_TIMEOUT_S:g} s"
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"{python!r} exited with status {proc.returncode}"


def check(master: str, conf_python: str | None, env: dict | None = None) -> None:
    """Raise SparkSetupError naming what to set if local workers cannot import kera."""
    env = os.environ if env is None else env
    python = worker_python(conf_python, env)
    if not master.startswith("local"):
        if python == SPARK_DEFAULT_PYTHON:
            log.warning("Spark's executors will run %r, which must be able to import kera: "
                        "set PYSPARK_PYTHON (or spark.pyspark.python) to an interpreter "
                        "with kera installed on every executor", python)
        return
    problem = import_problem(python)
    if problem is not None:
        raise SparkSetupError(
            f"Spark's Python workers run {python!r}, which cannot import kera ({problem}): "
            f"export PYSPARK_PYTHON={sys.executable} before starting Spark, or set "
            f"spark.pyspark.python to it (the interpreter kera is installed in)")


def _probe_function():
    """The probe task. Built inside a function so cloudpickle ships it by value: an executor
    must be able to run it without importing kera (which is what it tests)."""
    def probe(_rows):
        import socket
        import sys as worker_sys
        try:
            import kera.spark.columns  # noqa: F401 - the import PROBE names
        except Exception as err:    # noqa: BLE001 - any import failure is the report
            yield f"{socket.gethostname()} ({worker_sys.executable}): {type(err).__name__}: {err}"
    return probe


def executor_problems(sc, timeout_s: float = EXECUTOR_PROBE_TIMEOUT_S) -> list[str] | None:
    """What stops executors from importing kera ([] when nothing), or None if no executor
    ran the probe within `timeout_s`. One task per core, so every executor normally runs one."""
    tasks = max(int(sc.defaultParallelism), 1)
    outcome: dict = {}

    def run() -> None:
        sc.setJobGroup(PROBE_JOB_GROUP, "kera: can the executors import kera?", True)
        try:
            outcome["problems"] = sc.parallelize(range(tasks), tasks).mapPartitions(
                _probe_function()).collect()
        except Exception as err:    # noqa: BLE001 - the Python worker did not start there
            outcome["problems"] = [_first_cause(err)]

    thread = threading.Thread(target=run, name="kera-import-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        sc.cancelJobGroup(PROBE_JOB_GROUP)
        return None
    return sorted(set(outcome["problems"]))


FAILURE_MARK = "most recent failure: "   # Spark: "... most recent failure: Lost task 1.3 (...): why"


def _first_cause(err: Exception) -> str:
    """The reason a failed job gives (Spark wraps it in a stage failure and pages of stack)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    line = next((x for x in lines if FAILURE_MARK in x), None)
    if line is not None:
        return line.split(FAILURE_MARK, 1)[1].split("): ", 1)[-1]
    line = next((x for x in lines if "Error:" in x or "Exception:" in x), None)
    return line or (lines[0] if lines else type(err).__name__)


def check_executors(sc, timeout_s: float = EXECUTOR_PROBE_TIMEOUT_S) -> None:
    """Raise SparkSetupError naming what to set if the cluster's executors cannot import kera."""
    python = getattr(sc, "pythonExec", None) or worker_python(
        sc.getConf().get("spark.pyspark.python"), os.environ)
    problems = executor_problems(sc, timeout_s)
    if problems is None:
        log.warning("no Spark executor ran kera's import check within %g s; registered "
                    "format 'kera' unchecked", timeout_s)
        return
    if problems:
        raise SparkSetupError(
            f"Spark's executors run Python {python!r}, which cannot import kera: "
            f"{'; '.join(problems)}. Install kera where the executors run, or ship it with "
            f"the job: a wheel (pip wheel --no-deps kera) copied to a name ending in .zip "
            f"(Spark puts only .zip/.egg/.jar py-files on sys.path) and added with "
            f"SparkContext.addPyFile or --py-files, kera's dependencies installed for that "
            f"Python; or a packed environment in spark.archives with PYSPARK_PYTHON pointing "
            f"into it (kera/spark/README.md, 'Executors')")
