"""The coordinator's state as etcd keys, and a commit as ordered, bounded write batches (sans-IO).

Under the cluster's prefix (e.g. `/kera/NAME/`) every entry of the state is one key whose value
is its JSON:

    meta/<scalar>                  each scalar of Coordinator.base_state (format, metadata_version,
                                   next ids, tombstones, recovery, acls, ...)
    members/<kind>/<id>            one daemon
    streams/<name>                 one stream (descriptor + placement)
    transactions/<id>              one transactional id (kera.coordinator.transactions)
    groups/<name>                  one consumer group (committed positions)
    replicas/<broker>/<vlog>/<vseg>  [seq, backups]: who holds one virtual segment (seq below)

so a commit writes only the entries that changed. Other keys under the prefix (the fencing key,
a leader key) are not state and are skipped when loading.

A commit too large for one etcd transaction (at most TXN_OPS_MAX operations, TXN_BYTES_MAX
bytes) is split into batches, written in an order where every prefix of it is a state the
coordinator loads: scalars (the next ids, the metadata version) before the members and streams
that sit below them, members before the streams and replica entries that name them, and the
deletions last, entries before the members they name. A crash between two batches keeps such a
prefix of a commit nobody was answered for, as a file store keeps a synced record whose replies
were never sent. Transactions come before groups (kera.coordinator.store.SECTIONS says why).
`meta/format` comes after every other put: a first snapshot cut short is no state at all.

A replica entry's position in its broker's table (oldest first: the order eviction forgets
them in) is kept in its value, `[seq, backups]`: `seq` grows with every put (a put is written
even when its backups did not change, as the table moves the entry last), and a load orders
each broker's entries by it.
"""

from __future__ import annotations

import json

from kera.coordinator.store import SECTIONS, Replay, split
from kera.errors import StorageError

# etcd's defaults: --max-txn-ops 128 (operations in one transaction) and --max-request-bytes
# 1.5 MiB (checked on the decoded request, after the JSON gateway's base64). A batch stays under
# both; its bytes budget leaves a third of the request for the framing and the compare.
TXN_OPS_MAX = 128
ETCD_REQUEST_BYTES_MAX = 3 * 512 * 1024
TXN_BYTES_MAX = ETCD_REQUEST_BYTES_MAX * 2 // 3
OP_OVERHEAD_BYTES = 16   # an operation's framing in the request, beyond its key and value

META, REPLICAS = "meta", "replicas"
NAMESPACES = (META, *SECTIONS, REPLICAS)
# The key whose presence says a state is stored: written after every other put, so a first
# snapshot cut short loads as a first start again.
FORMAT_KEY = f"{META}/format"
# Write order (see the module docstring): puts by namespace, FORMAT_KEY, deletions in reverse.
_PUT_RANK = {ns: rank for rank, ns in enumerate(NAMESPACES)}
_FORMAT_RANK = len(NAMESPACES)
_DEL_RANK = {ns: _FORMAT_RANK + 1 + rank for rank, ns in enumerate(reversed(NAMESPACES))}


def encode(value) -> str:
    """A value's stored form: compact, keys sorted, so equal values compare equal as text."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def base_keys(base: dict) -> dict[str, str]:
    """The keys (below the prefix) and encoded values of a base state (replicas aside)."""
    parts = split(base)
    out = {f"{META}/{k}": encode(v) for k, v in parts["scalars"].items()}
    for section in SECTIONS:
        out.update((f"{section}/{key}", encode(v)) for key, v in parts[section].items())
    return out


def replica_key(broker_id: int, vlog: int, vseg: int) -> str:
    return f"{REPLICAS}/{broker_id}/{vlog}/{vseg}"


class ReplicaSeq:
    """The next `seq` of a replica entry's value (module docstring)."""

    def __init__(self, first: int = 0):
        self.next = first

    def value(self, backups: list) -> str:
        self.next += 1
        return encode([self.next - 1, backups])


def snapshot_writes(stored: dict[str, str], state: dict, seq: ReplicaSeq) -> dict:
    """The writes turning `stored` into a whole `state` (Coordinator.to_state). The replica
    entries are written again, renumbered, only when some broker's table differs."""
    new = base_keys({k: v for k, v in state.items() if k != "replicas"})
    writes: dict[str, str | None] = {k: v for k, v in new.items() if stored.get(k) != v}
    writes.update((k, None) for k in stored
                  if k not in new and not k.startswith(REPLICAS + "/"))
    old_tables = _stored_tables(stored)
    new_tables = {int(bid): [(replica_key(int(bid), vlog, vseg), backups)
                             for vlog, vseg, backups in entries]
                  for bid, entries in state.get("replicas", {}).items() if entries}
    if old_tables != new_tables:
        writes.update((k, None) for table in old_tables.values() for k, _ in table)
        for key, backups in (e for table in new_tables.values() for e in table):
            writes.pop(key, None)   # the put, in table order, after the deletions
            writes[key] = seq.value(backups)
    return writes


def _stored_tables(stored: dict[str, str]) -> dict[int, list[tuple[str, list]]]:
    """Each broker's replica entries in `stored`, oldest first: {bid: [(key, backups)]}."""
    entries = []
    for key, value in stored.items():
        if key.startswith(REPLICAS + "/"):
            seq, backups = json.loads(value)
            entries.append((seq, key, backups))
    tables: dict[int, list] = {}
    for _, key, backups in sorted(entries):
        tables.setdefault(int(key.split("/")[1]), []).append((key, backups))
    return tables


def load_state(kvs: list[tuple[str, str]]) -> tuple[dict | None, int]:
    """The state stored as `kvs` ((key below the prefix, value)), in Coordinator.to_state
    shape, None when it holds no state (a first start); and the next replica `seq`."""
    replay = Replay({"members": {}, "streams": [], "groups": [], "transactions": []})
    replicas = []
    for key, value in kvs:
        namespace, _, rest = key.partition("/")
        if namespace == META:
            replay.parts["scalars"][rest] = json.loads(value)
        elif namespace in SECTIONS:
            replay.apply(["put", namespace, rest, json.loads(value)])
        elif namespace == REPLICAS:
            bid, vlog, vseg = (int(x) for x in rest.split("/"))
            seq, backups = json.loads(value)
            replicas.append((seq, bid, vlog, vseg, backups))
    if "format" not in replay.parts["scalars"]:
        return None, 0
    for _, bid, vlog, vseg, backups in sorted(replicas):
        replay.apply(["rput", bid, vlog, vseg, backups])
    return replay.state(), max((r[0] for r in replicas), default=-1) + 1


def plan(stored: dict[str, str], base: dict | None, replica_changes: list[list],
         seq: ReplicaSeq) -> dict:
    """The writes turning `stored` (key -> encoded value, what etcd holds) into the state after
    a commit: {key: encoded value, or None to delete}. Each key once (etcd refuses a
    transaction that writes a key twice)."""
    writes: dict[str, str | None] = {}
    if base is not None:
        new = base_keys(base)
        writes.update((k, v) for k, v in new.items() if stored.get(k) != v)
        writes.update((k, None) for k in stored
                      if k not in new and not k.startswith(REPLICAS + "/"))
    for change in replica_changes:
        _plan_replica_change(stored, writes, change, seq)
    return writes


def _plan_replica_change(stored: dict, writes: dict, change: list, seq: ReplicaSeq) -> None:
    kind = change[0]
    if kind == "rput":
        key = replica_key(*change[1:4])
        writes.pop(key, None)    # moves it last: batches keep this order
        writes[key] = seq.value(change[4])
    elif kind == "rdel":
        writes[replica_key(*change[1:4])] = None
    elif kind == "rclear":
        prefix = f"{REPLICAS}/{change[1]}/"
        writes.update((k, None) for k in (*stored, *writes) if k.startswith(prefix))
    else:
        raise ValueError(f"unknown replica change {kind!r}")


def apply(stored: dict[str, str], writes: dict) -> None:
    """Make `stored` what etcd holds once `writes` are written."""
    for key, value in writes.items():
        if value is None:
            stored.pop(key, None)
        else:
            stored[key] = value


def batches(writes: dict, ops_max: int = TXN_OPS_MAX,
            bytes_max: int = TXN_BYTES_MAX) -> list[list[tuple[str, str | None]]]:
    """`writes` in the safe order (module docstring), cut into batches of at most `ops_max`
    operations and `bytes_max` bytes. Raises StorageError for one entry too large for etcd."""
    ordered = sorted(writes.items(), key=_rank)
    out: list[list] = []
    size = 0
    for key, value in ordered:
        op_bytes = OP_OVERHEAD_BYTES + len(key) + len(value or "")
        if op_bytes > bytes_max:
            raise StorageError(f"metadata entry {key} takes {op_bytes} bytes, more than the "
                               f"{bytes_max} one etcd transaction carries here: start etcd with a "
                               f"larger --max-request-bytes and raise TXN_BYTES_MAX, or split "
                               f"the entry")
        if not out or len(out[-1]) >= ops_max or size + op_bytes > bytes_max:
            out.append([])
            size = 0
        out[-1].append((key, value))
        size += op_bytes
    return out


def _rank(item: tuple[str, str | None]) -> int:
    # A stable sort on the rank alone keeps replica puts in journal order (oldest first).
    key, value = item
    if key == FORMAT_KEY and value is not None:
        return _FORMAT_RANK
    namespace = key.partition("/")[0]
    ranks = _DEL_RANK if value is None else _PUT_RANK
    return ranks.get(namespace, len(_PUT_RANK) + len(_DEL_RANK))
