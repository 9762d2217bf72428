"""The replica map: which backups hold each virtual segment of each broker, as the brokers
report them in heartbeats (`vsegs`). Sans-IO.

The map is persisted change by change (its journal of "rput", "rdel" and "rclear" store
changes, kera.coordinator.store), not with the rest of the coordinator's state: a busy cluster
reports thousands of segments a second, and metadata versions need not move for them (daemons
need not refetch metadata when a replica lands).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from itertools import islice

log = logging.getLogger(__name__)

# Virtual segments whose backups the coordinator remembers per broker (oldest forgotten first):
# 512 GiB of a broker's data at the default 8 MiB virtual segment.
REPLICA_ENTRIES_PER_BROKER_MAX = 65_536
# Changes kept for the next commit (kera.coordinator.store); past this (nobody commits: a core
# driven without a server) they are dropped and the next commit is a snapshot.
REPLICA_JOURNAL_MAX = 1_000_000

Table = dict[tuple[int, int], list[int]]   # (vlog, vseg) -> backup ids, oldest report first


class ReplicaMap:
    """broker id -> {(vlog, vseg): [backup ids]}, and the journal of its changes."""

    def __init__(self):
        self.tables: dict[int, Table] = {}
        # Changes since the last commit; None once more than REPLICA_JOURNAL_MAX piled up.
        self.journal: list[list] | None = []

    def report(self, broker_id: int, entries) -> None:
        """A broker's report: virtual segment (vlog, vseg) is now replicated on these backups."""
        table = self.tables.setdefault(broker_id, {})
        for vlog, vseg, backups in entries:
            table.pop((vlog, vseg), None)   # re-inserted last: eviction forgets the oldest
            table[(vlog, vseg)] = list(backups)
            self._journal(["rput", broker_id, vlog, vseg, list(backups)])
        excess = len(table) - REPLICA_ENTRIES_PER_BROKER_MAX
        if excess > 0:
            log.warning("broker %d: forgetting the backups of its %d oldest virtual segments "
                        "(at most %d kept)", broker_id, excess, REPLICA_ENTRIES_PER_BROKER_MAX)
            for key in list(islice(table, excess)):   # oldest first, without copying them all
                del table[key]
                self._journal(["rdel", broker_id, key[0], key[1]])

    def forget(self, broker_id: int) -> None:
        """Drop a broker's entries (the broker itself is forgotten)."""
        if self.tables.pop(broker_id, None):
            self._journal(["rclear", broker_id])

    def take_journal(self) -> list[list] | None:
        """The changes since the last call; None: too many, snapshot instead."""
        journal, self.journal = self.journal, []
        return journal

    def names(self, member_kind: str, member_id: int) -> bool:
        """Whether the map holds entries of this broker, or names this backup as a holder."""
        if member_kind == "broker":
            return bool(self.tables.get(member_id))
        return any(member_id in backups for table in self.tables.values()
                   for backups in table.values())

    def entries(self, broker_id: int | None = None, backup_id: int | None = None,
                after: tuple[int, int, int] | None = None,
                limit: int | None = None) -> list[list]:
        """`[[broker_id, vlog, vseg, [backup ids]], ...]`, sorted, optionally only one broker's
        or only the virtual segments one backup holds; only those after `after` (a
        (broker_id, vlog, vseg) cursor), at most `limit`."""
        out: list[list] = []
        for bid in sorted(self.tables):
            if (broker_id is not None and bid != broker_id) or (after and bid < after[0]):
                continue
            table = self.tables[bid]
            keys = sorted(table)
            start = bisect_right(keys, after[1:]) if after and bid == after[0] else 0
            for key in keys[start:]:
                backups = table[key]
                if backup_id is None or backup_id in backups:
                    out.append([bid, key[0], key[1], list(backups)])
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def to_state(self) -> dict:
        """{broker id as text: [[vlog, vseg, backups], ...]}, JSON-ready."""
        return {str(bid): [[vlog, vseg, backups] for (vlog, vseg), backups in table.items()]
                for bid, table in sorted(self.tables.items()) if table}

    def load(self, raw: dict, known_brokers, check) -> None:
        """Entries from `to_state()`'s form; `check(x)`: x as a non-negative int, or raises.
        ValueError names a broker that `known_brokers` lacks."""
        for bid, entries in raw.items():
            broker_id = check(int(bid))
            if broker_id not in known_brokers:
                raise ValueError(f"replicas of unknown broker {broker_id}")
            table = self.tables[broker_id] = {}
            for vlog, vseg, backups in entries:
                table[(check(vlog), check(vseg))] = [check(b) for b in backups]

    def _journal(self, change: list) -> None:
        if self.journal is not None:
            self.journal.append(change)
            if len(self.journal) > REPLICA_JOURNAL_MAX:
                self.journal = None
