"""Wire messages: `[header, *payload]`, header a msgpack map, payload raw chunk frames.

Requests carry `v` (protocol version), `op` and `id`; replies echo `id` and carry `ok`. An error
reply carries `code`, `message` and `retriable`. Every field read from the network goes through
`Fields`, which raises BadRequest for anything missing, mistyped or out of range.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kera.errors import BadRequest, KeraError

PROTOCOL_VERSION = 1
MiB = 1024 * 1024
# A header is metadata: the largest legitimate ones are `list_streams` replies.
MAX_HEADER_BYTES = 4 * MiB
# Payload frames per message: a replication write carries at most this many chunks.
MAX_FRAMES = 8192
# zmq drops (disconnects) a peer that sends a single frame larger than this: one chunk is at
# most kera.codec.chunk.MAX_CHUNK_BYTES (64 MiB) and a header at most MAX_HEADER_BYTES.
MAX_FRAME_BYTES = 64 * MiB + MAX_HEADER_BYTES
# A whole message (all frames): a produce request or replication write of a virtual segment
# (8 MiB by default) plus one maximal chunk fits with room; checked frame by frame as the
# message is read, so a message of many large frames is dropped, not kept.
MESSAGE_BYTES_MAX = 256 * MiB
# Maps and arrays decoded from one header, all nesting levels together: what a header's
# objects cost in memory (about 64 bytes each even when empty) is bounded by this, whatever
# its 4 MiB hold. Requests to daemons are small (a heartbeat's 4096 `vsegs` entries are 8193
# arrays); replies such as `list_streams` (10,000 streams, 100,000 streamlets) need more.
REQUEST_CONTAINERS_MAX = 100_000
REPLY_CONTAINERS_MAX = 1_000_000
# Length of one string, binary, array or map in a header: names are at most 1024 characters,
# lists at most a few thousand entries; a `list_streams` reply holds up to 10,000 streams.
HEADER_STR_LEN_MAX = 64 * 1024
HEADER_BIN_LEN_MAX = MAX_HEADER_BYTES
HEADER_ARRAY_LEN_MAX = 100_000
HEADER_MAP_LEN_MAX = 100_000

_packer = msgpack.Packer(use_bin_type=True)
_LIMITS = {"raw": False, "strict_map_key": False, "max_str_len": HEADER_STR_LEN_MAX,
           "max_bin_len": HEADER_BIN_LEN_MAX, "max_array_len": HEADER_ARRAY_LEN_MAX,
           "max_map_len": HEADER_MAP_LEN_MAX, "max_ext_len": 0}


def pack(obj: dict) -> bytes:
    return _packer.pack(obj)


class _ContainerBudget:
    """msgpack hook counting the maps and arrays of one header; raises past the budget."""

    __slots__ = ("left",)

    def __init__(self, containers_max: int):
        self.left = containers_max

    def __call__(self, obj):
        self.left -= 1
        if self.left < 0:
            raise _OverBudget
        return obj


class _OverBudget(Exception):
    pass


def unpack_header(frame, containers_max: int = REPLY_CONTAINERS_MAX) -> dict:
    """Decode a header map, within the length limits above and `containers_max` maps and
    arrays in all; BadRequest for anything else."""
    if len(frame) > MAX_HEADER_BYTES:
        raise BadRequest(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        if len(frame) <= containers_max:
            # Every map and array takes at least one byte, so this frame cannot hold more
            # than its budget: skip the per-container hook, which doubled the decode time of
            # a 64-read fetch (issue 15 profile).
            obj = msgpack.unpackb(frame, **_LIMITS)
        else:
            budget = _ContainerBudget(containers_max)
            obj = msgpack.unpackb(frame, object_hook=budget, list_hook=budget, **_LIMITS)
    except _OverBudget:
        raise BadRequest(f"header holds more than {containers_max} maps and arrays") from None
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise BadRequest(f"header is not valid msgpack: {exc.__class__.__name__}") from None
    if not isinstance(obj, dict):
        raise BadRequest("header is not a map")
    return obj


_ENVELOPE = frozenset({"v", "op", "id", "ok"})


def _merge(header: dict, fields: dict | None) -> bytes:
    if fields:
        clash = _ENVELOPE.intersection(fields)
        if clash:
            raise ValueError(f"fields {sorted(clash)} would overwrite the message envelope")
        header.update(fields)
    return pack(header)


def request(op: str, req_id: int, fields: dict | None = None) -> bytes:
    return _merge({"v": PROTOCOL_VERSION, "op": op, "id": req_id}, fields)


def ok_reply(req_id: Any, fields: dict | None = None) -> bytes:
    return _merge({"v": PROTOCOL_VERSION, "id": req_id, "ok": True}, fields)


def error_reply(req_id: Any, err: KeraError) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": err.code,
                 "message": err.message, "retriable": err.retriable})


def request_id_of(header) -> int | None:
    """A request header's id; None when missing or not an integer (no reply can name it)."""
    req_id = header.get("id") if isinstance(header, dict) else None
    return req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else None


def request_envelope(header: dict, handlers: dict) -> tuple["Fields", str, Any]:
    """(fields, op, handler) of a decoded request header, checked the same way by every
    daemon's shell (and the simulation's): BadRequest for a missing or non-integer id,
    another protocol version, or an op `handlers` does not have."""
    if request_id_of(header) is None:
        raise BadRequest("missing or non-integer request id")
    fields = Fields(header)
    if fields.int("v", lo=0, hi=255) != PROTOCOL_VERSION:
        raise BadRequest(f"protocol version {header['v']} is not {PROTOCOL_VERSION}")
    op = fields.str("op", hi=64)
    handler = handlers.get(op)
    if handler is None:
        raise BadRequest(f"unknown op '{op}'")
    return fields, op, handler


def raise_for_reply(header: dict) -> dict:
    """Return the reply header, or raise the KeraError it carries (kera.codec.schema.error_reply)."""
    if header.get("ok") is True:
        return header
    from kera.codec import schema  # schema builds on this module
    raise schema.error_reply(header)


class Fields:
    """Typed access to a decoded header; every accessor raises BadRequest when off."""

    __slots__ = ("h",)

    def __init__(self, header: dict):
        self.h = header

    def get(self, name: str, kind, default: Any = ..., *, lo: int | None = None,
            hi: int | None = None):
        if name not in self.h:
            if default is ...:
                raise BadRequest(f"missing field '{name}'")
            return default
        value = self.h[name]
        if kind is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadRequest(f"field '{name}' must be an integer")
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise BadRequest(f"field '{name}'={value} is outside [{lo}, {hi}]")
        elif kind is str:
            if not isinstance(value, str) or (hi is not None and len(value) > hi):
                raise BadRequest(f"field '{name}' must be a string" + (f" of at most {hi} characters" if hi else ""))
        elif not isinstance(value, kind):
            raise BadRequest(f"field '{name}' must be {getattr(kind, '__name__', kind)}")
        return value

    def int(self, name: str, default: Any = ..., lo: int | None = 0, hi: int | None = 2**64 - 1):
        return self.get(name, int, default, lo=lo, hi=hi)

    def str(self, name: str, default: Any = ..., hi: int = 1024):
        return self.get(name, str, default, hi=hi)

    def bool(self, name: str, default: Any = ...):
        return self.get(name, bool, default)

    def list(self, name: str, default: Any = ..., max_len: int = MAX_FRAMES):
        value = self.get(name, list, default)
        if value is not None and len(value) > max_len:
            raise BadRequest(f"field '{name}' has {len(value)} entries, more than {max_len}")
        return value

    def dict(self, name: str, default: Any = ...):
        return self.get(name, dict, default)


def int_list(value, name: str, length: int | None = None, lo: int = 0, hi: int = 2**64 - 1) -> list[int]:
    """Validate a list of ints taken from a header."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise BadRequest(f"'{name}' must be a list" + (f" of {length} integers" if length is not None else ""))
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or not lo <= item <= hi:
            raise BadRequest(f"'{name}' holds {item!r}, not an integer in [{lo}, {hi}]")
    return value
