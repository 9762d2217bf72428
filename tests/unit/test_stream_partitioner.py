"""A stream's default partitioner (issue 36 item 13), without sockets: the setting's validation
and persistence in the coordinator, its place in the stream descriptor (absent: crc32c), and
the producer's key placement by it unless the producer names a partitioner."""

import pytest
from crc32c import crc32c

from kera.codec import chunk, schema
from kera.codec.partitioner import murmur2
from kera.codec.wire import Fields
from kera.coordinator.core import Coordinator
from kera.coordinator.validate import StreamSpec
from kera.errors import BadRequest
from kera.producer.accumulator import Accumulator
from kera.producer.pipeline import Pipeline

KEYS = [f"user-{i}".encode() for i in range(40)]


def coordinator():
    c = Coordinator(0.0)
    c.register(0.0, "broker", "127.0.0.1:1", "n")
    return c


def test_spec_validates_the_partitioner():
    assert StreamSpec("s").partitioner == "crc32c"
    assert StreamSpec("s", partitioner="murmur2").partitioner == "murmur2"
    for bad in ("murmur3", "", 7, None):
        with pytest.raises(BadRequest, match="partitioner"):
            StreamSpec("s", partitioner=bad)


def test_coordinator_creates_describes_and_persists_it():
    c = coordinator()
    assert c.handle("create_stream", {"name": "plain"}, 0.0)["stream"]["partitioner"] == "crc32c"
    d = c.handle("create_stream", {"name": "k", "partitioner": "murmur2"}, 0.0)["stream"]
    assert d["partitioner"] == "murmur2"
    with pytest.raises(BadRequest, match="murmur2"):
        c.handle("create_stream", {"name": "x", "partitioner": "fnv"}, 0.0)
    assert Coordinator(0.0, state=c.to_state()).describe_stream("k")["partitioner"] == "murmur2"
    old = c.to_state()                          # written before the setting existed
    for s in old["streams"]:
        s.pop("partitioner")
    assert Coordinator(0.0, state=old).describe_stream("k")["partitioner"] == "crc32c"


def descriptor(**extra):
    return {"name": "s", "id": 9, "streamlets": 7, "active_groups": 1, "replication": 1,
            "placement": [1] * 7, "brokers": {"1": "127.0.0.1:5"}, "version": 1, **extra}


def test_descriptor_without_the_field_means_crc32c():
    assert schema.stream_descriptor(descriptor()).partitioner == "crc32c"
    assert schema.stream_descriptor(descriptor(partitioner="murmur2")).partitioner == "murmur2"
    with pytest.raises(BadRequest, match="upgrade this client"):
        schema.stream_descriptor(descriptor(partitioner="fnv"))


def placed(stream_partitioner, key_hash=None):
    """{key: streamlet} as an Accumulator places KEYS on a stream of 7 streamlets."""
    pipe = Pipeline(request_size_bytes=1 << 20, in_flight_per_broker=4, retries_max=5,
                    request_timeout_s=1.0)
    acc = Accumulator(pipe, 1, chunk_size_bytes=1024, max_record_bytes=512, linger_s=1.0,
                      key_hash=key_hash)
    st = acc.stream_state(schema.stream_descriptor(descriptor(partitioner=stream_partitioner)))
    for key in KEYS:
        acc.append(st, b"v", key, 1)
    acc.seal_all()
    return {k: sl for (_, sl), lane in pipe.lanes.items() for c in lane.chunks
            for k in chunk.Chunk(c.data).keys()}


def test_producer_places_keys_by_the_stream_default_and_an_explicit_one_wins():
    by_murmur2 = {k: (murmur2(k) & 0x7FFFFFFF) % 7 for k in KEYS}
    by_crc32c = {k: crc32c(k) % 7 for k in KEYS}
    assert by_murmur2 != by_crc32c
    assert placed("murmur2") == by_murmur2
    assert placed("crc32c") == by_crc32c
    assert placed("murmur2", key_hash=crc32c) == by_crc32c


def test_a_topic_created_through_kafka_defaults_to_murmur2():
    from types import SimpleNamespace

    from kera.broker.kafka import topics
    asked = []
    calls = SimpleNamespace(call=lambda op, fields, reply: asked.append((op, fields)))
    ctx = SimpleNamespace(catalog=SimpleNamespace(calls=calls, forget=lambda: None))
    topics.create_topic(ctx, "t", 3, 1, lambda code, message: None)
    [(op, fields)] = asked
    assert op == "create_stream" and StreamSpec.from_fields(Fields(fields)).partitioner == "murmur2"


def test_the_spark_sink_leaves_the_choice_to_the_stream_unless_told():
    from kera.spark.options import Options
    assert Options.parse({"bootstrap": "h:1"}).partitioner is None   # the stream's own
    assert Options.parse({"bootstrap": "h:1", "partitioner": "murmur2"}).partitioner == "murmur2"
