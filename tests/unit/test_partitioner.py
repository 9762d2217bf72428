"""Key placement (kera.codec.partitioner): crc32c, and Kafka's murmur2 exactly as Kafka's Java
client computes it, so kera's and Kafka's producers put a key in the same streamlet."""

import ctypes
import random

import numpy as np
import pyarrow as pa
import pytest

from kera.codec.partitioner import key_hash, murmur2, streamlets_for_keys
from kera.errors import BadRequest
from kera.spark.hashing import streamlets_of_keys

# Kafka's UtilsTest.testMurmur2: the Java client's values (signed 32-bit ints).
KAFKA_VECTORS = {
    "21": -973932308, "foobar": -790332482, "a-little-bit-long-string": -985981536,
    "a-little-bit-longer-string": -1486304829,
    "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971, "abc": 479470107,
}


@pytest.mark.parametrize("text", sorted(KAFKA_VECTORS))
def test_murmur2_is_the_java_clients(text):
    assert ctypes.c_int32(murmur2(text.encode())).value == KAFKA_VECTORS[text]


def test_murmur2_matches_kafka_python_on_every_tail_length():
    from kafka.partitioner.default import murmur2 as kafka_python_murmur2
    rng = random.Random(7)
    for n in range(64):
        data = rng.randbytes(n)
        assert murmur2(data) == kafka_python_murmur2(data) & 0xFFFFFFFF


@pytest.mark.parametrize("partitioner", ["crc32c", "murmur2"])
def test_spark_places_keys_as_the_producer_does(partitioner):
    keys = [b"k%d" % i for i in range(300)] + [None]
    expected = streamlets_for_keys(keys, 7, key_hash(partitioner))
    got = streamlets_of_keys(pa.array(keys, pa.binary()), 7, partitioner)
    assert np.array_equal(got, expected)


def test_an_unknown_partitioner_is_refused_naming_the_choices():
    with pytest.raises(BadRequest, match="murmur2"):
        key_hash("random")
