"""kera's Producer and Consumer built from confluent-kafka configuration dicts, against a real
cluster: the settings take effect (a group, its commits, the start position)."""

import time

import pytest

from kera import Admin, Consumer, Producer
from kera.errors import BadRequest

WAIT_S = 20.0


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=1, backups=1, log_level="WARNING")


def test_a_kafka_config_dict_produces_and_a_group_consumes_and_commits(cluster):
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream("kconf", streamlets=2)
    with Producer({"bootstrap.servers": cluster.bootstrap, "linger.ms": 2, "acks": "all",
                   "enable.idempotence": True, "partitioner": "murmur2_random"}) as p:
        p.send_batch("kconf", [b"v%d" % i for i in range(50)],
                     keys=[b"k%d" % i for i in range(50)])
        p.flush()
    conf = {"bootstrap.servers": cluster.bootstrap, "group.id": "kconf-g",
            "auto.offset.reset": "earliest", "enable.auto.commit": False}
    got = []
    with Consumer(conf, "kconf") as c:
        deadline = time.monotonic() + WAIT_S
        while len(got) < 50:
            assert time.monotonic() < deadline, f"read {len(got)} of 50"
            r = c.poll(timeout_s=0.2)
            if r is not None:
                got.append(r.value)
        c.commit()
        committed = c.committed()
    assert sorted(got) == sorted(b"v%d" % i for i in range(50))
    assert sum(p.offset for p in committed) == 50


def test_a_dict_beside_kera_keywords_is_refused():
    with pytest.raises(BadRequest, match="not both"):
        Producer({"bootstrap.servers": "127.0.0.1:1"}, linger_ms=50)
