"""The Kafka listener's sans-IO pieces: framing bounds, version-agnostic responses, and Kafka's
idempotent-sequence rule in the broker's producer table."""

import struct

import pytest
from kio.schema.errors import ErrorCode

from kera.broker.kafka import apis
from kera.broker.kafka.connection import Framer
from kera.broker.kafka.messages import (UnsupportedVersion, decode_request, encode_response,
                                        response)
from kera.broker.kafka.produce import kera_producer_id
from kera.broker.producers import APPEND, DUPLICATE, GAP, Entry, classify_kafka


def test_framer_cuts_whole_frames_across_reads():
    f = Framer()
    data = struct.pack(">i", 3) + b"abc" + struct.pack(">i", 2) + b"de"
    assert f.feed(data[:5]) == []
    assert f.feed(data[5:9]) == [b"abc"]
    assert f.feed(data[9:]) == [b"de"]


@pytest.mark.parametrize("size", [-1, 2**31 - 1])
def test_framer_refuses_a_bad_length_before_reading_it(size):
    f = Framer(request_bytes_max=1 << 20)
    with pytest.raises(ValueError, match="request of"):
        f.feed(struct.pack(">i", size) + b"x")


def test_one_description_serves_every_version():
    data = {"brokers": [{"node_id": 1, "host": "h", "port": 9}], "cluster_id": "c",
            "controller_id": 1, "topics": [{"name": "t", "error_code": 0, "partitions": [
                {"partition_index": 0, "leader_id": 1, "leader_epoch": -1,
                 "replica_nodes": [1], "isr_nodes": [1]}]}]}
    for version in (0, 1, 5, 9, 12):
        entity = response(3, version, data)
        wire = encode_response(7, entity)
        assert struct.unpack_from(">ii", wire) [1] == 7
        assert entity.topics[0].partitions[0].leader_id == 1


def test_a_null_in_a_field_the_version_cannot_hold_becomes_its_zero():
    entity = response(11, 2, {"error_code": ErrorCode.member_id_required, "protocol_name": None,
                              "leader": "", "member_id": "m", "members": []})
    assert entity.protocol_name == ""
    assert encode_response(1, entity)


def test_unsupported_versions_are_refused_by_name():
    frame = struct.pack(">hhih", 0, 2, 1, -1)          # Produce v2: an old message format
    with pytest.raises(UnsupportedVersion):
        decode_request(frame, apis.supported)


def test_advertised_produce_starts_at_zero_but_decodes_from_three():
    produce = next(r for r in apis.advertised() if r["api_key"] == 0)
    assert produce["min_version"] == 0
    assert not apis.supported(0, 2) and apis.supported(0, 3)


def test_kafka_sequences_count_records():
    entry = Entry(sequence=10, group=0, segment=0, base_offset=100, end_offset=105)
    assert classify_kafka(entry, 15) == APPEND          # the next batch starts after 5 records
    assert classify_kafka(entry, 10) == DUPLICATE       # a retry of the last batch
    assert classify_kafka(entry, 3) == DUPLICATE
    assert classify_kafka(entry, 16) == GAP
    assert classify_kafka(None, 42) == APPEND           # a new producer id or epoch


def test_epochs_are_distinct_kera_producers_and_no_id_is_anonymous():
    assert kera_producer_id(5, 0) != kera_producer_id(5, 1)
    assert kera_producer_id(-1, -1) == 0


def test_librdkafkas_all_topics_metadata_v12_decodes_despite_its_trailing_bytes():
    # The frame confluent-kafka's AdminClient.list_topics() sends (size prefix removed).
    frame = bytes.fromhex("0003000c00000006000772646b61666b610000000000010000")
    request = decode_request(frame, apis.supported)
    assert (request.api_key, request.api_version, request.correlation_id) == (3, 12, 6)
    assert request.client_id == "rdkafka" and request.body.topics is None
