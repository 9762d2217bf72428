"""Record numbers go on after retention emptied a streamlet and its broker died (issue 16): with
nothing left to rebuild from, the new owner continues from the floor its dead owner reported
to the coordinator, instead of numbering from 0 again."""

from __future__ import annotations

from faultkit import call, wait_for

from kera import Consumer, Producer

STREAM = "idle"
RECORDS = 3_000
RETENTION_MS = 1_000     # the coordinator's minimum: the stream empties within seconds


def describe(cluster) -> dict:
    return call(cluster.bootstrap, "describe_stream", {"name": STREAM})["stream"]


def test_numbers_and_groups_go_on_after_retention_emptied_a_streamlet_and_its_broker_died(
        fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=2, heartbeat_interval_ms=100, log_level="INFO",
                            extra_coordinator_args=["--heartbeat-missed-max", "30"])
    with cluster.admin() as admin:
        admin.create_stream(STREAM, streamlets=1, replication=2, retention_ms=RETENTION_MS,
                            segment_size_bytes=64 * 1024, group_segments=1)
    with Producer(cluster.bootstrap, linger_ms=5) as producer:
        for i in range(RECORDS):
            producer.send(STREAM, b"%d" % i + b"." * 100)
    floors = wait_for(lambda: describe(cluster).get("floors"),
                      "retention to empty the streamlet and its owner to report its floor")
    [[streamlet, first_group, [next_number]]] = floors
    assert (streamlet, next_number) == (0, RECORDS) and first_group > 0
    owner = describe(cluster)["placement"][0]
    cluster.kill_broker(owner)
    wait_for(lambda: call(cluster.bootstrap, "recovery_status")["failed"], "the failover")
    with Producer(cluster.bootstrap, request_timeout_s=5.0) as producer:
        after = producer.send(STREAM, b"after").result(60)
    assert describe(cluster)["placement"][0] != owner
    assert after.number == RECORDS, "the numbering restarted"
    with Consumer(cluster.bootstrap, STREAM, start="earliest") as consumer:
        record = wait_for(lambda: consumer.poll(timeout_s=0.2), "the record after the failover")
    assert (record.value, record.number) == (b"after", RECORDS)
    assert record.group >= first_group, "group ids restarted"
