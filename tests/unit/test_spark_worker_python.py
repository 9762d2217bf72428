"""kera.spark.worker_python: a Spark whose Python workers cannot import kera is refused on the
driver with what to set, instead of every task failing with "No module named 'kera'"."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from kera.errors import SparkSetupError
from kera.spark import worker_python


def python_without_kera(tmp_path) -> str:
    """A real interpreter that cannot see site-packages (-I -S), so kera is not importable."""
    exe = tmp_path / "python-no-kera"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_the_interpreter_spark_uses_conf_then_env_then_python3():
    assert worker_python.worker_python("/conf/python", {"PYSPARK_PYTHON": "/env/python"}) == "/conf/python"
    assert worker_python.worker_python(None, {"PYSPARK_PYTHON": "/env/python"}) == "/env/python"
    assert worker_python.worker_python(None, {}) == "python3"


def test_a_local_worker_that_imports_kera_passes():
    worker_python.check("local[2]", sys.executable, {})


def test_a_local_worker_without_kera_is_refused_naming_what_to_set(tmp_path):
    exe = python_without_kera(tmp_path)
    with pytest.raises(SparkSetupError) as err:
        worker_python.check("local[2]", None, {"PYSPARK_PYTHON": exe})
    message = err.value.message
    assert "No module named 'kera'" in message and exe in message
    assert f"export PYSPARK_PYTHON={sys.executable}" in message


def test_a_missing_interpreter_is_named(tmp_path):
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(SparkSetupError, match="there is no interpreter"):
        worker_python.check("local", missing, {})


def test_a_cluster_master_is_not_checked_here(tmp_path):
    # Executors run elsewhere: even an interpreter that lacks kera here is not refused.
    worker_python.check("spark://host:7077", python_without_kera(tmp_path), dict(os.environ))
