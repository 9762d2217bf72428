"""confluent-kafka configuration dicts mapped to kera's keyword arguments
(kera.client.kafka_config)."""

import pytest

from kera.client.kafka_config import CONSUMER_PROPERTIES, PRODUCER_PROPERTIES, kera_arguments
from kera.errors import BadRequest


def producer_args(bootstrap="h:1", linger_ms=5.0, compression=None):
    """A stand-in with the Producer's defaults for the 'given' check."""


def test_producer_properties_map_to_kera_arguments_with_their_units():
    args = kera_arguments({"bootstrap.servers": "h:1", "linger.ms": 20, "batch.size": 65536,
                           "compression.type": "zstd", "request.timeout.ms": 3000,
                           "acks": "all", "enable.idempotence": True, "client.id": "svc",
                           "partitioner": "murmur2_random"},
                          PRODUCER_PROPERTIES, producer_args, {})
    assert args == {"bootstrap": "h:1", "linger_ms": 20.0, "chunk_size_bytes": 65536,
                    "compression": "zstd", "request_timeout_s": 3.0, "partitioner": "murmur2"}


def test_consumer_properties_and_auto_commit_off():
    args = kera_arguments({"bootstrap.servers": "h:1", "group.id": "g",
                           "auto.offset.reset": "smallest", "enable.auto.commit": "false"},
                          CONSUMER_PROPERTIES, producer_args, {})
    assert args == {"bootstrap": "h:1", "group": "g", "start": "earliest",
                    "auto_commit_interval_ms": None}


@pytest.mark.parametrize("config, given, message", [
    ({"bootstrap.servers": "h:1", "sasl.mechanism": "PLAIN"}, {}, "unknown Kafka properties"),
    ({"bootstrap.servers": "h:1", "acks": "1"}, {}, "always behaves as 'all'"),
    ({"bootstrap.servers": "h:1", "compression.type": "gzip"}, {}, "lz4 or zstd"),
    ({"linger.ms": 5}, {}, "bootstrap.servers"),
    ({"bootstrap.servers": "h:1", "linger.ms": "soon"}, {}, "not a valid value"),
    ({"bootstrap.servers": "h:1"}, {"linger_ms": 50.0}, "not both"),
])
def test_what_kera_cannot_honour_is_refused_by_name(config, given, message):
    with pytest.raises(BadRequest, match=message):
        kera_arguments(config, PRODUCER_PROPERTIES, producer_args, given)
