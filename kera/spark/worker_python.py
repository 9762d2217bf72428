"""Can Spark's Python workers import kera? Checked on the driver when the connector is
registered, because otherwise every task fails with "No module named 'kera'", four times.

Spark starts its Python workers (and the worker that plans a Python data source) with
`spark.pyspark.python`, else $PYSPARK_PYTHON, else `python3` on the PATH. With a `local`
master those workers run on this machine, so the check starts that interpreter and imports
kera. With any other master the executors are elsewhere: nothing can be checked from here,
so an unset interpreter only gets a warning.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from kera.errors import SparkSetupError

log = logging.getLogger(__name__)

SPARK_DEFAULT_PYTHON = "python3"     # what Spark runs when nothing is set
# Starting an interpreter and importing kera (numpy, pyarrow, zmq) on a loaded machine.
IMPORT_CHECK_TIMEOUT_S = 60.0
PROBE = "import kera.spark.columns"  # what a task needs: kera and its Arrow columns


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
