"""Kafka requests and responses as bytes: decoded and encoded with kio (generated from Kafka's
own message schemas), responses built from plain dicts whatever the version.

A handler describes a response once, as a dict holding the union of the fields of every
version it answers; `response()` keeps the fields the negotiated version has and gives the
others their schema default, so one handler serves v0 to v12 without a branch per version.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import struct
import typing

from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer
from kio.serial.errors import SerialError

from kera.errors import BadRequest

_KEY_VERSION = struct.Struct(">hh")
_SIZE = struct.Struct(">i")
API_VERSIONS_KEY = 18


class UnsupportedVersion(BadRequest):
    """A request of an (api key, version) this listener does not decode."""


@dataclasses.dataclass(frozen=True, slots=True)
class KafkaRequest:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: object          # the kio request entity


def peek_key_version(frame) -> tuple[int, int, int]:
    """(api_key, api_version, correlation_id) of a request frame (size prefix removed)."""
    if len(frame) < 8:
        raise BadRequest(f"a {len(frame)}-byte request is shorter than its 8-byte header")
    key, version = _KEY_VERSION.unpack_from(frame, 0)
    return key, version, _SIZE.unpack_from(frame, 4)[0]


def decode_request(frame: bytes, supported) -> KafkaRequest:
    """Decode one request frame; UnsupportedVersion for an API or version not in
    `supported(key, version)`, BadRequest for bytes that do not parse."""
    key, version, correlation_id = peek_key_version(frame)
    if not supported(key, version):
        raise UnsupportedVersion(f"api key {key} version {version} is not supported")
    cls = load_request_schema(key, version)
    try:
        header, at = _reader(cls.__header_schema__)(frame, 0)
        body, used = _reader(cls)(frame, at)
    except (SerialError, ValueError, UnicodeDecodeError, OverflowError, KeyError, IndexError,
            TypeError, struct.error) as exc:   # kio's ways of saying the bytes are not a request
        raise BadRequest(f"api key {key} v{version}: malformed request: {exc}") from None
    # Bytes after the body are ignored, as Kafka's own request parsing ignores them: librdkafka
    # sends three more on its all-topics Metadata v12 (confluent-kafka's list_topics()).
    return KafkaRequest(key, version, correlation_id, header.client_id, body)


@functools.cache
def _reader(cls):
    return entity_reader(cls)


def response(key: int, version: int, data: dict):
    """The kio response entity of (key, version) built from `data` (kera.broker.kafka.messages)."""
    return build(load_response_schema(key, version), data)


def encode_response(correlation_id: int, entity) -> bytes:
    """The whole response on the wire: size prefix, the version's header, the body."""
    return b"".join(encode_parts(correlation_id, entity))


def encode_parts(correlation_id: int, entity) -> list:
    """`encode_response`'s bytes as a list of buffers to send in order: a bytes field of at
    least BY_REFERENCE_BYTES (a Fetch's records) is one of them, not copied."""
    cls = type(entity)
    buf = _Gather()
    header_cls = cls.__header_schema__
    entity_writer(header_cls)(buf, header_cls(correlation_id=correlation_id))
    entity_writer(cls)(buf, entity)
    return buf.finish()


# A bytes value written into a response from this size on is sent as it is, by reference, not
# copied into the response's buffer: a Fetch's records (megabytes). Smaller ones are copied:
# each buffer costs a little in the send's scatter list, less than copying a few KiB.
BY_REFERENCE_BYTES = 64 << 10


class _Gather:
    """A kio writable that keeps the large bytes values it is given by reference."""
    __slots__ = ("parts", "tail", "size")

    def __init__(self):
        self.parts: list = [b""]      # the size prefix, set by finish()
        self.tail = bytearray()
        self.size = 0

    def write(self, data) -> int:
        n = len(data)
        if n >= BY_REFERENCE_BYTES and type(data) is bytes:   # immutable: safe to keep
            if self.tail:
                self.parts.append(self.tail)
                self.tail = bytearray()
            self.parts.append(data)
        else:
            self.tail += data
        self.size += n
        return n

    def finish(self) -> list:
        if self.tail:
            self.parts.append(self.tail)
        self.parts[0] = _SIZE.pack(self.size)
        return self.parts


def build(cls, data: dict):
    """A kio entity of `cls` from a dict: nested entities from dicts (or lists of dicts),
    error codes from ints, durations from milliseconds; fields missing from `data` get the
    schema's default, or a zero of their type."""
    values = {}
    for f in _fields(cls):
        if f.name in data:
            values[f.name] = _value(f, data[f.name], cls)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = _zero(f, cls)
    return cls(**values)


@functools.cache
def _fields(cls) -> tuple:
    return tuple(dataclasses.fields(cls))


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _value(f, value, cls):
    kind = f.metadata.get("kafka_type", "")
    if kind == "error_code":
        return ErrorCode(int(value))
    if kind.startswith("timedelta") and isinstance(value, int):
        return datetime.timedelta(milliseconds=value)
    hint = _hints(cls)[f.name]
    if value is None and type(None) not in typing.get_args(hint):
        return _zero(f, cls)   # a field this version cannot leave null: its zero
    inner = _entity_type(hint)
    if inner is None or value is None:
        return value
    if isinstance(value, dict):
        return build(inner, value)
    return tuple(v if dataclasses.is_dataclass(v) else build(inner, v) for v in value)


def _entity_type(hint):
    """The dataclass a field holds (alone or as a tuple of them), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        found = _entity_type(arg)
        if found is not None:
            return found
    return None


def _zero(f, cls):
    kind = f.metadata.get("kafka_type", "")
    hint = _hints(cls)[f.name]
    if kind == "error_code":
        return ErrorCode.none
    if kind.startswith("timedelta"):
        return datetime.timedelta(0)
    if type(None) in typing.get_args(hint):
        return None
    if kind in ("string",):
        return ""
    if kind in ("bytes", "records"):
        return b""
    if kind == "bool":
        return False
    if typing.get_origin(hint) is tuple:
        return ()
    entity = _entity_type(hint)
    if entity is not None:
        return build(entity, {})
    return 0
