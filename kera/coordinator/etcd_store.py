"""The coordinator's metadata on etcd: kera.coordinator.metadata's interface, fenced writes.

Keys live under `/kera/<name>/` (kera.coordinator.etcd_keys lays them out). Every write is one
etcd transaction guarded by the fencing key: it applies only if the fencing key's mod revision
is still the one this store holds (`fence_revision`). `load()` claims the metadata by writing the
fencing key (`<prefix>fence`) and reading the state at that revision or later, so when a second
coordinator starts on the same prefix, the first one's next commit is refused (kera.errors.
Fenced), changes nothing, and that coordinator stops: two coordinators never both apply a
decision. A leader election hands the store its own fencing key instead (`use_fence`, e.g. a
lease-bound leader key: when its lease expires the key is deleted and the guard fails too).

A commit writes only the entries that changed, split into guarded batches when it exceeds one
transaction (etcd_keys.batches). There is no log to fold: etcd keeps the history, and its
`--auto-compaction-retention` bounds it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket

from kera.coordinator import etcd_keys
from kera.coordinator.etcd_access import EtcdAccess
from kera.coordinator.etcd_client import EtcdClient, b64, parse_url
from kera.coordinator.metadata import DEFAULT_PREFIX_NAME
from kera.errors import Fenced

log = logging.getLogger(__name__)

KEY_ROOT = "/kera/"
FENCE_KEY = "fence"


def prefix_for(name: str) -> str:
    """`/kera/<name>/`: one cluster's keys."""
    if not name or "/" in name:
        raise ValueError(f"metadata prefix name {name!r}: a non-empty name without '/'")
    return f"{KEY_ROOT}{name}/"


class EtcdStore:
    """The state under `prefix` on the etcd at `client` (an EtcdClient)."""

    def __init__(self, client: EtcdClient, prefix: str):
        self.client = client
        self.prefix = prefix
        self.fence_key = prefix + FENCE_KEY
        self.fence_revision: int | None = None
        self.log_bytes = 0          # no log: etcd keeps the history
        self.written_bytes = 0      # keys and values written since the start (stats)
        self._stored: dict[str, str] = {}   # key below the prefix -> value, as etcd holds it
        self._seq = etcd_keys.ReplicaSeq()

    @classmethod
    def from_url(cls, url: str, name: str = DEFAULT_PREFIX_NAME,
                 access: EtcdAccess = EtcdAccess()) -> "EtcdStore":
        """The store for `etcd[s]://host:port[,...]`, keys under /kera/<name>/, reached as
        `access` says (TLS, an etcd user)."""
        return cls(EtcdClient(parse_url(url), access), prefix_for(name))

    def describe(self) -> str:
        scheme = "etcds" if self.client.access.tls else "etcd"
        return f"{scheme}://{self.client.names()} under {self.prefix}"

    # ------------------------------------------------------------------ fencing
    def claim_fence(self) -> int:
        """Take the metadata over: write the fencing key; from now on only this store's
        commits apply. Returns the fencing revision."""
        # Who claimed it, for an operator reading the key: host, pid and a nonce.
        owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        _, revision = self.client.txn([], [_put(self.fence_key, owner)])
        self.fence_revision = revision
        log.info("claimed the metadata under %s (%s at revision %d as %s)", self.prefix,
                 self.fence_key, revision, owner)
        return revision

    def use_fence(self, key: str, revision: int) -> None:
        """Guard the commits by `key` (a full etcd key) still having mod revision `revision`."""
        self.fence_key, self.fence_revision = key, revision

    # ------------------------------------------------------------------ loading
    def load(self) -> dict | None:
        """Claim the fence (unless one was given), then read the state: None on a first start.
        Raises ValueError on entries that are not JSON."""
        if self.fence_revision is None:
            self.claim_fence()
        kvs, _ = self.client.read_prefix(self.prefix, revision=0)
        below = [(k[len(self.prefix):], v) for k, v, _ in kvs]
        try:
            state, first_seq = etcd_keys.load_state(below)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.describe()}: an entry is not valid: {exc}") from None
        self._stored = {k: v for k, v in below if k.partition("/")[0] in etcd_keys.NAMESPACES}
        self._seq = etcd_keys.ReplicaSeq(first_seq)
        return state

    # ------------------------------------------------------------------ writing
    def snapshot(self, state: dict) -> None:
        """Make `state` the stored state: writes only the entries that differ."""
        self._write(etcd_keys.snapshot_writes(self._stored, state, self._seq))

    def commit(self, base: dict | None, replica_changes: list[list]) -> int:
        """Write the changes (kera.coordinator.metadata); returns the bytes written."""
        return self._write(etcd_keys.plan(self._stored, base, replica_changes, self._seq))

    def _write(self, writes: dict) -> int:
        assert self.fence_revision is not None, "load() first"
        written = 0
        for batch in etcd_keys.batches(writes):
            ok, _ = self.client.txn([self._guard()], [self._op(k, v) for k, v in batch])
            if not ok:
                raise Fenced(f"the metadata under {self.prefix} was taken over by another "
                             f"coordinator ({self.fence_key} moved past revision "
                             f"{self.fence_revision}): this coordinator steps down")
            etcd_keys.apply(self._stored, dict(batch))
            written += sum(len(k) + len(v or "") for k, v in batch)
        self.written_bytes += written
        return written

    def _guard(self) -> dict:
        return {"key": b64(self.fence_key), "target": "MOD", "result": "EQUAL",
                "mod_revision": str(self.fence_revision)}

    def _op(self, key: str, value: str | None) -> dict:
        if value is None:
            return {"request_delete_range": {"key": b64(self.prefix + key)}}
        return _put(self.prefix + key, value)

    def wants_snapshot(self) -> bool:
        return False    # nothing to fold: every commit is already in place

    def start_snapshot(self, base: dict, replica_tables: dict) -> None:
        raise AssertionError("an etcd store never asks for a snapshot (wants_snapshot)")

    def close(self) -> None:
        self.client.close()


def _put(key: str, value: str) -> dict:
    return {"request_put": {"key": b64(key), "value": b64(value)}}
