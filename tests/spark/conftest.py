"""Spark fixtures: one small real SparkSession shared by every Spark test, with format "kera"
registered, and a kera cluster per test module (the `local_cluster` factory of tests/conftest.py).
A module may instead use a Spark standalone cluster (`standalone`, `standalone_spark`,
tests/spark/standalone.py); one JVM holds one SparkContext at a time, so each session is
built on first use and again after the other kind stopped it.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from standalone import stop_active_spark


def _spark_available() -> bool:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return False
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


def _alive(session) -> bool:
    return session is not None and session.sparkContext._jsc is not None


@pytest.fixture(scope="session")
def _sessions():
    """The sessions the fixtures built, by kind; stopped when the test session ends."""
    made: dict = {}
    yield made
    if any(_alive(s) for s in made.values()):
        stop_active_spark()


@pytest.fixture
def spark(tmp_path_factory, _sessions):
    if not _spark_available():
        pytest.skip("pyspark and a Java runtime are needed")
    if not _alive(_sessions.get("local")):
        stop_active_spark()
        _sessions["local"] = _local_session(tmp_path_factory)
    return _sessions["local"]


def _local_session(tmp_path_factory):
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
    return session


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """A Spark standalone cluster (a master and two workers) for this module."""
    if not _spark_available():
        pytest.skip("pyspark and a Java runtime are needed")
    from standalone import StandaloneSpark
    cluster = StandaloneSpark(tmp_path_factory.mktemp("spark-standalone"))
    try:
        cluster.start()
    except Exception:
        sys.stderr.write(cluster.log_tails())
        cluster.stop()
        raise
    yield cluster
    stop_active_spark()
    cluster.stop()


@pytest.fixture
def standalone_spark(standalone, _sessions):
    """A SparkSession on `standalone` (one executor JVM per worker), format "kera" registered."""
    import kera.spark
    session = _sessions.get("standalone")
    if not _alive(session) or session.sparkContext.master != standalone.url:
        stop_active_spark()
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        session = standalone.session("kera-standalone-tests")
        session.sparkContext.setLogLevel("ERROR")
        kera.spark.register(session)
        _sessions["standalone"] = session
    return _sessions["standalone"]


@pytest.fixture(scope="module")
def kera_cluster(local_cluster):
    """One broker, no backups (replication 1): what the connector's tests need."""
    return local_cluster(brokers=1, backups=0)
