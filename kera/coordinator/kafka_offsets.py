"""Committed offsets of Kafka-protocol consumer groups, kept by the coordinator. Sans-IO.

A Kafka group's membership (JoinGroup, SyncGroup, heartbeats) lives on the broker the group's
clients find as their coordinator (kera.broker.kafka.classic_groups); what must outlive that
broker and a coordinator failover is the committed offsets, so they are stored here, beside
kera's own groups, and persisted with the rest of the metadata. An offset is a record number
(the Kafka listener's offset), kept with the client's metadata string as Kafka keeps it.
A group name is used by one protocol at a time: a name that kera's own groups hold is refused
here, and kera's groups refuse a name held here (kera.coordinator.groups).
"""

from __future__ import annotations

from kera.codec.wire import Fields
from kera.errors import BadRequest

GROUP_CHARS_MAX = 255
METADATA_CHARS_MAX = 4096          # Kafka's offset.metadata.max.bytes default
PARTITIONS_PER_COMMIT_MAX = 10_000
KAFKA_GROUPS_MAX = 10_000          # groups with committed offsets
OFFSET_MAX = 2**63 - 1


class KafkaOffsets:
    def __init__(self, kera_group_names=frozenset):
        # {group: {(topic, partition): (offset, metadata)}}
        self.groups: dict[str, dict[tuple[str, int], tuple[int, str]]] = {}
        self.kera_group_names = kera_group_names   # () -> names kera's own groups hold
        self.dirty = False

    def commit(self, group: str, entries: list[tuple[str, int, int, str]]) -> None:
        if group in self.kera_group_names():
            raise BadRequest(f"group {group!r} is a kera consumer group: a group is used by "
                             f"one protocol at a time; use another group id")
        if group not in self.groups and len(self.groups) >= KAFKA_GROUPS_MAX:
            raise BadRequest(f"{KAFKA_GROUPS_MAX} Kafka groups hold offsets already: delete "
                             f"unused ones (Kafka's DeleteGroups: kafka-consumer-groups "
                             f"--delete --group NAME)")
        table = self.groups.setdefault(group, {})
        for topic, partition, offset, metadata in entries:
            table[(topic, partition)] = (offset, metadata)
        self.dirty = True

    def fetch(self, group: str) -> list[list]:
        table = self.groups.get(group, {})
        return [[t, p, off, meta] for (t, p), (off, meta) in sorted(table.items())]

    def delete(self, group: str, partitions: list[tuple[str, int]] | None = None) -> None:
        """Forget a group's offsets (all of them, or those of `partitions`)."""
        table = self.groups.get(group)
        if table is None:
            return
        for key in (list(table) if partitions is None else partitions):
            table.pop(key, None)
        if not table:
            del self.groups[group]
        self.dirty = True

    def forget_topic(self, topic: str) -> None:
        """A deleted topic's offsets go with it, as Kafka's do."""
        for group in list(self.groups):
            self.delete(group, [k for k in self.groups[group] if k[0] == topic])

    def take_dirty(self) -> bool:
        dirty, self.dirty = self.dirty, False
        return dirty

    def to_state(self) -> list:
        return [[g, [[t, p, off, meta] for (t, p), (off, meta) in sorted(table.items())]]
                for g, table in sorted(self.groups.items())]

    def load(self, state: list) -> None:
        for group, entries in state:
            self.groups[str(group)] = {(str(t), int(p)): (int(off), str(meta))
                                       for t, p, off, meta in entries}


def ops(offsets: KafkaOffsets) -> dict:
    """Request handlers of the Kafka offset ops, for Coordinator.handle: (Fields, now) -> reply."""
    def group(f: Fields) -> str:
        return f.str("group", hi=GROUP_CHARS_MAX)

    def commit(f: Fields, now: float) -> dict:
        offsets.commit(group(f), _entries(f.list("offsets", max_len=PARTITIONS_PER_COMMIT_MAX)))
        return {}

    def delete(f: Fields, now: float) -> dict:
        """`found`: whether the group held offsets (Kafka's OffsetDelete: GROUP_ID_NOT_FOUND)."""
        parts = f.list("partitions", None, max_len=PARTITIONS_PER_COMMIT_MAX)
        name = group(f)
        found = name in offsets.groups
        offsets.delete(name, None if parts is None else [_part(p) for p in parts])
        return {"found": found}

    return {"kafka_offset_commit": commit,
            "kafka_offset_fetch": lambda f, now: {"offsets": offsets.fetch(group(f))},
            "kafka_offset_delete": delete,
            "kafka_group_list": lambda f, now: {"groups": sorted(offsets.groups)}}


def _part(value) -> tuple[str, int]:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and type(value[1]) is int and 0 <= value[1] < 2**31):
        raise BadRequest(f"a partition is [topic, index], not {value!r:.100}")
    return value[0], value[1]


def _entries(values: list) -> list[tuple[str, int, int, str]]:
    out = []
    for v in values:
        if not (isinstance(v, list) and len(v) == 4 and type(v[2]) is int
                and 0 <= v[2] <= OFFSET_MAX and isinstance(v[3], str)
                and len(v[3]) <= METADATA_CHARS_MAX):
            raise BadRequest(f"a Kafka offset is [topic, partition, offset, metadata of at most "
                             f"{METADATA_CHARS_MAX} characters], not {v!r:.100}")
        out.append((*_part(v[:2]), v[2], v[3]))
    return out
