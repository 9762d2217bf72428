"""Spark fixtures: one small real SparkSession shared by every Spark test, with format "kera"
registered, and a kera cluster per test module (the `local_cluster` factory of tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest


def _spark_available() -> bool:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return False
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    if not _spark_available():
        pytest.skip("pyspark and a Java runtime are needed")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import kera.spark

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = (SparkSession.builder.master("local[2]").appName("kera-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.memory", "1g")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.warehouse.dir", str(warehouse))
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.streaming.stopTimeout", "30s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    kera.spark.register(session)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def kera_cluster(local_cluster):
    """One broker, no backups (replication 1): what the connector's tests need."""
    return local_cluster(brokers=1, backups=0)
