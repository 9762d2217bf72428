"""PySpark connector: format "kera" for batch and streaming reads and writes.

    import kera.spark
    kera.spark.register(spark)     # once per SparkSession

    df = (spark.readStream.format("kera")
          .option("bootstrap", "127.0.0.1:7000").option("stream", "clicks").load())
    query = (df.writeStream.format("kera")
             .option("bootstrap", "127.0.0.1:7000").option("stream", "copy")
             .option("checkpointLocation", "/tmp/ck").start())

See kera/spark/README.md for options, offsets and the exactly-once guarantee.
"""

from __future__ import annotations


def register(spark, check_workers: bool = True) -> None:
    """Register format "kera" with a SparkSession. First (unless `check_workers` is False)
    check that Spark's Python workers can import kera: raises kera.errors.SparkSetupError
    saying what to set (kera.spark.worker_python)."""
    from kera.spark.source import KeraDataSource
    if check_workers:
        from kera.spark import worker_python
        sc = spark.sparkContext
        if sc.master.startswith("local"):
            worker_python.check(sc.master, sc.getConf().get("spark.pyspark.python"))
        else:     # executors elsewhere: a probe job imports kera on them
            worker_python.check_executors(sc)
    spark.dataSource.register(KeraDataSource)


def __getattr__(name):
    # Lazy: importing kera.spark must not need pyspark until the data source is used.
    if name == "KeraDataSource":
        from kera.spark.source import KeraDataSource
        return KeraDataSource
    raise AttributeError(f"module 'kera.spark' has no attribute {name!r}")


__all__ = ["register", "KeraDataSource"]
