"""Stream descriptors as the broker uses them, validated (they come from the network too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kera import config

from kera.codec import cleanup, schema
from kera.errors import BadRequest

# Bounds a broker accepts in a descriptor; the coordinator enforces tighter ones on creation.
STREAMLETS_MAX = 1 << 16
ACTIVE_GROUPS_MAX = 4096
REPLICATION_MAX = 16
GROUP_SEGMENTS_MAX = 1 << 20
SEGMENT_SIZE_BYTES_MIN = 1024
SEGMENT_SIZE_BYTES_MAX = 1 << 30     # segment positions are u32
U64_MAX = 2**64 - 1
DURABILITIES = (config.DURABILITY_MEMORY, config.DURABILITY_DISK)


@dataclass(slots=True)
class StreamInfo:
    id: int
    name: str
    streamlets: int
    active_groups: int
    replication: int
    group_segments: int
    segment_size_bytes: int
    durability: str
    replication_capacity: int
    placement: list
    version: int
    # Retention (0: unlimited): whole groups whose last append is older than retention_ms, or
    # beyond retention_bytes per streamlet, are deleted (broker/retention.py).
    retention_ms: int = 0
    retention_bytes: int = 0
    # Groups are deleted by age only once every consumer group committed past them
    # (broker/retention.py, `consumed` marks from the coordinator).
    retain_until_consumed: bool = False
    # {streamlet: (first group, next record number per slot)}: where a streamlet that retention
    # emptied goes on after a failover (kera.codec.schema.number_floor).
    floors: dict = field(default_factory=dict)
    # Kafka's cleanup.policy and the compaction settings (kera.codec.cleanup).
    cleanup_policy: str = cleanup.DEFAULT_POLICY
    min_cleanable_dirty_ratio: float = cleanup.DEFAULT_MIN_CLEANABLE_DIRTY_RATIO
    delete_retention_ms: int = cleanup.DEFAULT_DELETE_RETENTION_MS
    min_compaction_lag_ms: int = cleanup.DEFAULT_MIN_COMPACTION_LAG_MS
    max_compaction_lag_ms: int = cleanup.DEFAULT_MAX_COMPACTION_LAG_MS
    # True under `compact` and `compact,delete`: records must have keys (kera.broker.core).
    compacted: bool = False

    @classmethod
    def from_descriptor(cls, d) -> "StreamInfo":
        if not isinstance(d, dict):
            raise BadRequest("stream descriptor is not a map")
        info = cls(
            id=_int(d, "id", 0, U64_MAX),
            name=_str(d, "name"),
            streamlets=_int(d, "streamlets", 1, STREAMLETS_MAX),
            active_groups=_int(d, "active_groups", 1, ACTIVE_GROUPS_MAX),
            replication=_int(d, "replication", 1, REPLICATION_MAX),
            group_segments=_int(d, "group_segments", 1, GROUP_SEGMENTS_MAX),
            segment_size_bytes=_int(d, "segment_size_bytes", SEGMENT_SIZE_BYTES_MIN, SEGMENT_SIZE_BYTES_MAX),
            durability=_str(d, "durability"),
            replication_capacity=_int(d, "replication_capacity", 0, U64_MAX, default=0),
            placement=d.get("placement"),
            version=_int(d, "version", 0, U64_MAX, default=0),
            retention_ms=_int(d, "retention_ms", 0, U64_MAX, default=0),
            retention_bytes=_int(d, "retention_bytes", 0, U64_MAX, default=0),
            retain_until_consumed=d.get("retain_until_consumed", False) is True,
            **cleanup.from_descriptor(d),
        )
        info.compacted = cleanup.compacts(info.cleanup_policy)
        if info.durability not in DURABILITIES:
            raise BadRequest(f"stream {info.name!r}: unknown durability {info.durability!r}")
        p = info.placement
        if not isinstance(p, list) or len(p) != info.streamlets or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in p):
            raise BadRequest(f"stream {info.name!r}: placement must list {info.streamlets} broker ids")
        info.floors = _floors(d.get("floors", []), info)
        return info

    def owner(self, streamlet: int):
        return self.placement[streamlet]


def _floors(entries, info: StreamInfo) -> dict:
    if not isinstance(entries, list) or len(entries) > info.streamlets:
        raise BadRequest(f"stream {info.name!r}: 'floors' must list at most one per streamlet")
    out = {}
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], int) or \
                not 0 <= entry[0] < info.streamlets:
            raise BadRequest(f"stream {info.name!r}: a floor is [streamlet, first group, "
                             f"[numbers]], not {entry!r:.200}")
        out[entry[0]] = schema.number_floor(entry[1:], info.active_groups)
    return out


def _int(d: dict, name: str, lo: int, hi: int, default=...) -> int:
    value = d.get(name, default)
    if value is ...:
        raise BadRequest(f"stream descriptor lacks '{name}'")
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"stream descriptor field '{name}'={value!r} is not an integer in [{lo}, {hi}]")
    return value


def _str(d: dict, name: str) -> str:
    value = d.get(name)
    if not isinstance(value, str) or len(value) > 1024:
        raise BadRequest(f"stream descriptor field '{name}' must be a string")
    return value
