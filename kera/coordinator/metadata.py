"""The coordinator's metadata store, as an interface: what kera.coordinator.server calls.

Two implementations: kera.coordinator.store.MetadataStore (a snapshot + change log in the
coordinator's directory, the embedded default) and kera.coordinator.etcd_store.EtcdStore (one
key per entry on etcd, every write a revision-guarded transaction). The server loads once, writes
a snapshot at startup, then commits once per loop turn; a failed write stops the coordinator
(fail-stop), so the store raises instead of retrying forever.
"""

from __future__ import annotations

from typing import Protocol

DEFAULT_PREFIX_NAME = "default"   # etcd keys under /kera/default/ unless named (--metadata-prefix)
# etcd leases are whole seconds. A dead leader coordinator is replaced within about this long
# (kera.coordinator.leadership); shorter would have a leader step down over one slow etcd round.
DEFAULT_LEADER_LEASE_TTL_S = 3


class MetadataStoreLike(Protocol):
    """Persistence of Coordinator.to_state(): `log_bytes` is the change log's size (0 for a
    store without one), reported in the coordinator's stats."""

    log_bytes: int

    def load(self) -> dict | None:
        """The last committed state, or None on a first start. Raises ValueError on metadata
        that cannot be trusted, kera.errors.StorageError when it cannot be read."""

    def snapshot(self, state: dict) -> None:
        """Make `state` (Coordinator.to_state) the stored state, whole."""

    def commit(self, base: dict | None, replica_changes: list[list]) -> int:
        """Store the changes since the last commit: `base` (Coordinator.base_state) when it may
        have changed, and the replica map's journal. Returns how much was written (0: nothing
        changed). Raises OSError or kera.errors.StorageError when it cannot write,
        kera.errors.Fenced when another coordinator owns the metadata now."""

    def wants_snapshot(self) -> bool:
        """Whether a snapshot should be started (`start_snapshot`, called only then)."""

    def start_snapshot(self, base: dict, replica_tables: dict) -> None:
        """Start a snapshot of `base` + `replica_tables` (copies) off the loop."""

    def close(self) -> None:
        """Release files and connections; waits for a snapshot being written."""
