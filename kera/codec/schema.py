"""The wire schema: one typed parser per structure that crosses the network.

Each parser takes a decoded header (or a `wire.Fields` over one) and returns a frozen dataclass
of checked values, or raises BadRequest naming the field that is off: wrong type, number out of
range, too many entries. Daemons, clients and the Spark connector use these, so one structure
has one definition of what is valid. `wire.Fields` stays the primitive for single fields.

Structures here: daemon addresses, `register` and `heartbeat` requests and their replies, the
stream descriptor, produce and fetch results, `offsets_for_time` requests and replies, and
error replies (whole or per result).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kera import errors
from kera.errors import BadRequest, KeraError
from kera.codec.partitioner import DEFAULT_PARTITIONER, PARTITIONER_CHARS_MAX, key_hash
from kera.codec.wire import Fields

# ---------------------------------------------------------------------- bounds
ID_MAX = 2**32 - 1                 # daemon ids
# A daemon may ask for an id of its own only below this, so ids handed out in order always
# have room above the ones asked for.
CHOSEN_ID_MAX = 2**31 - 1
VERSION_MAX = 2**63 - 1            # metadata versions
ADDRESS_CHARS_MAX = 300
NODE_CHARS_MAX = 255
KINDS = ("broker", "backup")
HOST_NAME_CHARS_MAX = 253          # RFC 1123
HOST_NAME_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
# A heartbeat's `stats` map: bounded, and only the figures placement may use (a backup's
# load) are kept, so a heartbeat cannot park arbitrary data in the coordinator's memory.
STATS_ENTRIES_MAX = 1000
STATS_KEPT = ("unflushed_bytes", "memory_bytes", "replicas")
# A broker's report of where its virtual segments are replicated (heartbeat field `vsegs`).
VSEG_REPORT_ENTRIES_MAX = 4096     # entries in one heartbeat
VSEG_BACKUPS_MAX = 7               # validate.REPLICATION_MAX (8) copies: the broker + 7 backups
VLOG_MAX = 2**32 - 1
VSEG_MAX = 2**64 - 1
HEARTBEAT_MS_MIN = 1
HEARTBEAT_MS_MAX = 60_000
# Stream descriptors (client side): as many streamlets as any coordinator admits, and more.
STREAMLETS_MAX = 1 << 20
ACTIVE_GROUPS_MAX = 1 << 16
REPLICATION_MAX = 1 << 8
STREAM_ID_MAX = 2**64 - 1
# An error reply's text fields.
ERROR_CODE_CHARS_MAX = 64
ERROR_MESSAGE_CHARS_MAX = 64 * 1024


def bounded_int(value, name: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"field '{name}' must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadRequest(f"field '{name}'={value} is outside [{lo}, {hi}]")
    return value


def _fields(header) -> Fields:
    if isinstance(header, Fields):
        return header
    if not isinstance(header, dict):
        raise BadRequest("header is not a map")
    return Fields(header)


# ---------------------------------------------------------------------- addresses
def valid_address(value: str) -> bool:
    """Whether `value` is "HOST:PORT" as ZeroMQ's `tcp://` connect takes it: HOST an IPv4
    literal, an IPv6 literal in brackets or an RFC 1123 host name; PORT 1-65535."""
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


def address(f: Fields, name: str = "address") -> str:
    value = f.str(name, hi=ADDRESS_CHARS_MAX)
    if not valid_address(value):
        raise BadRequest(f"field '{name}' must be HOST:PORT with HOST an IP address ([...] for "
                         f"IPv6) or a host name of letters, digits, '-' and '.', and PORT "
                         f"1-65535; not {value!r}")
    return value


# ---------------------------------------------------------------------- register
def kind(f: Fields) -> str:
    value = f.str("kind", hi=16)
    if value not in KINDS:
        raise BadRequest(f"field 'kind' must be one of {', '.join(KINDS)}, not {value!r}")
    return value


def node(f: Fields) -> str:
    value = f.str("node", hi=NODE_CHARS_MAX)
    if not value:
        raise BadRequest("field 'node' must not be empty")
    return value


@dataclass(frozen=True, slots=True)
class Register:
    kind: str
    address: str
    node: str
    daemon_id: int | None     # the id asked for (a restart), or None for a new one


def register(header) -> Register:
    f = _fields(header)
    return Register(kind(f), address(f), node(f), f.int("daemon_id", None, hi=CHOSEN_ID_MAX))


@dataclass(frozen=True, slots=True)
class RegisterReply:
    daemon_id: int
    heartbeat_interval_ms: int | None
    token: str | None          # the incarnation's secret (kera.daemon.identity)
    cluster_id: str | None


# A token or cluster id: hex of 16 random bytes is 32 characters (kera.coordinator.core).
TOKEN_CHARS_MAX = 64


def register_reply(header) -> RegisterReply:
    f = _fields(header)
    return RegisterReply(f.int("daemon_id", hi=ID_MAX),
                         f.int("heartbeat_interval_ms", None, lo=HEARTBEAT_MS_MIN,
                               hi=HEARTBEAT_MS_MAX),
                         f.str("token", None, hi=TOKEN_CHARS_MAX),
                         f.str("cluster_id", None, hi=TOKEN_CHARS_MAX))


# ---------------------------------------------------------------------- heartbeat
@dataclass(frozen=True, slots=True)
class Heartbeat:
    kind: str
    daemon_id: int
    metadata_version: int
    stats: dict | None                                  # only STATS_KEPT, numbers
    vsegs: list[tuple[int, int, list[int]]] | None      # brokers only


def heartbeat(header) -> Heartbeat:
    f = _fields(header)
    value = Heartbeat(kind(f), f.int("daemon_id", hi=ID_MAX),
                      f.int("metadata_version", hi=VERSION_MAX), stats(f), vsegs(f))
    if value.vsegs is not None and value.kind != "broker":
        raise BadRequest("only brokers report 'vsegs'")
    return value


def stats(f: Fields) -> dict | None:
    """The heartbeat `stats` kept: only STATS_KEPT, only numbers (the rest of the map, whatever
    it holds, is dropped with the request)."""
    value = f.dict("stats", None)
    if value is None:
        return None
    if len(value) > STATS_ENTRIES_MAX:
        raise BadRequest(f"field 'stats' has {len(value)} entries, more than {STATS_ENTRIES_MAX}")
    return {name: value[name] for name in STATS_KEPT if _is_number(value.get(name))}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        -2**63 <= value <= 2**64 - 1


def vsegs(f: Fields) -> list[tuple[int, int, list[int]]] | None:
    """`[[vlog, vseg, [backup ids]], ...]` or None when absent."""
    value = f.list("vsegs", None, max_len=VSEG_REPORT_ENTRIES_MAX)
    if value is None:
        return None
    out = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 3:
            raise BadRequest("field 'vsegs' holds an entry that is not [vlog, vseg, [backup ids]]")
        vlog, vseg, backups = entry
        bounded_int(vlog, "vsegs vlog", 0, VLOG_MAX)
        bounded_int(vseg, "vsegs vseg", 0, VSEG_MAX)
        if not isinstance(backups, list) or len(backups) > VSEG_BACKUPS_MAX:
            raise BadRequest(f"field 'vsegs' holds a backup list that is not a list of at most "
                             f"{VSEG_BACKUPS_MAX} ids")
        for b in backups:
            bounded_int(b, "vsegs backup id", 0, ID_MAX)
        out.append((vlog, vseg, list(backups)))
    return out


def metadata_version(header) -> int:
    """The `metadata_version` of a heartbeat or `broker_streams` reply."""
    return _fields(header).int("metadata_version", hi=VERSION_MAX)


# ---------------------------------------------------------------------- stream descriptor
@dataclass(frozen=True, slots=True)
class StreamInfo:
    name: str
    id: int
    streamlets: int
    active_groups: int
    replication: int
    placement: tuple            # owning broker id of each streamlet (None: no owner now)
    brokers: dict               # broker id -> "host:port"
    version: int
    ready: bool
    # How keys map to streamlets when a client names no partitioner (kera.codec.partitioner);
    # a descriptor without it is of a stream from before the setting: crc32c.
    partitioner: str = DEFAULT_PARTITIONER

    def address_of(self, streamlet: int) -> str | None:
        """The owning broker's "host:port", or None when the streamlet has no live owner."""
        owner = self.placement[streamlet]
        return None if owner is None else self.brokers.get(owner)

    def owner(self, streamlet: int) -> str:
        """The owning broker's "host:port"; NotReady (retriable) while it has no live owner."""
        address = self.address_of(streamlet)
        if address is None:
            from kera.errors import NotReady
            raise NotReady(f"stream '{self.name}' streamlet {streamlet} has no live owner now "
                           f"(failover under way?); ask again shortly")
        return address

    @property
    def serving(self) -> bool:
        """Every streamlet has a live owner and every owner knows the stream."""
        return self.ready and all(self.address_of(sl) for sl in range(self.streamlets))


def stream_descriptor(descriptor) -> StreamInfo:
    """A descriptor from `describe_stream` / `create_stream` / `list_streams`."""
    f = _fields(descriptor)
    name = f.str("name")
    streamlets = f.int("streamlets", lo=1, hi=STREAMLETS_MAX)
    placement = f.list("placement", max_len=STREAMLETS_MAX)
    if len(placement) != streamlets:
        raise BadRequest(f"stream '{name}': placement of {len(placement)} for {streamlets} streamlets")
    for owner in placement:
        if owner is not None:
            bounded_int(owner, f"stream '{name}' placement", 0, ID_MAX)
    brokers = {}
    for key, value in f.dict("brokers").items():
        try:
            broker_id = bounded_int(int(key), f"stream '{name}' broker id", 0, ID_MAX)
        except (TypeError, ValueError):
            raise BadRequest(f"stream '{name}': bad broker id {key!r}") from None
        if not isinstance(value, str) or not valid_address(value):
            raise BadRequest(f"stream '{name}': bad broker address {value!r}")
        brokers[broker_id] = value
    return StreamInfo(name=name, id=f.int("id", hi=STREAM_ID_MAX), streamlets=streamlets,
                      active_groups=f.int("active_groups", 1, lo=1, hi=ACTIVE_GROUPS_MAX),
                      replication=f.int("replication", 1, lo=1, hi=REPLICATION_MAX),
                      placement=tuple(placement), brokers=brokers,
                      version=f.int("version", 0, hi=VERSION_MAX), ready=f.bool("ready", True),
                      partitioner=_partitioner(f, name))


def _partitioner(f: Fields, stream: str) -> str:
    name = f.str("partitioner", DEFAULT_PARTITIONER, hi=PARTITIONER_CHARS_MAX)
    try:
        key_hash(name)
    except BadRequest as bad:
        raise BadRequest(f"stream '{stream}': {bad} (a newer coordinator? upgrade this "
                         f"client)") from None
    return name


# ---------------------------------------------------------------------- results
POSITION_MAX = 2**64 - 1


def produce_result(result) -> KeraError | tuple[int, ...] | None:
    """One chunk's entry of a `produce` reply: `[g, segment, base_offset, number]` when stored
    (`number`, the record number of the chunk's first record, is absent when the broker does
    not know it), `[]` when stored earlier at a position the broker did not look up (returned
    as None: a retry of a chunk older than the broker's duplicate scan, kera.broker.core), or
    `[code, message, retriable]` when refused (returned as the error). A malformed entry is a
    retriable error: the chunk is resent, never taken as stored."""
    if isinstance(result, list) and not result:
        return None
    if isinstance(result, list) and len(result) in (3, 4):
        if isinstance(result[0], str) and len(result) == 3:
            return result_error(result)
        if all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= POSITION_MAX
               for x in result):
            return tuple(result)
    return KeraError(f"malformed produce result {result!r:.80}", retriable=True)


def fetch_result(result, frames_available: int) -> tuple[KeraError | None, int, object]:
    """One read's entry of a `fetch` reply: `[error or None, n_frames, groups]` (groups are
    parsed by the consumer's cursor). BadRequest when malformed."""
    if not isinstance(result, list) or len(result) != 3:
        raise BadRequest(f"fetch result {result!r:.80} is not [error, n_frames, groups]")
    error, n_frames, groups = result
    bounded_int(n_frames, "n_frames", 0, frames_available)
    return (None if error is None else result_error(error)), n_frames, groups


# ---------------------------------------------------------------------- offsets_for_time
# Record timestamps are i64 microseconds; a seek target is one of them, never negative.
TIMESTAMP_US_MAX = 2**63 - 1
# Entries in the reply's cursor: the broker's bound on a fetch cursor (broker.core).
TIME_CURSOR_GROUPS_MAX = 4096


# ---------------------------------------------------------------------- offsets_for_number
# Record numbers are u64 (kera.codec.chunk); the reply is a cursor as offsets_for_time's.
NUMBER_MAX = 2**64 - 2


# A streamlet's *number floor*: once retention deleted every group of one of its slots, nothing
# stored says where its group ids and record numbers go on. The owning broker reports
# [first group, [next record number per slot]] in its heartbeat (kera.broker.retention); the
# coordinator keeps it with the stream and hands it to whoever owns the streamlet next, so a
# failover continues the numbering instead of restarting it at 0 (kera.broker.rebuild).
GROUP_ID_MAX = 2**63 - 1


def number_floor(entry, slots: int) -> tuple[int, tuple[int, ...]]:
    """`[first_group, [next number of each of `slots` slots]]`, checked."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or \
            not isinstance(entry[1], (list, tuple)) or len(entry[1]) != slots:
        raise BadRequest(f"a number floor is [first group, [{slots} record numbers]], not "
                         f"{entry!r:.200}")
    first_group, numbers = entry
    for value, hi in ((first_group, GROUP_ID_MAX), *((n, NUMBER_MAX) for n in numbers)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
            raise BadRequest(f"a number floor holds {value!r:.50}, not an integer in 0..{hi}")
    return first_group, tuple(numbers)


def merged_floor(old, new) -> tuple[int, tuple[int, ...]]:
    """Floors only move up: the higher first group and, per slot, the higher next number."""
    if old is None:
        return new
    return max(old[0], new[0]), tuple(max(a, b) for a, b in zip(old[1], new[1]))


@dataclass(frozen=True, slots=True)
class CursorQuery:
    """An `offsets_for_time` or `offsets_for_number` request: where in which streamlet."""
    sid: int
    sl: int
    target: int       # timestamp_us or number


def cursor_query(header, field: str, hi: int) -> CursorQuery:
    f = _fields(header)
    return CursorQuery(f.int("sid", hi=STREAM_ID_MAX), f.int("sl", hi=STREAMLETS_MAX),
                       f.int(field, hi=hi))


def offsets_for_time(header) -> CursorQuery:
    return cursor_query(header, "timestamp_us", TIMESTAMP_US_MAX)


def offsets_for_number(header) -> CursorQuery:
    return cursor_query(header, "number", NUMBER_MAX)


@dataclass(frozen=True, slots=True)
class TimeCursor:
    low: int                   # groups below are finished and wholly before the time
    offsets: dict              # {group: first offset at or after the time}; absent groups: 0
    first_group: int           # the first retained group
    epoch: int | None          # the streamlet's history epoch (None: no data yet)


def time_cursor(header) -> TimeCursor:
    """An `offsets_for_time` reply; BadRequest naming the field that is off."""
    f = _fields(header)
    raw = f.dict("offsets")
    if len(raw) > TIME_CURSOR_GROUPS_MAX:
        raise BadRequest(f"field 'offsets' has {len(raw)} groups, over {TIME_CURSOR_GROUPS_MAX}")
    offsets = {bounded_int(g, "offsets group", 0, ID_MAX): bounded_int(o, "offsets offset", 0,
                                                                       POSITION_MAX)
               for g, o in raw.items()}
    epoch = None if f.h.get("epoch") is None else f.int("epoch")   # None: no data yet
    return TimeCursor(f.int("low", hi=ID_MAX), offsets, f.int("first_group", hi=ID_MAX), epoch)


# ---------------------------------------------------------------------- error reply
def error_reply(header: dict) -> KeraError:
    """The KeraError an error reply (`ok` false) carries; a malformed one is an `internal`
    error saying so, never a crash of the client."""
    return _error(header.get("code"), header.get("message"), header.get("retriable"), header)


def result_error(entry) -> KeraError:
    """The KeraError of a per-result `[code, message, retriable]` entry."""
    if not isinstance(entry, list) or len(entry) != 3:
        return _error(None, None, None, entry)
    return _error(*entry, entry)


def _error(code, message, retriable, whole) -> KeraError:
    if not isinstance(code, str) or len(code) > ERROR_CODE_CHARS_MAX:
        code = "internal"
    if not isinstance(message, str):
        message = f"malformed error reply {str(whole)[:200]}"
    return errors.from_reply(code, message[:ERROR_MESSAGE_CHARS_MAX], retriable is True)
