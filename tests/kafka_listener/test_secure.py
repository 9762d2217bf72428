"""A secure cluster's Kafka listener (SASL_SSL), driven by confluent-kafka and kafka-python:
without credentials, with a wrong password, and as a user without ACL grants a client is
refused with Kafka's errors; with credentials and grants it produces and consumes; a user
removed from the users file is refused at its next request; quotas come back as throttle
times; a transactional producer needs write on its transactional id; and no plaintext Kafka
port is ever open.

One secure cluster (`kera local --secure --kafka-port 0`: LocalCluster) for the module, its
Kafka user `client` given grants per test topic by the admin key.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from kafkit import CLIENT_TIMEOUT_MS, WAIT_S, consume_confluent, wait_for
from kera.broker.kafka.sasl import LOGIN_TIMEOUT_S
from kera.cli.local import KAFKA_USER
from kera.net import kafka_users

# Records of the large-batch test: each one batch of several TLS records.
LARGE_RECORD_BYTES = 1 << 20
LARGE_RECORDS = 12
# A produce quota small enough that a few records of its size go over it.
QUOTA_BYTES_PER_S = 8192
# A topic of the probe's own, so a refusal is told apart from an empty cluster.
PROBE = "secure-probe"
# How long a client that cannot log in is given to say so (librdkafka retries connecting).
REFUSAL_WAIT_S = 15.0


@pytest.fixture(scope="module")
def secure_cluster(local_cluster):
    cluster = local_cluster(brokers=2, backups=1, kafka_port=0, secure=True)
    wait_for(lambda: _metadata_ok(cluster), what="the SASL_SSL listeners to answer")
    return cluster


def _metadata_ok(cluster) -> bool:
    admin = AdminClient(_config(cluster))
    try:
        return len(admin.list_topics(topic=PROBE, timeout=5).brokers) == len(cluster.brokers)
    except KafkaException:
        return False


def _config(cluster, **more) -> dict:
    return cluster.kafka_config(**{"socket.timeout.ms": CLIENT_TIMEOUT_MS,
                                   "broker.address.family": "v4", **more})


def _grant(cluster, principal: str, *grants: str) -> None:
    """`kera acl add` as the admin (each grant "operation:type:name"), then wait until every
    broker enforces it."""
    from kera.net.acl import Acl
    admin = cluster.admin()
    try:
        entries = [Acl.parse([principal, "allow", *g.split(":", 2), "literal"]) for g in grants]
        version = admin._call("acl_add", {"acls": [e.to_list() for e in entries]})["acl_version"]
    finally:
        admin.close()
    _brokers_at(cluster, version)


def _brokers_at(cluster, version: int) -> None:
    """Until every broker enforces ACLs and quotas of `version` or later."""
    from kera.net.rpc import call
    for broker in cluster.brokers:
        wait_for(lambda: call(broker.address, "stats", key_file=cluster.key_file)[0]["stats"][
            "acl_version"] >= version, what=f"{broker.name} to enforce ACL version {version}")


def _set_quota(cluster, principal: str, produce_bytes_per_s: int) -> None:
    admin = cluster.admin()
    try:
        admin.set_quota(principal, produce_bytes_per_s)
        version = admin._call("acl_list")["acl_version"]
    finally:
        admin.close()
    _brokers_at(cluster, version)


def _produce_error(conf: dict, topic: str) -> KafkaError | None:
    """The delivery error of one record produced with `conf` (None: delivered)."""
    errors: list = []
    producer = Producer({**conf, "message.timeout.ms": int(REFUSAL_WAIT_S * 1000)})
    producer.produce(topic, b"v", on_delivery=lambda err, msg: errors.append(err))
    producer.flush(REFUSAL_WAIT_S + 5)
    return errors[0] if errors else KafkaError(KafkaError._TIMED_OUT)


def _login_error(conf: dict) -> KafkaError:
    """The error librdkafka reports (error_cb) for a client that cannot log in."""
    seen: list = []
    admin = AdminClient({**conf, "error_cb": seen.append})
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while time.monotonic() < deadline:
        auth = [e for e in seen if e.code() == KafkaError._AUTHENTICATION]
        if auth:
            return auth[0]
        try:
            admin.list_topics(topic=PROBE, timeout=1)
        except KafkaException:
            pass
        admin.poll(0.2)
    raise AssertionError(f"no authentication error reported; errors: {seen}")


def test_no_credentials_is_refused(secure_cluster):
    conf = _config(secure_cluster)
    for key in ("sasl.username", "sasl.password", "sasl.mechanism"):
        conf.pop(key)
    conf["security.protocol"] = "SSL"   # TLS, but no SASL login
    admin = AdminClient(conf)
    with pytest.raises(KafkaException):
        admin.list_topics(topic=PROBE, timeout=5)


def test_plaintext_to_the_port_gets_nothing(secure_cluster):
    """A plaintext Kafka request to the port: no answer (TLS only), the connection closed."""
    host, port = secure_cluster.kafka_addresses[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack(">ihhi", 10, 18, 0, 1) + b"\0\0")   # ApiVersions v0
        s.settimeout(5)
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
    assert data == b"" or data[:1] == b"\x15", data   # closed, or a TLS alert


def test_a_request_before_login_closes_the_connection(secure_cluster):
    """TLS but no SASL: ApiVersions is answered, Metadata closes the connection."""
    host, port = secure_cluster.kafka_addresses[0].rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=secure_cluster.kafka_properties["ssl.ca.location"])
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as s:
        s.sendall(struct.pack(">ihhi", 10, 18, 0, 1) + b"\xff\xff")   # ApiVersions v0
        size = struct.unpack(">i", _recv_exactly(s, 4))[0]
        assert struct.unpack(">i", _recv_exactly(s, size)[:4])[0] == 1
        s.sendall(struct.pack(">ihhi", 14, 3, 1, 2) + b"\xff\xff" + b"\xff\xff\xff\xff")
        assert s.recv(4096) == b""


def _recv_exactly(s, n: int) -> bytes:
    out = b""
    while len(out) < n:
        more = s.recv(n - len(out))
        assert more, "closed"
        out += more
    return out


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_a_wrong_password_is_refused(secure_cluster, mechanism):
    err = _login_error(_config(secure_cluster, **{"sasl.password": "not-the-password",
                                                  "sasl.mechanism": mechanism}))
    assert err.code() == KafkaError._AUTHENTICATION, err
    assert "wrong user name or password" in err.str() or "Authentication" in err.str(), err


def test_a_user_without_grants_gets_topic_authorization_failed(secure_cluster):
    topic = "secure-no-grant"
    err = _produce_error(_config(secure_cluster, **{"allow.auto.create.topics": True}), topic)
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err


def test_with_credentials_and_grants_it_produces_and_consumes(secure_cluster):
    topic, group = "secure-orders", "secure-billing"
    _grant(secure_cluster, KAFKA_USER, f"create:stream:{topic}", f"write:stream:{topic}",
           f"read:stream:{topic}", f"read:group:{group}")
    for mechanism in ("SCRAM-SHA-256", "PLAIN"):
        conf = _config(secure_cluster, **{"sasl.mechanism": mechanism})
        producer = Producer({**conf, "enable.idempotence": True,
                             "message.timeout.ms": WAIT_S * 1000})
        errors: list = []
        for i in range(100):
            producer.produce(topic, b"%s-%d" % (mechanism.encode(), i),
                             on_delivery=lambda err, msg: errors.append(err))
        assert producer.flush(WAIT_S) == 0
        assert errors == [None] * 100, errors[:3]
    consumer = Consumer(_config(secure_cluster, **{"group.id": group,
                                                   "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe([topic])
        got = consume_confluent(consumer, 200)
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    assert sorted(m.value() for m in got) == sorted(
        b"%s-%d" % (m, i) for m in (b"SCRAM-SHA-256", b"PLAIN") for i in range(100))


def test_a_group_without_grants_gets_group_authorization_failed(secure_cluster):
    topic = "secure-orders-2"
    _grant(secure_cluster, KAFKA_USER, f"create:stream:{topic}", f"write:stream:{topic}",
           f"read:stream:{topic}")
    assert _produce_error(_config(secure_cluster), topic) is None
    consumer = Consumer(_config(secure_cluster, **{"group.id": "secure-no-group-grant",
                                                   "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + REFUSAL_WAIT_S
        error = None
        while error is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is not None:
                error = msg.error()
    finally:
        consumer.close()
    assert error is not None and error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, error


def test_a_removed_user_is_refused_at_its_next_request(secure_cluster):
    kafka_users.set_user(secure_cluster.keys.dir, "temp-user", "temp-password", "admin")
    conf = _config(secure_cluster, **{"sasl.username": "temp-user",
                                      "sasl.password": "temp-password"})
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while True:   # brokers look at the users file once a second: until they know the user
        admin = AdminClient(conf)
        try:
            assert admin.list_topics(topic=PROBE, timeout=2).brokers
            break
        except KafkaException:
            assert time.monotonic() < deadline, "the new user was never let in"
    kafka_users.set_user(secure_cluster.keys.dir, "temp-user", None)
    deadline = time.monotonic() + REFUSAL_WAIT_S
    refused = False
    while not refused and time.monotonic() < deadline:
        try:
            admin.list_topics(topic=PROBE, timeout=2)
        except KafkaException:
            refused = True
    assert refused


def test_large_batches_cross_tls_both_ways(secure_cluster):
    """Requests and answers of many TLS records each (a 1 MiB batch is 64 of them)."""
    topic, group = "secure-large", "secure-large-group"
    _grant(secure_cluster, KAFKA_USER, f"create:stream:{topic}", f"write:stream:{topic}",
           f"read:stream:{topic}", f"read:group:{group}")
    values = [bytes([i]) * LARGE_RECORD_BYTES for i in range(LARGE_RECORDS)]
    producer = Producer(_config(secure_cluster, **{"message.max.bytes": 2 * LARGE_RECORD_BYTES,
                                                   "message.timeout.ms": WAIT_S * 1000}))
    errors: list = []
    for v in values:
        producer.produce(topic, v, on_delivery=lambda err, msg: errors.append(err))
    assert producer.flush(WAIT_S) == 0 and errors == [None] * LARGE_RECORDS, errors[:3]
    consumer = Consumer(_config(secure_cluster, **{"group.id": group,
                                                   "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe([topic])
        got = consume_confluent(consumer, LARGE_RECORDS)
    finally:
        consumer.close()
    assert [m.value() for m in got] == values


def test_a_connection_that_never_logs_in_is_closed(secure_cluster):
    host, port = secure_cluster.kafka_addresses[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.settimeout(LOGIN_TIMEOUT_S + 5)
        started = time.monotonic()
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < LOGIN_TIMEOUT_S + 4


def test_a_user_over_its_quota_is_told_to_wait(secure_cluster):
    """kera's produce quota, met by a Kafka client: served, with a throttle time to honour."""
    topic = "secure-quota"
    _grant(secure_cluster, KAFKA_USER, f"create:stream:{topic}", f"write:stream:{topic}")
    throttles: list = []
    _set_quota(secure_cluster, KAFKA_USER, QUOTA_BYTES_PER_S)
    try:
        producer = Producer(_config(secure_cluster, **{
            "throttle_cb": lambda event: throttles.append(event.throttle_time),
            "linger.ms": 0, "message.timeout.ms": WAIT_S * 1000}))
        for _ in range(8):   # 8 requests of one 8 KiB record: ~6x the 1 s burst
            producer.produce(topic, b"q" * QUOTA_BYTES_PER_S)
            producer.flush(WAIT_S)
        producer.poll(1.0)
    finally:
        _set_quota(secure_cluster, KAFKA_USER, 0)
    assert any(t > 0 for t in throttles), throttles


def test_kafka_python_produces_and_consumes(secure_cluster):
    kafka = pytest.importorskip("kafka")
    topic = "secure-kafka-python"
    _grant(secure_cluster, KAFKA_USER, f"create:stream:{topic}", f"write:stream:{topic}",
           f"read:stream:{topic}")
    props = secure_cluster.kafka_properties
    common = dict(bootstrap_servers=props["bootstrap.servers"], security_protocol="SASL_SSL",
                  sasl_mechanism="SCRAM-SHA-256", sasl_plain_username=props["sasl.username"],
                  sasl_plain_password=props["sasl.password"], ssl_cafile=props["ssl.ca.location"],
                  request_timeout_ms=CLIENT_TIMEOUT_MS)
    producer = kafka.KafkaProducer(**common, acks="all")
    try:
        for i in range(10):
            producer.send(topic, b"kp-%d" % i)
        producer.flush(WAIT_S)
    finally:
        producer.close()
    consumer = kafka.KafkaConsumer(topic, **common, auto_offset_reset="earliest",
                                   consumer_timeout_ms=int(WAIT_S * 1000))
    try:
        got = []
        for msg in consumer:
            got.append(msg.value)
            if len(got) == 10:
                break
    finally:
        consumer.close()
    assert sorted(got) == sorted(b"kp-%d" % i for i in range(10))


def test_no_plaintext_kafka_port_is_open(secure_cluster):
    """Every Kafka port of the secure cluster speaks TLS: a TLS handshake that trusts the
    cluster's CA succeeds on each."""
    ctx = ssl.create_default_context(cafile=secure_cluster.kafka_properties["ssl.ca.location"])
    for address in secure_cluster.kafka_addresses:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            assert s.version() in ("TLSv1.2", "TLSv1.3")


def test_transactions_need_write_on_the_transactional_id(secure_cluster):
    topic, tid = "secure-txn", "secure-txn-id"
    _grant(secure_cluster, KAFKA_USER, f"create:stream:{topic}", f"write:stream:{topic}",
           f"read:stream:{topic}", f"read:group:{topic}-r")
    assert _produce_error(_config(secure_cluster), topic) is None     # creates the topic
    conf = _config(secure_cluster, **{"transactional.id": tid,
                                      "transaction.timeout.ms": 2 * CLIENT_TIMEOUT_MS})
    with pytest.raises(KafkaException) as refused:
        Producer(conf).init_transactions(REFUSAL_WAIT_S)
    assert refused.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    _grant(secure_cluster, KAFKA_USER, f"write:transactional_id:{tid}")
    producer = Producer(conf)
    producer.init_transactions(WAIT_S)
    producer.begin_transaction()
    producer.produce(topic, b"in-a-transaction")
    producer.commit_transaction(WAIT_S)
    consumer = Consumer(_config(secure_cluster, **{"group.id": f"{topic}-r",
                                                   "auto.offset.reset": "earliest",
                                                   "isolation.level": "read_committed"}))
    try:
        consumer.subscribe([topic])
        got = consume_confluent(consumer, 2)
    finally:
        consumer.close()
    assert sorted(m.value() for m in got) == [b"in-a-transaction", b"v"]
