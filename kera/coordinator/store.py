"""Durable coordinator metadata: a snapshot plus an append-only log of the changes since it.

`coordinator.json` is the snapshot (kera.daemon.durable.write_atomic: old or new, never torn); it names
its log generation g, and `coordinator-<g>.log` holds the changes made since, one record per
commit: u32 payload length, u32 crc32c of the payload, then the payload, a JSON list of changes
(`Changes`). A commit appends one record and fsyncs once, however many requests it covers
(the server commits once per loop turn), so a heartbeat costs a few hundred bytes on disk
instead of a rewrite of the whole replica map.

Loading replays the log over the snapshot. A record cut short or failing its checksum at the end
of the log is the write a crash interrupted (nothing acknowledged depends on it: a change is
replied to only after its record is synced): it is ignored with a warning and cut off. A bad
record with intact records after it is damage, and loading refuses.

A snapshot is taken at startup and whenever the log passes SNAPSHOT_LOG_BYTES: the next log
g+1 is created empty, the snapshot naming it is written, then log g is removed. Loading replays
the log the snapshot names and then, if it exists, the next one, so a crash at any point loses
nothing. That lets a snapshot run off the loop (`start_snapshot`): the loop switches its appends
to log g+1 at once, and a thread writes the snapshot of the state at the switch (a copy of the
replica tables, whose entries are replaced, never changed in place) and removes log g. Applying a
change sets a value (never adds to one), so replaying a record twice would change nothing.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from pathlib import Path

from kera.codec.chunk import crc32c
from kera.daemon.durable import fsync_dir, unlink_durable, write_atomic

log = logging.getLogger(__name__)

STATE_FILE = "coordinator.json"
STATE_BYTES_MAX = 256 * 1024 * 1024  # refuse to parse anything absurd
# A log past this is folded into a snapshot: it bounds the replay at startup (a few seconds)
# and the disk the log takes, while a snapshot (a rewrite of everything) stays rare: at ~200
# bytes per heartbeat record, 4 brokers reporting 10 times a second fill it in about 4 hours.
SNAPSHOT_LOG_BYTES = 64 * 1024 * 1024
RECORD_BYTES_MAX = STATE_BYTES_MAX   # one commit's record, at most (a whole state's worth)
_RECORD_HEADER = struct.Struct("<II")   # payload length, crc32c of the payload
# Keyed sections of the state; the rest is `scalars`. Transactions before groups: etcd writes
# sections in this order (kera.coordinator.etcd_keys), and should a commit decision's change be
# split across etcd batches, a crash between them keeps the decision without its positions
# (the consumer's input is read again: duplicates) rather than positions without a decision
# (a timeout would abort the output while its input counts as consumed: loss).
SECTIONS = ("members", "streams", "transactions", "groups")
# A snapshot written off the loop encodes the replica map this many entries per json call,
# yielding between calls: json's C encoder holds the GIL for a whole call, and one call over the
# map at its limit held the coordinator's loop ~320 ms. Each call now takes a few ms.
SNAPSHOT_ENCODE_ENTRIES = 5_000


def log_name(generation: int) -> str:
    return f"coordinator-{generation}.log"


# --------------------------------------------------------------------------- state shapes

def split(state: dict) -> dict:
    """A state (Coordinator.to_state shape, replicas aside) as keyed sections, so two states
    compare section by section: {"scalars": {...}, "members": {"kind/id": m},
    "streams": {name: s}, "groups": {name: g}, "transactions": {id: t}}."""
    out = {"scalars": {k: v for k, v in state.items() if k not in SECTIONS and k != "replicas"},
           "members": {f"{kind}/{m['id']}": m for kind, ms in state["members"].items() for m in ms},
           "streams": {s["name"]: s for s in state["streams"]},
           # Consumer groups' committed positions: absent in states written before groups.
           "groups": {g["name"]: g for g in state.get("groups", [])},
           # Transactional ids (kera.coordinator.transactions): absent before transactions.
           "transactions": {t["id"]: t for t in state.get("transactions", [])}}
    return out


def diff(old: dict, new: dict) -> list[list]:
    """Changes turning split state `old` into `new`."""
    changes: list[list] = []
    if old["scalars"] != new["scalars"]:
        changes.append(["scalars", new["scalars"]])
    for section in SECTIONS:
        before, after = old[section], new[section]
        changes += [["put", section, key, value] for key, value in after.items()
                    if before.get(key) != value]
        changes += [["del", section, key] for key in before if key not in after]
    return changes


class Replay:
    """A state being rebuilt: the snapshot, then the changes of each log record in order."""

    def __init__(self, state: dict):
        self.parts = split(state)
        self.replicas: dict[int, dict[tuple[int, int], list]] = {
            int(bid): {(vlog, vseg): backups for vlog, vseg, backups in entries}
            for bid, entries in state.get("replicas", {}).items()}

    def apply(self, change: list) -> None:
        kind = change[0]
        if kind == "scalars":
            self.parts["scalars"] = change[1]
        elif kind == "put":
            self.parts[change[1]][change[2]] = change[3]
        elif kind == "del":
            self.parts[change[1]].pop(change[2], None)
        elif kind == "rput":    # [rput, broker, vlog, vseg, backups]: moves it last (newest)
            table = self.replicas.setdefault(change[1], {})
            table.pop((change[2], change[3]), None)
            table[(change[2], change[3])] = change[4]
        elif kind == "rdel":
            self.replicas.get(change[1], {}).pop((change[2], change[3]), None)
        elif kind == "rclear":
            self.replicas.pop(change[1], None)
        else:
            raise ValueError(f"unknown change {kind!r} in the coordinator log")

    def state(self) -> dict:
        state = dict(self.parts["scalars"])
        members: dict[str, list] = {}
        for key, m in sorted(self.parts["members"].items(), key=lambda kv: _member_key(kv[0])):
            members.setdefault(key.split("/")[0], []).append(m)
        for kind in state.get("next_member_id", {}):
            members.setdefault(kind, [])
        state["members"] = members
        state["streams"] = [s for _, s in sorted(self.parts["streams"].items())]
        state["groups"] = [g for _, g in sorted(self.parts["groups"].items())]
        state["transactions"] = [t for _, t in sorted(self.parts["transactions"].items())]
        state["replicas"] = {str(bid): [[vlog, vseg, b] for (vlog, vseg), b in table.items()]
                             for bid, table in sorted(self.replicas.items()) if table}
        return state


def _member_key(key: str) -> tuple[str, int]:
    kind, member_id = key.split("/")
    return kind, int(member_id)


# --------------------------------------------------------------------------- the store

class MetadataStore:
    """The coordinator's files in one directory: load once, then commit changes."""

    def __init__(self, data_dir: str | os.PathLike):
        self.dir = Path(data_dir)
        self.generation = 0
        self.log_bytes = 0
        self._fd: int | None = None
        self._base: dict | None = None    # split form of what is on disk (replicas aside)
        self._writer: threading.Thread | None = None   # a snapshot being written off the loop
        self._writer_error: OSError | None = None

    # ------------------------------------------------------------------ loading
    def load(self) -> dict | None:
        """The last committed state, or None when the directory holds none (first start).
        Raises ValueError on metadata that cannot be trusted."""
        snapshot = _read_snapshot(self.dir / STATE_FILE)
        if snapshot is None:
            return None
        generation = snapshot.pop("log_generation", 0)
        if not isinstance(generation, int) or generation < 0:
            raise ValueError(f"{STATE_FILE}: bad log_generation {generation!r}")
        self.generation = generation
        replay = Replay(snapshot)
        # The log the snapshot names, then the next one if a snapshot was being written when
        # the coordinator stopped (see the module docstring).
        for g in (generation, generation + 1):
            path = self.dir / log_name(g)
            try:
                for changes in read_log(path):
                    for change in changes:
                        replay.apply(change)
            except (TypeError, KeyError, IndexError, AttributeError) as exc:
                raise ValueError(f"{path}: malformed change: {exc.__class__.__name__}: "
                                 f"{exc}") from None
            if path.exists():
                self.generation = g
        return replay.state()

    # ------------------------------------------------------------------ writing
    def snapshot(self, state: dict) -> None:
        """Write `state` whole (Coordinator.to_state) and start an empty log after it."""
        self.close_writer()
        generation = self.generation + 1
        new_fd = _create_log(self.dir / log_name(generation))
        data = json.dumps({**state, "log_generation": generation}, separators=(",", ":"),
                          sort_keys=True).encode()
        try:
            write_atomic(self.dir / STATE_FILE, data)
        except OSError:
            os.close(new_fd)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.generation, self.log_bytes = new_fd, generation, 0
        self._base = split(state)
        self._remove_stale_logs(keep=generation)
        log.info("metadata snapshot %d written (%d bytes)", generation, len(data))

    def start_snapshot(self, base: dict, replica_tables: dict) -> None:
        """Switch appends to a new log now and write the snapshot of `base` (Coordinator.
        base_state) + `replica_tables` ({broker id: {(vlog, vseg): backups}}, copies) on a
        thread. Commit what is pending first: the new log starts from this state."""
        assert self._writer is None, "one snapshot at a time"
        generation = self.generation + 1
        new_fd = _create_log(self.dir / log_name(generation))
        os.close(self._fd)
        self._fd, self.generation, self.log_bytes = new_fd, generation, 0
        self._writer = threading.Thread(target=self._write_snapshot,
                                        args=(base, replica_tables, generation),
                                        name="coordinator-snapshot", daemon=True)
        self._writer.start()

    def _write_snapshot(self, base: dict, replica_tables: dict, generation: int) -> None:
        try:
            data = encode_snapshot({**base, "log_generation": generation}, replica_tables)
            write_atomic(self.dir / STATE_FILE, data)
            unlink_durable(self.dir / log_name(generation - 1))
            log.info("metadata snapshot %d written (%d bytes)", generation, len(data))
        except OSError as exc:
            self._writer_error = exc

    def snapshot_running(self) -> bool:
        """Whether a snapshot is being written; raises the OSError of one that failed."""
        if self._writer is not None and not self._writer.is_alive():
            self._writer.join()
            self._writer = None
            if self._writer_error is not None:
                error, self._writer_error = self._writer_error, None
                raise error
        return self._writer is not None

    def commit(self, base: dict | None, replica_changes: list[list]) -> int:
        """Append the changes since the last commit: `base` is the state without replicas
        (Coordinator.base_state) when it may have changed, else None. Returns the bytes
        appended (0: nothing changed). Raises OSError."""
        assert self._fd is not None and self._base is not None, "snapshot() first"
        changes = list(replica_changes)
        if base is not None:
            new = split(base)
            changes = diff(self._base, new) + changes
            self._base = new
        if not changes:
            return 0
        payload = json.dumps(changes, separators=(",", ":")).encode()
        if len(payload) > RECORD_BYTES_MAX:
            raise OSError(f"a commit of {len(payload)} bytes exceeds {RECORD_BYTES_MAX}")
        record = _RECORD_HEADER.pack(len(payload), crc32c(payload)) + payload
        view = memoryview(record)
        while view:
            view = view[os.write(self._fd, view):]
        os.fdatasync(self._fd)
        self.log_bytes += len(record)
        return len(record)

    def wants_snapshot(self) -> bool:
        return self.log_bytes > SNAPSHOT_LOG_BYTES and not self.snapshot_running()

    def close_writer(self) -> None:
        """Wait for a snapshot being written (raises the OSError it failed with)."""
        if self._writer is not None:
            self._writer.join()
            self.snapshot_running()

    def close(self) -> None:
        self.close_writer()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _remove_stale_logs(self, keep: int) -> None:
        for path in self.dir.glob("coordinator-*.log"):
            if path.name != log_name(keep):
                unlink_durable(path)


def encode_snapshot(base: dict, replica_tables: dict) -> bytes:
    """The snapshot file of `base` plus its `replicas` ({broker id: {(vlog, vseg): backups}}),
    the map encoded in steps of SNAPSHOT_ENCODE_ENTRIES that let the loop's thread run between
    them (the same JSON as one json.dumps of the whole, but for where `replicas` stands)."""
    tables = []
    for bid, table in sorted(replica_tables.items()):
        entries = [[vlog, vseg, b] for (vlog, vseg), b in table.items()]
        steps = []
        for i in range(0, len(entries), SNAPSHOT_ENCODE_ENTRIES):
            steps.append(json.dumps(entries[i:i + SNAPSHOT_ENCODE_ENTRIES],
                                    separators=(",", ":"))[1:-1])
            time.sleep(0)   # yield the GIL to the loop
        if entries:
            tables.append(f'"{bid}":[' + ",".join(steps) + "]")
    head = json.dumps(base, separators=(",", ":"), sort_keys=True)
    replicas = '"replicas":{' + ",".join(tables) + "}"
    return (head[:-1] + ("," if len(head) > 2 else "") + replicas + "}").encode()


def _create_log(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        os.fsync(fd)
        fsync_dir(path.parent)
    except OSError:
        os.close(fd)
        raise
    return fd


def _read_snapshot(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(STATE_BYTES_MAX + 1)
    except FileNotFoundError:
        return None
    if len(raw) > STATE_BYTES_MAX:
        raise ValueError(f"{path} exceeds {STATE_BYTES_MAX} bytes")
    try:
        state = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return state


def read_log(path: Path) -> list[list]:
    """The change lists of the log's intact records. A torn last record is cut off (with a
    warning); a bad record followed by more data raises ValueError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records, at = [], 0
    while at < len(data):
        end = _record_end(data, at)
        if end is None:
            return _torn(path, data, at, records)
        payload = data[at + _RECORD_HEADER.size:end]
        if crc32c(payload) != _RECORD_HEADER.unpack_from(data, at)[1]:
            if end < len(data):
                raise ValueError(f"{path}: record at byte {at} fails its checksum and is not the "
                                 f"last: the log is damaged (restore the directory from a copy)")
            return _torn(path, data, at, records)
        try:
            records.append(json.loads(payload))
        except ValueError as exc:
            raise ValueError(f"{path}: record at byte {at} is not JSON: {exc}") from None
        at = end
    return records


def _record_end(data: bytes, at: int) -> int | None:
    if at + _RECORD_HEADER.size > len(data):
        return None
    length, _ = _RECORD_HEADER.unpack_from(data, at)
    end = at + _RECORD_HEADER.size + length
    return end if length <= RECORD_BYTES_MAX and end <= len(data) else None


def _torn(path: Path, data: bytes, at: int, records: list) -> list:
    log.warning("%s: ignoring a torn last record (%d bytes at byte %d): a commit a crash cut "
                "short, never acknowledged", path, len(data) - at, at)
    with open(path, "r+b") as f:
        f.truncate(at)
        os.fsync(f.fileno())
    return records


# --------------------------------------------------------------------------- compatibility

def load(data_dir: str | os.PathLike) -> dict | None:
    """The last committed state of `data_dir` (snapshot + log), or None on a first start."""
    return MetadataStore(data_dir).load()


def save(data_dir: str | os.PathLike, state: dict) -> None:
    """Write `state` as a fresh snapshot with an empty log (tools and tests)."""
    store = MetadataStore(data_dir)
    existing = _read_snapshot(Path(data_dir) / STATE_FILE)
    if existing is not None:
        store.generation = existing.get("log_generation", 0)
    store.snapshot(state)
    store.close()
