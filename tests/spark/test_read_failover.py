"""The Spark reader's tasks against a real cluster, without Spark: a task planned against a
broker that is then killed (kill -9) follows its streamlet to the new owner, through the
clients' one request-thread shell, and reads every planned row exactly once."""

from __future__ import annotations

import time

from kera.producer import Producer
from kera.spark import offsets as ko
from kera.spark.fetch import read_group
from kera.spark.options import Options
from kera.spark.source import _Planner

STREAMLETS = 3
RECORDS = 900
SETTLE_TIMEOUT_S = 30.0


def until(cond, what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_read_task_follows_its_streamlet_to_the_new_owner(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=1, log_level="WARNING")
    stream = "spark-failover"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=STREAMLETS, replication=2)
    with Producer(cluster.bootstrap) as p:
        for i in range(RECORDS):
            p.send(stream, b"row-%05d" % i, key=b"k%d" % (i % 17))
    opts = Options.parse({"bootstrap": cluster.bootstrap, "stream": stream})
    planner = _Planner(opts)
    try:
        info, groups = planner.snapshot(stream)
        parts = [part for sl, infos in groups.items()
                 for part in planner.partitions(stream, info, sl, ko.Cursor(),
                                                ko.advance(ko.Cursor(), infos), infos)]
    finally:
        planner.close()
    with cluster.admin() as admin:
        victim = admin.describe_stream(stream)["placement"][0]
        cluster.kill_broker(victim)
        until(lambda: victim not in admin.describe_stream(stream)["placement"],
              "the dead broker's streamlets placed elsewhere")
    moved = [part for part in parts if part.address == info.owner(0)]
    assert moved, "some planned tasks point at the killed broker"
    values = []
    for part in parts:
        for batch in read_group(part):
            values += batch.column("value").to_pylist()
    assert sorted(values) == [b"row-%05d" % i for i in range(RECORDS)]
