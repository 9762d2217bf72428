"""Validation of coordinator request fields: names, addresses and stream parameters.

Everything here raises BadRequest with a message naming the field, so a client sees exactly what
it got wrong.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kera import config
from kera.errors import BadRequest
from kera.wire import Fields

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,255}\Z")
NAME_CHARS_MAX = 255
NODE_CHARS_MAX = 255
ADDRESS_CHARS_MAX = 300
KINDS = ("broker", "backup")

# Bounds of a stream's parameters (inclusive).
STREAMLETS_MAX = 4096
ACTIVE_GROUPS_MAX = 256
REPLICATION_MAX = 8
GROUP_SEGMENTS_MAX = 65536
SEGMENT_SIZE_BYTES_MIN = 1 * config.KiB
SEGMENT_SIZE_BYTES_MAX = 1024 * config.MiB
REPLICATION_CAPACITY_MAX = 4096
RETENTION_MS_MAX = 2**63 - 1
RETENTION_BYTES_MAX = 2**63 - 1

DURABILITIES = (config.DURABILITY_MEMORY, config.DURABILITY_DISK)
# A heartbeat's `stats` map is kept in memory per daemon: bound it, and keep only the figures
# placement may use (a backup's load), so a heartbeat cannot park arbitrary data in the
# coordinator's memory.
STATS_ENTRIES_MAX = 1000
STATS_KEPT = ("unflushed_bytes", "memory_bytes", "replicas")
VERSION_MAX = 2**63 - 1
ID_MAX = 2**32 - 1
# A daemon may ask for an id of its own only below this, so ids handed out in order always
# have room above the ones asked for.
CHOSEN_ID_MAX = 2**31 - 1
# Bounds on the metadata as a whole: registered daemons stay known (dead or alive) forever,
# and every stream descriptor goes into `list_streams` replies, which must stay well under
# wire.MAX_HEADER_BYTES (about 300 bytes per descriptor plus up to 3 per streamlet).
DAEMONS_MAX = 4096           # per kind
STREAMS_MAX = 10_000
STREAMLETS_TOTAL_MAX = 100_000


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What a client asks for when it creates a stream, validated."""
    name: str
    streamlets: int = config.DEFAULT_STREAMLETS
    active_groups: int = config.DEFAULT_ACTIVE_GROUPS
    replication: int = config.DEFAULT_REPLICATION
    group_segments: int = config.DEFAULT_GROUP_SEGMENTS
    segment_size_bytes: int = config.DEFAULT_SEGMENT_SIZE_BYTES
    durability: str = config.DEFAULT_DURABILITY
    replication_capacity: int = 0
    retention_ms: int = 0        # 0: keep forever (see kera.broker.retention)
    retention_bytes: int = 0     # per streamlet; 0: no size limit

    def __post_init__(self):
        stream_name(self.name)
        _bounded("streamlets", self.streamlets, 1, STREAMLETS_MAX)
        _bounded("active_groups", self.active_groups, 1, ACTIVE_GROUPS_MAX)
        _bounded("replication", self.replication, 1, REPLICATION_MAX)
        _bounded("group_segments", self.group_segments, 1, GROUP_SEGMENTS_MAX)
        _bounded("segment_size_bytes", self.segment_size_bytes, SEGMENT_SIZE_BYTES_MIN,
                 SEGMENT_SIZE_BYTES_MAX)
        _bounded("replication_capacity", self.replication_capacity, 0, REPLICATION_CAPACITY_MAX)
        _bounded("retention_ms", self.retention_ms, 0, RETENTION_MS_MAX)
        _bounded("retention_bytes", self.retention_bytes, 0, RETENTION_BYTES_MAX)
        if self.durability not in DURABILITIES:
            raise BadRequest(f"durability must be one of {', '.join(DURABILITIES)}, "
                             f"not {self.durability!r}")

    @classmethod
    def from_fields(cls, f: Fields) -> "StreamSpec":
        # Fields checks types; __post_init__ checks ranges with messages naming the bounds.
        return cls(
            name=f.str("name", hi=NAME_CHARS_MAX),
            streamlets=f.int("streamlets", config.DEFAULT_STREAMLETS),
            active_groups=f.int("active_groups", config.DEFAULT_ACTIVE_GROUPS),
            replication=f.int("replication", config.DEFAULT_REPLICATION),
            group_segments=f.int("group_segments", config.DEFAULT_GROUP_SEGMENTS),
            segment_size_bytes=f.int("segment_size_bytes", config.DEFAULT_SEGMENT_SIZE_BYTES),
            durability=f.str("durability", config.DEFAULT_DURABILITY, hi=16),
            replication_capacity=f.int("replication_capacity", 0),
            retention_ms=f.int("retention_ms", 0),
            retention_bytes=f.int("retention_bytes", 0),
        )


# What `alter_stream` may change after creation.
ALTERABLE = ("retention_ms", "retention_bytes")


def alterations(f: Fields) -> dict:
    """The `alter_stream` fields present (types checked; ranges by StreamSpec)."""
    out = {name: f.int(name, None) for name in ALTERABLE}
    out = {k: v for k, v in out.items() if v is not None}
    if not out:
        raise BadRequest(f"alter_stream needs at least one of {', '.join(ALTERABLE)}")
    return out


def _bounded(name: str, value, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"field '{name}' must be an integer")
    if not lo <= value <= hi:
        raise BadRequest(f"field '{name}'={value} is outside [{lo}, {hi}]")
    return value


def stream_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise BadRequest(f"stream name {name!r} must be 1-{NAME_CHARS_MAX} characters of "
                         "[A-Za-z0-9._-]")
    return name


def kind(f: Fields) -> str:
    value = f.str("kind", hi=16)
    if value not in KINDS:
        raise BadRequest(f"field 'kind' must be one of {', '.join(KINDS)}, not {value!r}")
    return value


def address(f: Fields) -> str:
    """A "host:port" every peer can hand to ZeroMQ's `tcp://` connect: host an IPv4 literal,
    an IPv6 literal in brackets, or an RFC 1123 host name; port 1-65535."""
    value = f.str("address", hi=ADDRESS_CHARS_MAX)
    if not valid_address(value):
        raise BadRequest(f"field 'address' must be HOST:PORT with HOST an IP address ([...] for "
                         f"IPv6) or a host name of letters, digits, '-' and '.', and PORT "
                         f"1-65535; not {value!r}")
    return value


HOST_NAME_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
HOST_NAME_CHARS_MAX = 253


def valid_address(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        return _ip_literal(host[1:-1], 6)
    return _ip_literal(host, 4) or _host_name(host)


def _ip_literal(host: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False


def _host_name(host: str) -> bool:
    labels = host.split(".")
    return (0 < len(host) <= HOST_NAME_CHARS_MAX and all(map(HOST_NAME_LABEL_RE.match, labels))
            and not labels[-1].isdigit())   # "1.2.3.999" is a bad IP, not a name


def node(f: Fields) -> str:
    value = f.str("node", hi=NODE_CHARS_MAX)
    if not value:
        raise BadRequest("field 'node' must not be empty")
    return value


def stats(f: Fields) -> dict | None:
    """The heartbeat `stats` the coordinator keeps: only STATS_KEPT, only numbers (the rest of
    the map, whatever it holds, is dropped with the request)."""
    value = f.dict("stats", None)
    if value is None:
        return None
    if len(value) > STATS_ENTRIES_MAX:
        raise BadRequest(f"field 'stats' has {len(value)} entries, more than {STATS_ENTRIES_MAX}")
    return {name: value[name] for name in STATS_KEPT if _is_number(value.get(name))}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        -2**63 <= value <= 2**64 - 1


# A broker's report of where its virtual segments are replicated (heartbeat field `vsegs`).
VSEG_REPORT_ENTRIES_MAX = 4096   # entries in one heartbeat
VSEG_BACKUPS_MAX = REPLICATION_MAX - 1
VLOG_MAX = 2**32 - 1
VSEG_MAX = 2**64 - 1


def vsegs(f: Fields) -> list[tuple[int, int, list[int]]] | None:
    """`[[vlog, vseg, [backup ids]], ...]` or None when absent; BadRequest on anything off."""
    value = f.list("vsegs", None, max_len=VSEG_REPORT_ENTRIES_MAX)
    if value is None:
        return None
    out = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 3:
            raise BadRequest("field 'vsegs' holds an entry that is not [vlog, vseg, [backup ids]]")
        vlog, vseg, backups = entry
        _bounded("vsegs vlog", vlog, 0, VLOG_MAX)
        _bounded("vsegs vseg", vseg, 0, VSEG_MAX)
        if not isinstance(backups, list) or len(backups) > VSEG_BACKUPS_MAX:
            raise BadRequest(f"field 'vsegs' holds a backup list that is not a list of at most "
                             f"{VSEG_BACKUPS_MAX} ids")
        for b in backups:
            _bounded("vsegs backup id", b, 0, ID_MAX)
        out.append((vlog, vseg, list(backups)))
    return out
