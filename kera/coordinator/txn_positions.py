"""Positions joined to a transaction, checked against and applied to the group stores. Sans-IO.

A transaction's positions (kera.coordinator.transactions `add_positions`) are what a consumer
would otherwise commit: for a kera group, a `group_commit` position (a list of [group, offset,
epoch] entries, kera.coordinator.groups); for a Kafka-protocol group (`kafka: true` on
`txn_add_positions`, from the Kafka listener's TxnOffsetCommit), [offset, metadata]
(kera.coordinator.kafka_offsets). A group name belongs to one protocol, so each group's
positions go to one store; the two shapes tell them apart wherever positions are kept.

Every check `group_commit` would make runs when the positions join (`check`): their shape, the
committing member and its epoch (KIP-447: a consumer fenced by a rebalance cannot join
positions), the caller's read grant on their streams, the protocol of the name, the stores'
bounds. `apply` runs in the handler of the commit decision and never refuses: the decision is
taken, and a position it dropped would be lost. It writes the store directly, so a group the
store's bound (GROUPS_MAX, KAFKA_GROUPS_MAX) filled up meanwhile is created anyway: past the
bound by at most the groups open transactions name (GROUPS_PER_TRANSACTION_MAX per id).
"""

from __future__ import annotations

from typing import Any, Callable

from kera.coordinator import groups as groups_module
from kera.coordinator import kafka_offsets
from kera.coordinator.groups import Group, Groups
from kera.coordinator.kafka_offsets import KafkaOffsets
from kera.coordinator.transactions import TRANSACTIONAL_ID_CHARS_MAX, Part, Transactions
from kera.errors import BadRequest, NotAuthorized

MEMBER_EPOCH_MAX = 2**62      # as group_commit's field


class TxnPositions:
    """The two group stores as a transaction's positions see them. `caller_may(operation,
    resource_type)`: for the request being handled, whether its principal may do that to a
    resource by name; None when nothing is checked (plaintext, admins, brokers' Kafka
    listeners, which check the Kafka user's own grants)."""

    def __init__(self, groups: Groups, offsets: KafkaOffsets, txns: Transactions,
                 caller_may: Callable[[str, str], Callable[[str], bool] | None]):
        self.groups, self.offsets, self.txns = groups, offsets, txns
        self.caller_may = caller_may

    # ------------------------------------------------------------------ when positions join
    def check(self, f, group: str, positions: dict[Part, Any]) -> None:
        """Every refusal `group_commit` (or a Kafka offset commit) would give, before the
        positions join the transaction of `f`. Normalizes kera positions in place."""
        kafka = f.bool("kafka", False)
        may_read_group = self.caller_may("read", "group")
        if may_read_group is not None and not may_read_group(group):
            raise NotAuthorized(f"this principal may not read group {group!r} and so may not "
                                f"join its positions to a transaction: ask an admin for "
                                f"`kera acl add --operation read --group {group}`")
        held = self.txns.txns.get(f.str("transactional_id", hi=TRANSACTIONAL_ID_CHARS_MAX))
        earlier = held.positions.get(group) if held is not None else None
        if earlier and any(is_kafka(p) != kafka for p in earlier.values()):
            raise BadRequest(f"transaction positions of group {group!r} came from the other "
                             f"protocol before: a group is used by one protocol at a time")
        if kafka:
            self._check_kafka(group, positions)
        else:
            self._check_kera(f, group, positions)

    def _check_kafka(self, group: str, positions: dict) -> None:
        for part, position in positions.items():
            positions[part] = _kafka_position(position)
        if group in self.groups.groups:
            raise BadRequest(f"group {group!r} is a kera consumer group: a group is used by "
                             f"one protocol at a time; use another group id")
        if group not in self.offsets.groups and \
                len(self.offsets.groups) >= kafka_offsets.KAFKA_GROUPS_MAX:
            raise BadRequest(f"{kafka_offsets.KAFKA_GROUPS_MAX} Kafka groups hold offsets "
                             f"already: delete unused ones")

    def _check_kera(self, f, group: str, positions: dict) -> None:
        for part, position in positions.items():
            positions[part] = _kera_position(position)
        groups_module.check_readable(self.caller_may("read", "stream"),
                                      {s for s, _ in positions}, group)
        if group in self.offsets.groups:
            raise BadRequest(f"group {group!r} is a Kafka consumer group (its offsets were "
                             f"committed through the Kafka listener): a group is used by one "
                             f"protocol at a time; use another group name")
        self._check_member(group, f.str("member_id", "", hi=groups_module.MEMBER_ID_CHARS_MAX),
                           f.int("member_epoch", 0, lo=0, hi=MEMBER_EPOCH_MAX), positions)

    def _check_member(self, name: str, member_id: str, member_epoch: int, positions) -> None:
        """Groups.commit's checks, without its write."""
        self.groups.check_committer(name, member_id, member_epoch, positions)
        if name not in self.groups.groups and len(self.groups.groups) >= groups_module.GROUPS_MAX:
            raise BadRequest(f"the cluster has {groups_module.GROUPS_MAX} consumer groups, the "
                             f"most it keeps: delete unused ones (kera group delete)")

    def apply(self, name: str, positions: dict[Part, Any]) -> None:
        """Write a committed transaction's positions of group `name` into its store."""
        kera = {p: pos for p, pos in positions.items() if not is_kafka(pos)}
        kafka = {p: pos for p, pos in positions.items() if is_kafka(pos)}
        if kera:
            group = self.groups.groups.get(name)
            if group is None:
                group = self.groups.groups[name] = Group(name)
            group.committed.update(kera)
            self.groups.dirty = True
            self.groups.changes += 1
        if kafka:
            table = self.offsets.groups.setdefault(name, {})
            for part, (offset, metadata) in kafka.items():
                table[part] = (offset, metadata)
            self.offsets.dirty = True


def is_kafka(position) -> bool:
    """A Kafka group's position is [offset, metadata]; a kera group's, a list of lists."""
    return isinstance(position, (list, tuple)) and len(position) == 2 \
        and isinstance(position[0], int) and isinstance(position[1], str)


def _kafka_position(value) -> list:
    if not (isinstance(value, list) and len(value) == 2 and type(value[0]) is int
            and 0 <= value[0] <= kafka_offsets.OFFSET_MAX and isinstance(value[1], str)
            and len(value[1]) <= kafka_offsets.METADATA_CHARS_MAX):
        raise BadRequest(f"a Kafka group's transaction position is [offset, metadata of at "
                         f"most {kafka_offsets.METADATA_CHARS_MAX} characters], not "
                         f"{value!r:.100}")
    return value


def _kera_position(value) -> list:
    if not (isinstance(value, list)
            and 0 < len(value) <= groups_module.GROUPS_PER_POSITION_MAX):
        raise BadRequest("a kera group's transaction position is what group_commit takes: "
                         "[[group, offset, epoch], ...]")
    return [groups_module.group_position(g) for g in value]
