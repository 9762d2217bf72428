"""The broker's view of live backups, and the choice of backups for a new virtual segment.

Each virtual segment gets its own R-1 distinct backups: never on the broker's own node while
another node has one, on distinct nodes when possible, least loaded first (load = replicas this
broker has assigned and not yet finished), ties rotated so many segments spread evenly. A
backup that just failed a write is *suspect* for a while: chosen only when nothing else is left.

A backup that registers again was restarted (possibly within the coordinator's dead window, so
never seen dead): its in-memory replicas are gone, and the pool reports it like one that died,
so the broker re-replicates what it held (see `update`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

ID_MAX = 2**32 - 1
ADDRESS_CHARS_MAX = 300


@dataclass(slots=True)
class Backup:
    id: int
    address: str
    node: str
    alive: bool = True
    load: int = 0               # replicas assigned by this broker, not yet finished
    suspect_until: float = 0.0  # clock value before which a failed backup is avoided
    registered_version: int = 0  # the coordinator's version of its last `register` (0: unknown)


class BackupPool:
    def __init__(self, own_node: str = ""):
        self.own_node = own_node
        self.backups: dict[int, Backup] = {}
        self._turn = 0

    def update(self, entries, settled: bool = True) -> list[int]:
        """Apply the coordinator's backup list (`cluster` reply); returns ids of backups whose
        replicas are lost: alive before and no longer (dead or gone), or registered again (a
        restarted process: a `registered_version` other than the one seen before, and not 0,
        which only says the coordinator restarted and has not heard a `register` since).
        A list from a coordinator that is not `settled` (restarted less than a dead window
        ago) has not heard from every live backup yet: "not alive" there means "not heard of
        yet", so it declares no backup lost. Malformed entries are skipped."""
        seen: dict[int, tuple[str, str, bool, int]] = {}
        for e in entries if isinstance(entries, list) else ():
            parsed = _parse(e)
            if parsed is None:
                log.warning("ignoring malformed backup entry %r", e)
                continue
            bid, address, node, alive, registered = parsed
            known = self.backups.get(bid)
            if not settled and not alive and known is not None and known.alive:
                alive = True
            seen[bid] = (address, node, alive, registered)
        if not settled:
            for bid, b in self.backups.items():
                if b.alive and bid not in seen:
                    seen[bid] = (b.address, b.node, True, b.registered_version)
        lost = []
        for bid, b in self.backups.items():
            now_alive = bid in seen and seen[bid][2]
            if b.alive and not now_alive:
                lost.append(bid)
            if bid not in seen:
                b.alive = False
            elif seen[bid][3] not in (0, b.registered_version) and bid not in lost:
                log.warning("backup %d registered again (version %d, was %d): it restarted, and "
                            "its replicas are lost", bid, seen[bid][3], b.registered_version)
                lost.append(bid)
        for bid, (address, node, alive, registered) in seen.items():
            b = self.backups.get(bid)
            if b is None:
                self.backups[bid] = Backup(bid, address, node, alive, registered_version=registered)
            else:
                # 0 says "unknown" (a coordinator that has not kept it): the version seen
                # before stays, so a later register still shows as a restart.
                b.address, b.node, b.alive = address, node, alive
                b.registered_version = registered or b.registered_version
        # Forget dead backups nothing refers to any more, so the table stays bounded.
        for bid in [bid for bid, b in self.backups.items() if not b.alive and b.load <= 0 and bid not in seen]:
            del self.backups[bid]
        return lost

    def alive(self, backup_id: int) -> bool:
        b = self.backups.get(backup_id)
        return b is not None and b.alive

    def live_count(self) -> int:
        return sum(1 for b in self.backups.values() if b.alive)

    def choose(self, exclude, used_nodes, now: float) -> Backup | None:
        """The best live backup not in `exclude` (ids), preferring nodes not in `used_nodes`."""
        candidates = [b for b in self.backups.values() if b.alive and b.id not in exclude]
        if not candidates:
            return None
        n = len(candidates)
        turn = self._turn
        self._turn += 1
        candidates.sort(key=lambda b: b.id)
        best = min(range(n), key=lambda i: (
            candidates[i].suspect_until > now,
            candidates[i].node == self.own_node,
            candidates[i].node in used_nodes,
            candidates[i].load,
            (i - turn) % n))
        return candidates[best]

    def assign(self, backup_id: int) -> None:
        b = self.backups.get(backup_id)
        if b is not None:
            b.load += 1

    def unassign(self, backup_id: int) -> None:
        b = self.backups.get(backup_id)
        if b is not None and b.load > 0:
            b.load -= 1

    def suspect(self, backup_id: int, until: float) -> None:
        b = self.backups.get(backup_id)
        if b is not None:
            b.suspect_until = max(b.suspect_until, until)


def _parse(e) -> tuple[int, str, str, bool, int] | None:
    if not isinstance(e, dict):
        return None
    bid, address, node, alive = e.get("id"), e.get("address"), e.get("node", ""), e.get("alive", True)
    registered = e.get("registered_version", 0)
    if not isinstance(registered, int) or isinstance(registered, bool) or registered < 0:
        return None
    if not isinstance(bid, int) or isinstance(bid, bool) or not 0 <= bid <= ID_MAX:
        return None
    if not isinstance(address, str) or not 0 < len(address) <= ADDRESS_CHARS_MAX or ":" not in address:
        return None
    if not isinstance(node, str) or not isinstance(alive, bool):
        return None
    return bid, address, node, alive, registered
