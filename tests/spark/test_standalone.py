"""Format "kera" from a Spark standalone cluster (a master and two workers, each executor its
own JVM and Python worker; tests/spark/standalone.py), not only `local[2]`: batch and streaming
reads and writes, the exactly-once sink through an executor killed with -9 mid-batch, and the
import check refusing executors whose Python cannot import kera."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from standalone import stop_active_spark, wait_until
from test_spark_connector import broker_stats, create, opts, produce, read_all

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
# A query's run on two 1-core executors of a loaded 2-core machine (normally 5-15 s).
QUERY_TIMEOUT_S = 240.0
# The blocked write attempt waits this long for the test to kill its executor, then fails.
BLOCK_LIMIT_S = QUERY_TIMEOUT_S


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=0)


def executor_pids_that_ran(df) -> set[int]:
    """The Python worker processes that ran `df`'s partitions."""
    return set(df.rdd.mapPartitions(lambda _rows: [os.getpid()]).collect())


def test_the_session_runs_on_two_executor_jvms(standalone, standalone_spark):
    sc = standalone_spark.sparkContext
    assert sc.master == standalone.url
    assert len(standalone.executor_pids()) == 2
    # two tasks at once need both 1-core executors, each with its own Python worker
    ran = executor_pids_that_ran(standalone_spark.range(0, 4, 1, 2))
    assert len(ran) == 2


def test_batch_write_and_read_on_executors(standalone_spark, cluster):
    spark = standalone_spark
    create(cluster, "sa-batch", streamlets=3, active_groups=2)
    rows = [(f"user-{i % 17}", f"value-{i:05d}") for i in range(4000)]
    df = spark.createDataFrame(rows, "key string, value string").repartition(4)
    df.write.format("kera").options(**opts(cluster, "sa-batch", chunkSizeBytes="2048")).mode("append").save()

    back = read_all(spark, cluster, "sa-batch", minPartitions="4")
    assert back.rdd.getNumPartitions() >= 4
    got = back.select("key", "value", "streamlet", "group", "offset").collect()
    assert Counter((r.key.decode(), r.value.decode()) for r in got) == Counter(rows)
    assert len({(r.streamlet, r.group, r.offset) for r in got}) == len(got)


def test_streaming_read_and_write_on_executors(standalone_spark, cluster, tmp_path):
    spark = standalone_spark
    create(cluster, "sa-in", streamlets=2, active_groups=2)
    create(cluster, "sa-out", streamlets=2)
    first = [b"a%05d" % i for i in range(1500)]
    produce(cluster, "sa-in", first, [b"k%d" % (i % 7) for i in range(len(first))])
    ck = str(tmp_path / "ck")

    def run():
        src = spark.readStream.format("kera").options(
            **opts(cluster, "sa-in", startingOffsets="earliest", maxOffsetsPerTrigger="600")).load()
        q = (src.selectExpr("key", "upper(cast(value as string)) as value")
             .writeStream.format("kera").options(**opts(cluster, "sa-out"))
             .option("checkpointLocation", ck).trigger(availableNow=True).start())
        assert q.awaitTermination(QUERY_TIMEOUT_S)
        assert q.exception() is None
        return q

    q = run()
    assert q.lastProgress is not None and q.lastProgress["batchId"] >= 2   # 600 per batch
    more = [b"b%05d" % i for i in range(400)]
    produce(cluster, "sa-in", more, [b"k%d" % (i % 5) for i in range(len(more))], producer_id=100)
    run()   # resumes from its checkpoint: only the new records
    got = Counter(bytes(r.value) for r in read_all(spark, cluster, "sa-out").collect())
    assert got == Counter(v.upper() for v in first + more)


def descendant_of(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])   # field 4, after the command's ')'
    return False


def test_exactly_once_sink_through_a_killed_executor(standalone, standalone_spark, cluster, tmp_path):
    """A write task blocks mid-partition after its sink has sent chunks; the test kill -9s the
    executor JVM running it. Spark re-runs the task on the other worker, which rebuilds the
    same chunks under the same producer ids: the broker drops the ones it has, every row is
    stored exactly once."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    spark = standalone_spark
    create(cluster, "sa-src", streamlets=2, active_groups=2)
    create(cluster, "sa-dst", streamlets=2, active_groups=2)
    n = 2000
    # Values large enough that the blocked UDF cannot run far ahead of the sink.
    values = [b"r%05d-" % i + b"." * 2000 for i in range(n)]
    produce(cluster, "sa-src", values, [b"u%d" % (i % 9) for i in range(n)], per_chunk=20)
    blocked, released = tmp_path / "blocked", tmp_path / "released"
    poison = "r01500-"
    # The rows the blocked task passes to its sink before it blocks (its partition is the
    # poison's (streamlet, group)); one of them stored means the sink has sent chunks.
    src_rows = read_all(spark, cluster, "sa-src").select("value", "streamlet", "group", "offset").collect()
    (p,) = [r for r in src_rows if bytes(r.value).startswith(poison.encode())]
    ahead = {bytes(r.value) for r in src_rows
             if (r.streamlet, r.group) == (p.streamlet, p.group) and r.offset < p.offset}
    assert len(ahead) > 100, "the poison row is too early in its partition"

    def block_once(v):
        import time
        if v.startswith(poison) and not blocked.exists():
            blocked.write_text(str(os.getpid()))
            deadline = time.monotonic() + BLOCK_LIMIT_S
            while not released.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("the executor running this task was not killed")
        return v

    fail = F.udf(block_once, StringType())
    before = sum(s.get("duplicates", 0) for s in broker_stats(cluster))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        src = spark.readStream.format("kera").options(
            **opts(cluster, "sa-src", startingOffsets="earliest")).load()
        out = src.select("key", fail(F.col("value").cast("string")).alias("value"), "timestamp")
        q = (out.writeStream.format("kera").options(**opts(cluster, "sa-dst", chunkSizeBytes="16384"))
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
        wait_until(blocked.exists, QUERY_TIMEOUT_S, "a write task blocked mid-partition")
        wait_until(lambda: ahead & {bytes(r.value) for r in read_all(spark, cluster, "sa-dst")
                                    .select("value").collect()},
                   QUERY_TIMEOUT_S, "a chunk of the blocked task stored")
        udf_pid = int(blocked.read_text())
        victims = [p for p in standalone.executor_pids() if descendant_of(udf_pid, p)]
        assert len(victims) == 1, (udf_pid, standalone.executor_pids())
        os.kill(victims[0], signal.SIGKILL)
        assert q.awaitTermination(QUERY_TIMEOUT_S)
        assert q.exception() is None, q.exception()
    finally:
        released.write_text("x")
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = read_all(spark, cluster, "sa-dst").select("key", "value", "timestamp").collect()
    assert len(got) == n
    assert Counter(bytes(r.value) for r in got) == Counter(values)
    src_rows = {bytes(r.value): r for r in read_all(spark, cluster, "sa-src").collect()}
    assert all(src_rows[bytes(r.value)].key == r.key and src_rows[bytes(r.value)].timestamp == r.timestamp
               for r in got)
    after = sum(s.get("duplicates", 0) for s in broker_stats(cluster))
    assert after > before, "the re-run task re-sent chunks the broker already had"


# --------------------------------------------------------------------------- executors' Python

KERA_DEPENDENCIES = ("zmq", "msgpack", "numpy", "crc32c", "pyarrow", "lz4", "zstandard")


def make_venv(path: Path) -> str:
    """A bare `python -m venv` (no system site-packages, no pip): its python cannot import
    kera. Same Python version as the driver, as PySpark requires."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=VENV_TIMEOUT_S)
    return str(path / "bin" / "python")


def venv_site_packages(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True,
                          timeout=VENV_TIMEOUT_S).stdout.strip()


def cannot_import_kera(python: str) -> bool:
    # Not from the repository's directory: `-c` puts the working directory on sys.path.
    return subprocess.run([python, "-c", "import kera"], capture_output=True, cwd="/",
                          timeout=VENV_TIMEOUT_S).returncode != 0


VENV_TIMEOUT_S = 120.0     # creating a venv / starting an interpreter on a loaded machine


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    python = make_venv(tmp_path_factory.mktemp("venv") / "bare")
    assert cannot_import_kera(python)
    return python


@pytest.fixture(scope="module")
def deps_python(tmp_path_factory) -> str:
    """A venv with kera's dependencies (the directories they are installed in, on its path
    through a .pth file, whose own .pth hooks do not run) but not kera."""
    import importlib
    python = make_venv(tmp_path_factory.mktemp("venv") / "deps")
    dirs = {str(Path(importlib.import_module(m).__file__).parents[1]) for m in KERA_DEPENDENCIES}
    Path(venv_site_packages(python), "kera-deps.pth").write_text("\n".join(sorted(dirs)) + "\n")
    assert cannot_import_kera(python), "kera is installed in a dependency's directory"
    return python


@pytest.fixture(scope="module")
def kera_zip(tmp_path_factory) -> str:
    """kera built as a wheel (`pip wheel --no-deps .`), copied to a .zip name: Spark puts only
    .zip/.egg/.jar py-files on executors' sys.path, and a pure-Python wheel is a zip."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(out), str(REPO)], check=True, timeout=VENV_TIMEOUT_S)
    (wheel,) = out.glob("kera-*.whl")
    return str(shutil.copy(wheel, out / "kera.zip"))


def session_with_python(standalone, python: str, app: str):
    """A new session on `standalone` whose Python workers (executors' and the driver's
    planners) run `python`; PySpark reads PYSPARK_PYTHON when the context starts."""
    stop_active_spark()
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python
    try:
        session = standalone.session(app)
    finally:
        os.environ["PYSPARK_PYTHON"] = saved if saved is not None else sys.executable
    session.sparkContext.setLogLevel("ERROR")
    return session


def refusal(standalone, python: str) -> str:
    """The SparkSetupError message register() raises on a session whose workers run `python`."""
    import kera.spark
    from kera.errors import SparkSetupError
    session = session_with_python(standalone, python, "kera-refused")
    try:
        with pytest.raises(SparkSetupError) as err:
            kera.spark.register(session)
    finally:
        session.stop()
    return err.value.message


def test_executors_whose_python_lacks_kera_are_refused_when_registering(standalone, bare_python,
                                                                        tmp_path):
    message = refusal(standalone, bare_python)
    assert bare_python in message and "No module named 'kera'" in message
    assert "addPyFile" in message and "spark.archives" in message     # what to do
    assert "in stage" not in message     # one line, not Spark's stack
    # An interpreter that does not exist there: the Python worker never starts.
    missing = str(tmp_path / "no-such-python")
    message = refusal(standalone, missing)
    assert f'Cannot run program "{missing}"' in message and "in stage" not in message


def test_kera_shipped_as_a_wheel_reaches_executors_with_their_own_python(
        standalone, deps_python, kera_zip, cluster):
    import kera.spark
    session = session_with_python(standalone, deps_python, "kera-shipped-wheel")
    try:
        session.sparkContext.addPyFile(kera_zip)     # before register(): its probe needs it
        kera.spark.register(session)
        create(cluster, "sa-wheel", streamlets=2)
        rows = [(f"k{i % 5}", f"v{i:04d}") for i in range(1000)]
        (session.createDataFrame(rows, "key string, value string").repartition(2)
         .write.format("kera").options(**opts(cluster, "sa-wheel")).mode("append").save())
        back = read_all(session, cluster, "sa-wheel")
        got = back.select("key", "value").collect()
        where = set(back.rdd.mapPartitions(
            lambda _rows: [(__import__("kera").__file__, __import__("sys").executable)]).collect())
    finally:
        session.stop()
    assert Counter((r.key.decode(), r.value.decode()) for r in got) == Counter(rows)
    assert {python for _file, python in where} == {deps_python}
    assert all("kera.zip" in file for file, _python in where), where
