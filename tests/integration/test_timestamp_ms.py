"""Millisecond timestamps at the API (Kafka's unit): stored as microseconds, and a value in
another unit refused with an error that names the expected one."""
import time

import pytest

from kera.consumer import Consumer
from kera.errors import BadRequest
from kera.producer import Producer


def test_timestamp_ms_round_trips_and_wrong_unit_is_refused(local_cluster):
    cluster = local_cluster(brokers=1)
    from kera.client.admin import Admin
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream("ts_ms", streamlets=1)
    now_ms = int(time.time() * 1000)
    with Producer(cluster.bootstrap) as p:
        p.send("ts_ms", b"v", timestamp_ms=now_ms)
        for wrong in (now_ms // 1000, now_ms * 1000):  # seconds, microseconds
            with pytest.raises(BadRequest, match="milliseconds"):
                p.send("ts_ms", b"x", timestamp_ms=wrong)
        p.flush()
    consumer = Consumer(cluster.bootstrap, "ts_ms", start="earliest")
    try:
        record = consumer.poll(timeout_s=20)
    finally:
        consumer.close()
    assert record.value == b"v" and record.timestamp == now_ms * 1000
    assert record.timestamp_ms == now_ms
