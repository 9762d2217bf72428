"""Which streamlet a keyed record goes to: a hash of the key modulo the streamlet count.

Two hashes, both stable across processes, machines and Python versions (never Python's salted
`hash`), so a key always lands in the same streamlet and its records stay in order:

- `crc32c` (kera's default): CRC32C of the key, fast (a C library) and vectorised for Spark.
- `murmur2`: Kafka's default partitioner (the Java client, kafka-python, librdkafka's
  `murmur2_random`): the positive half of Kafka's murmur2 of the key. A keyed stream written by
  Kafka clients through the Kafka listener and by kera's clients puts a key in one streamlet
  when kera's side uses it too.

A stream has a default partitioner (its `partitioner` setting, chosen at creation: crc32c unless
asked, murmur2 for a topic created through the Kafka listener); a client given none uses it, an
explicit one wins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from crc32c import crc32c

from kera.errors import BadRequest

if TYPE_CHECKING:
    import numpy as np

KeyHash = Callable[[bytes], int]

_MURMUR2_SEED = 0x9747B28C   # Kafka's org.apache.kafka.common.utils.Utils.murmur2
_MURMUR2_M = 0x5BD1E995
_MURMUR2_R = 24
_U32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 of `data`, as an unsigned 32-bit int (Java's int, reinterpreted)."""
    length = len(data)
    h = (_MURMUR2_SEED ^ length) & _U32
    whole = length & ~3
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _MURMUR2_M) & _U32
        k ^= k >> _MURMUR2_R
        h = ((h * _MURMUR2_M) & _U32) ^ ((k * _MURMUR2_M) & _U32)
    tail = length - whole
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h = ((h ^ data[whole]) * _MURMUR2_M) & _U32
    h ^= h >> 13
    h = (h * _MURMUR2_M) & _U32
    return h ^ (h >> 15)


def _kafka_murmur2(key: bytes) -> int:
    return murmur2(key) & 0x7FFFFFFF   # Kafka's Utils.toPositive


PARTITIONERS: dict[str, KeyHash] = {"crc32c": crc32c, "murmur2": _kafka_murmur2}
DEFAULT_PARTITIONER = "crc32c"
PARTITIONER_CHARS_MAX = 16   # the longest name above, with room for another


def key_hash(partitioner: str) -> KeyHash:
    """The key hash of a partitioner name; BadRequest naming the choices otherwise."""
    found = PARTITIONERS.get(partitioner)
    if found is None:
        raise BadRequest(f"partitioner={partitioner!r}: use one of {sorted(PARTITIONERS)} "
                         f"('murmur2' places keys as Kafka's clients do)")
    return found


def streamlet_for_key(key: bytes, streamlets: int, hash_of: KeyHash = crc32c) -> int:
    return hash_of(key) % streamlets


def streamlets_for_keys(keys: Sequence[bytes | None], streamlets: int,
                        hash_of: KeyHash = crc32c) -> np.ndarray:
    """int64 streamlet per key; -1 for a None key (the caller places keyless records)."""
    import numpy as np   # here: the stream descriptor (kera.codec.schema) needs only the names
    return np.fromiter((-1 if k is None else hash_of(k) % streamlets for k in keys),
                       dtype=np.int64, count=len(keys))
