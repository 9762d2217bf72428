"""Validation of coordinator request fields: stream names and parameters (daemon fields:
kera.codec.schema).

Everything here raises BadRequest with a message naming the field, so a client sees exactly what
it got wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kera import config

from kera.codec import cleanup, partitioner, schema
from kera.errors import BadRequest
from kera.codec.wire import Fields

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,255}\Z")
NAME_CHARS_MAX = 255
NODE_CHARS_MAX = schema.NODE_CHARS_MAX
ADDRESS_CHARS_MAX = schema.ADDRESS_CHARS_MAX
KINDS = schema.KINDS

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
STATS_ENTRIES_MAX = schema.STATS_ENTRIES_MAX
STATS_KEPT = schema.STATS_KEPT
VERSION_MAX = schema.VERSION_MAX
ID_MAX = schema.ID_MAX
CHOSEN_ID_MAX = schema.CHOSEN_ID_MAX
# Bounds on the metadata as a whole: registered daemons stay known (dead or alive) forever,
# and every stream descriptor goes into `list_streams` replies, which must stay well under
# wire.MAX_HEADER_BYTES (about 300 bytes per descriptor plus up to 3 per streamlet).
# Per kind. Every daemon's summary (up to ~580 bytes with the longest address and node) goes
# into each `cluster` reply: 2 x 2048 of them stay near 2.4 MB, under the 4 MiB header limit.
DAEMONS_MAX = 2048
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
    # Consumption-based retention (kera.broker.retention): a group is deleted by age only once
    # every consumer group of the stream has committed past it; the size bound still applies.
    retain_until_consumed: bool = False
    # Kafka's cleanup.policy and compaction settings (kera.codec.cleanup, docs/COMPACTION.md).
    cleanup_policy: str = cleanup.DEFAULT_POLICY
    min_cleanable_dirty_ratio: float = cleanup.DEFAULT_MIN_CLEANABLE_DIRTY_RATIO
    delete_retention_ms: int = cleanup.DEFAULT_DELETE_RETENTION_MS
    min_compaction_lag_ms: int = cleanup.DEFAULT_MIN_COMPACTION_LAG_MS
    max_compaction_lag_ms: int = cleanup.DEFAULT_MAX_COMPACTION_LAG_MS
    # How clients place keys when they name no partitioner (kera.codec.partitioner); fixed at
    # creation, since changing it would move every key.
    partitioner: str = partitioner.DEFAULT_PARTITIONER

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
        if not isinstance(self.retain_until_consumed, bool):
            raise BadRequest("retain_until_consumed must be true or false")
        if self.durability not in DURABILITIES:
            raise BadRequest(f"durability must be one of {', '.join(DURABILITIES)}, "
                             f"not {self.durability!r}")
        if not isinstance(self.partitioner, str):
            raise BadRequest(f"partitioner must be a string, not {self.partitioner!r}")
        partitioner.key_hash(self.partitioner)   # BadRequest naming the choices
        self._check_cleanup()

    def _check_cleanup(self) -> None:
        # Frozen: the canonical spellings are set through object.__setattr__.
        object.__setattr__(self, "cleanup_policy", cleanup.policy(self.cleanup_policy))
        for name in cleanup.SETTINGS:
            object.__setattr__(self, name, cleanup.setting(name, getattr(self, name)))
        if cleanup.compacts(self.cleanup_policy) and self.active_groups != 1:
            # "The last record of a key" needs one order: a slot is the ordered unit.
            raise BadRequest(f"cleanup_policy {self.cleanup_policy} needs active_groups 1 (one "
                             f"ordered unit per streamlet, as a Kafka partition), not "
                             f"{self.active_groups}")
        lag_min, lag_max = self.min_compaction_lag_ms, self.max_compaction_lag_ms
        if lag_max and lag_max < lag_min:
            raise BadRequest(f"max_compaction_lag_ms {lag_max} is below min_compaction_lag_ms "
                             f"{lag_min}: raise it, or 0 for no maximum")

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
            retain_until_consumed=f.bool("retain_until_consumed", False),
            **cleanup_fields(f, defaults=True),
            partitioner=f.str("partitioner", partitioner.DEFAULT_PARTITIONER,
                              hi=partitioner.PARTITIONER_CHARS_MAX),
        )


def cleanup_fields(f: Fields, defaults: bool) -> dict:
    """The cleanup policy and compaction settings present in `f` (with `defaults`, every one:
    the absent ones at their defaults); values are checked by StreamSpec."""
    out = {}
    policy = f.str("cleanup_policy", None, hi=cleanup.POLICY_CHARS_MAX)
    if policy is not None or defaults:
        out["cleanup_policy"] = cleanup.DEFAULT_POLICY if policy is None else policy
    for name, (_, default) in cleanup.SETTINGS.items():
        value = f.get(name, (int, float), None)
        if value is not None or defaults:
            out[name] = default if value is None else value
    return out


# What `alter_stream` may change after creation (`streamlets` only upwards).
_ALTERABLE_INTS = ("retention_ms", "retention_bytes", "streamlets")
ALTERABLE = (*_ALTERABLE_INTS, "retain_until_consumed", "cleanup_policy", *cleanup.SETTINGS)


def alterations(f: Fields) -> dict:
    """The `alter_stream` fields present (types checked; ranges by StreamSpec)."""
    out = {name: f.int(name, None) for name in _ALTERABLE_INTS}
    out["retain_until_consumed"] = f.bool("retain_until_consumed", None)
    out = {k: v for k, v in out.items() if v is not None}
    out.update(cleanup_fields(f, defaults=False))
    if not out:
        raise BadRequest(f"alter_stream needs at least one of {', '.join(ALTERABLE)}")
    return out


def _bounded(name: str, value, lo: int, hi: int) -> int:
    return schema.bounded_int(value, name, lo, hi)


def stream_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise BadRequest(f"stream name {name!r} must be 1-{NAME_CHARS_MAX} characters of "
                         "[A-Za-z0-9._-]")
    return name


# The daemon-facing fields are parsed by the wire schema (one parser per structure).
kind = schema.kind
address = schema.address
node = schema.node
stats = schema.stats
vsegs = schema.vsegs
VSEG_REPORT_ENTRIES_MAX = schema.VSEG_REPORT_ENTRIES_MAX
VSEG_BACKUPS_MAX = schema.VSEG_BACKUPS_MAX
VLOG_MAX = schema.VLOG_MAX
VSEG_MAX = schema.VSEG_MAX
