"""kera.spark.worker_python's executor probe, without Spark: the task function reports an
import failure as text (that it runs on executors without kera, shipped by value, is
tests/spark/test_standalone.py's), and a failed probe job is reduced to the reason Spark gives."""

from __future__ import annotations

from kera.spark import worker_python

SPARK_FAILURE = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 0.0 failed 4 times, most recent failure: Lost task 1.3 in stage 0.0 (TID 4) (127.0.0.1 executor 0): java.io.IOException: Cannot run program "/opt/py/bin/python": error=2, No such file or directory
\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)
"""


def test_a_failed_probe_job_is_reduced_to_spark_s_reason():
    reason = worker_python._first_cause(RuntimeError(SPARK_FAILURE))
    assert reason == ('java.io.IOException: Cannot run program "/opt/py/bin/python": '
                      'error=2, No such file or directory')


def test_other_errors_keep_their_error_line():
    assert worker_python._first_cause(RuntimeError("context\nValueError: bad\nmore")) == "ValueError: bad"
    assert worker_python._first_cause(RuntimeError("")) == "RuntimeError"


def test_the_probe_reports_nothing_where_kera_imports():
    assert list(worker_python._probe_function()(iter([0]))) == []

