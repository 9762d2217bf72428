"""A stream's cleanup policy and its compaction settings: names, defaults, bounds, parsing.

One table shared by the coordinator (validation, descriptors), the broker (its stream
descriptors), the command line and the Kafka listener (topic configs), so a setting is spelled,
defaulted and bounded once. The policy is Kafka's `cleanup.policy`: `delete` (retention deletes
whole old groups: kera.broker.retention), `compact` (the compactor keeps the last record of
each key: docs/COMPACTION.md) or both. kera's field names are Kafka's with `_` for `.`.
"""

from __future__ import annotations

from kera.errors import BadRequest

DELETE = "delete"
COMPACT = "compact"
COMPACT_DELETE = "compact,delete"      # both, in Kafka's canonical order
POLICIES = (DELETE, COMPACT, COMPACT_DELETE)
DEFAULT_POLICY = DELETE
POLICY_CHARS_MAX = 32                  # "delete, compact" with room for spaces

# Kafka's defaults: compact a streamlet once half its closed bytes are superseded records; keep
# tombstones a day so a reader that was behind still sees the delete; no minimum age; no
# maximum (0 is kera's "none", Kafka's Long.MAX_VALUE).
DEFAULT_MIN_CLEANABLE_DIRTY_RATIO = 0.5
DEFAULT_DELETE_RETENTION_MS = 86_400_000
DEFAULT_MIN_COMPACTION_LAG_MS = 0
DEFAULT_MAX_COMPACTION_LAG_MS = 0
LAG_MS_MAX = 2**63 - 1                 # Kafka's longs
KAFKA_LONG_MAX = 2**63 - 1             # Kafka's spelling of "no maximum lag"

# The compaction settings: field -> (Kafka config name, default).
SETTINGS = {
    "min_cleanable_dirty_ratio": ("min.cleanable.dirty.ratio", DEFAULT_MIN_CLEANABLE_DIRTY_RATIO),
    "delete_retention_ms": ("delete.retention.ms", DEFAULT_DELETE_RETENTION_MS),
    "min_compaction_lag_ms": ("min.compaction.lag.ms", DEFAULT_MIN_COMPACTION_LAG_MS),
    "max_compaction_lag_ms": ("max.compaction.lag.ms", DEFAULT_MAX_COMPACTION_LAG_MS),
}
BY_KAFKA_NAME = {kafka: field for field, (kafka, _) in SETTINGS.items()}


def policy(value) -> str:
    """The canonical spelling of a cleanup policy (`delete,compact` and `compact, delete` are
    `compact,delete`); BadRequest naming the choices otherwise."""
    if isinstance(value, str) and len(value) <= POLICY_CHARS_MAX:
        parts = sorted({p.strip() for p in value.split(",")})
        if parts == [COMPACT]:
            return COMPACT
        if parts == [DELETE]:
            return DELETE
        if parts == [COMPACT, DELETE]:
            return COMPACT_DELETE
    raise BadRequest(f"cleanup_policy must be one of {', '.join(POLICIES)}, not {value!r:.40}")


def compacts(name: str) -> bool:
    """Records of a stream under this policy are compacted (and must have keys)."""
    return name != DELETE


def deletes(name: str) -> bool:
    """Retention (retention_ms, retention_bytes) deletes old groups under this policy; a
    `compact`-only stream keeps every key's last record however old, as in Kafka."""
    return name != COMPACT


def setting(field: str, value):
    """A compaction setting checked against its bounds; BadRequest naming them otherwise."""
    if field == "min_cleanable_dirty_ratio":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
            return float(value)
        raise BadRequest(f"min_cleanable_dirty_ratio must be a number in [0, 1], not {value!r:.40}")
    if field not in SETTINGS:
        raise BadRequest(f"no compaction setting {field!r}; known: {', '.join(SETTINGS)}")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= LAG_MS_MAX:
        return value
    raise BadRequest(f"{field} must be an integer in [0, {LAG_MS_MAX}] (milliseconds), "
                     f"not {value!r:.40}")


def from_descriptor(d: dict) -> dict:
    """The policy and settings of a stream descriptor (absent: the defaults, as descriptors of
    streams created before compaction have none), checked."""
    out = {"cleanup_policy": policy(d.get("cleanup_policy", DEFAULT_POLICY))}
    for field, (_, default) in SETTINGS.items():
        out[field] = setting(field, d.get(field, default))
    return out


def descriptor_fields(values) -> dict:
    """What a descriptor carries of an object with the policy and settings as attributes: the
    policy always, the settings only for a compacted stream (descriptors of the other streams
    stay the size they were)."""
    out = {"cleanup_policy": values.cleanup_policy}
    if compacts(values.cleanup_policy):
        out.update({field: getattr(values, field) for field in SETTINGS})
    return out


def kafka_value(field: str, value) -> str:
    """A setting as Kafka's DescribeConfigs spells it."""
    if field == "max_compaction_lag_ms" and value == 0:
        return str(KAFKA_LONG_MAX)
    return str(value)


def from_kafka(field: str, text: str):
    """A setting from a Kafka config value (CreateTopics); BadRequest if it does not parse."""
    try:
        value = float(text) if field == "min_cleanable_dirty_ratio" else int(text)
    except (TypeError, ValueError):
        raise BadRequest(f"config {SETTINGS[field][0]!r} must be a number, not {text!r:.40}") \
            from None
    if field == "max_compaction_lag_ms" and value == KAFKA_LONG_MAX:
        return 0
    return setting(field, value)
