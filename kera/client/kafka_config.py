"""A confluent-kafka configuration dict in place of a bootstrap address: `Producer({...})`,
`Consumer({...}, "stream")`, so code written against confluent-kafka moves over with its
configuration as it is.

Each Kafka property that has a kera meaning is mapped to the keyword argument that carries it
(units converted: Kafka's milliseconds to kera's seconds where kera counts seconds). Properties
kera has no use for because it always behaves that way (acks=all, idempotence, client.id) are
accepted; any other property is refused by name, with the ones that are understood, rather
than silently ignored.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from kera.errors import BadRequest


def _text(value) -> str:
    return str(value)


def _count(value) -> int:
    return int(value)


def _seconds(value) -> float:
    return int(value) / 1000


def _number(value) -> float:
    return float(value)


def _compression(value) -> str | None:
    name = str(value).lower()
    if name in ("none", ""):
        return None
    if name not in ("lz4", "zstd"):
        raise BadRequest(f"compression.type={value!r}: kera's producer compresses with lz4 or "
                         f"zstd (a Kafka client through the Kafka listener may use any codec)")
    return name


def _partitioner(value) -> str:
    name = str(value)
    if name in ("murmur2", "murmur2_random"):
        return "murmur2"
    if name in ("crc32c",):
        return name
    raise BadRequest(f"partitioner={value!r}: use murmur2_random (Kafka's Java client's "
                     f"placement) or crc32c (kera's)")


def _start(value) -> str:
    name = {"smallest": "earliest", "beginning": "earliest", "largest": "latest",
            "end": "latest"}.get(str(value), str(value))
    if name not in ("earliest", "latest"):
        raise BadRequest(f"auto.offset.reset={value!r}: use earliest or latest")
    return name


def _isolation(value) -> str:
    name = str(value)
    if name not in ("read_committed", "read_uncommitted"):
        raise BadRequest(f"isolation.level={value!r}: use read_committed or read_uncommitted")
    return name


def _always(*allowed) -> Callable[[Any], None]:
    """A property kera accepts only with the value it always behaves by."""
    def check(value) -> None:
        if str(value).lower() not in allowed:
            raise BadRequest(f"kera always behaves as {allowed[0]!r} here, not {value!r}")
    return check


def _ignored(value) -> None:
    return None


# Kafka property -> (kera keyword, converter); a None keyword: accepted, nothing to set.
PRODUCER_PROPERTIES: dict[str, tuple[str | None, Callable]] = {
    "bootstrap.servers": ("bootstrap", _text),
    "linger.ms": ("linger_ms", _number),
    "queue.buffering.max.ms": ("linger_ms", _number),
    "batch.size": ("chunk_size_bytes", _count),
    "compression.type": ("compression", _compression),
    "compression.codec": ("compression", _compression),
    "buffer.memory": ("buffer_bytes", _count),
    "message.max.bytes": ("max_record_bytes", _count),
    "max.in.flight.requests.per.connection": ("in_flight_per_broker", _count),
    "max.in.flight": ("in_flight_per_broker", _count),
    "request.timeout.ms": ("request_timeout_s", _seconds),
    "max.block.ms": ("send_timeout_s", _seconds),
    "retries": ("retries_max", _count),
    "metadata.max.age.ms": ("metadata_max_age_ms", _count),
    "partitioner": ("partitioner", _partitioner),
    "transactional.id": ("transactional_id", _text),
    "transaction.timeout.ms": ("transaction_timeout_ms", _count),
    "acks": (None, _always("all", "-1")),
    "enable.idempotence": (None, _always("true", "1")),
    "client.id": (None, _ignored),
}

CONSUMER_PROPERTIES: dict[str, tuple[str | None, Callable]] = {
    "bootstrap.servers": ("bootstrap", _text),
    "group.id": ("group", _text),
    "group.instance.id": ("group_instance_id", _text),
    "auto.offset.reset": ("start", _start),
    "session.timeout.ms": ("session_timeout_ms", _count),
    "auto.commit.interval.ms": ("auto_commit_interval_ms", _count),
    "fetch.max.bytes": ("fetch_max_bytes", _count),
    "fetch.wait.max.ms": ("fetch_max_wait_ms", _count),
    "fetch.max.wait.ms": ("fetch_max_wait_ms", _count),
    "metadata.max.age.ms": ("metadata_max_age_ms", _count),
    "isolation.level": ("isolation_level", _isolation),
    "enable.auto.commit": (None, _ignored),   # read in kera_arguments
    "client.id": (None, _ignored),
}


def kera_arguments(config: Mapping, properties: dict, function: Callable,
                   given: Mapping) -> dict:
    """The keyword arguments of `function` that `config` (Kafka properties) stands for.
    `given`: the arguments the call received beside it (a Kafka config is not mixed with
    kera's own keywords: say so rather than choose)."""
    mixed = _explicit(function, given)
    if mixed:
        raise BadRequest(f"give either a Kafka configuration dict or kera's keyword arguments, "
                         f"not both ({', '.join(mixed)} beside the dict)")
    unknown = sorted(set(config) - set(properties))
    if unknown:
        raise BadRequest(f"unknown Kafka properties {unknown}: kera understands "
                         f"{', '.join(sorted(properties))}")
    out: dict = {}
    for name, value in config.items():
        keyword, convert = properties[name]
        try:
            converted = convert(value)
        except (TypeError, ValueError):
            raise BadRequest(f"{name}={value!r} is not a valid value") from None
        if keyword is not None:
            out[keyword] = converted
    if str(config.get("enable.auto.commit", "true")).lower() in ("false", "0"):
        out["auto_commit_interval_ms"] = None
    if "bootstrap" not in out:
        raise BadRequest("the configuration dict needs 'bootstrap.servers' (the coordinator's "
                         "host:port)")
    return out


def _explicit(function: Callable, given: Mapping) -> list[str]:
    """Names in `given` whose value is not the function's default."""
    params = inspect.signature(function).parameters
    return sorted(name for name, value in given.items()
                  if name in params and params[name].default is not inspect.Parameter.empty
                  and value is not params[name].default and value != params[name].default)
