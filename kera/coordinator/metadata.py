"""The coordinator's metadata store, as an interface: what kera.coordinator.server calls.

Two implementations: kera.coordinator.store.MetadataStore (a snapshot + change log in the
coordinator's directory, the embedded default) and kera.coordinator.etcd_store.EtcdStore (one
key per entry on etcd, every write a revision-guarded transaction). The server loads once, writes
a snapshot at startup, then commits once per loop turn; a failed write stops the coordinator
(fail-stop), so the store raises instead of retrying forever.
"""

from __future__ import annotations


DEFAULT_PREFIX_NAME = "default"   # etcd keys under /kera/default/ unless named (--metadata-prefix)
# etcd leases are whole seconds. A dead leader coordinator is replaced within about this long
# (kera.coordinator.leadership); shorter would have a leader step down over one slow etcd round.
DEFAULT_LEADER_LEASE_TTL_S = 3
