"""A daemon's identity as it remembers it: cluster, id, incarnation token, stream-id mark.

Brokers and backups keep it in memory, and in DIR/identity.json when they have a data directory
(replaced atomically with kera.daemon.durable.write_atomic), so a restarted process presents the same
cluster id and, for the same id, the token of its previous incarnation when it registers
(kera.coordinator.core checks both). `stream_id_mark` is the highest stream id the daemon has
seen: the coordinator never issues an id at or below one a daemon reports.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kera.daemon.durable import write_atomic

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.json"
IDENTITY_BYTES_MAX = 4096   # a few short fields: anything bigger is not ours
TEXT_CHARS_MAX = 64         # token and cluster id: hex of 16 random bytes is 32
STREAM_ID_MAX = 2**64 - 1


@dataclass(slots=True)
class Identity:
    directory: Path | None = None   # None: remembered in memory only
    cluster_id: str | None = None
    daemon_id: int | None = None
    token: str | None = None
    stream_id_mark: int = 0
    # The cluster this daemon was started for (--cluster-id): sent at every register, so a
    # coordinator of another cluster refuses it. Not persisted: the flag is given each start.
    expected_cluster_id: str | None = None

    @classmethod
    def load(cls, directory: str | os.PathLike | None) -> "Identity":
        """What `directory` remembers (nothing on a first start); raises ValueError on a file
        that is not one this module wrote (the daemon must not guess its identity)."""
        ident = cls(Path(directory) if directory is not None else None)
        if ident.directory is None:
            return ident
        path = ident.directory / IDENTITY_FILE
        try:
            with open(path, "rb") as f:
                raw = f.read(IDENTITY_BYTES_MAX + 1)
        except FileNotFoundError:
            return ident
        try:
            state = json.loads(raw) if len(raw) <= IDENTITY_BYTES_MAX else None
            ident.cluster_id = _text(state.get("cluster_id"))
            ident.token = _text(state.get("token"))
            ident.daemon_id = _int(state.get("daemon_id"), None)
            ident.stream_id_mark = _int(state.get("stream_id_mark", 0), 0)
        except (ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"{path} is damaged ({exc}): restore it, or remove it to register "
                             f"as a new daemon") from None
        return ident

    def register_fields(self, daemon_id: int | None) -> dict:
        """Fields of a `register` asking for `daemon_id`: the token only for the same id."""
        fields: dict = {}
        if self.cluster_id is not None:
            fields["cluster_id"] = self.cluster_id
        if self.expected_cluster_id is not None:
            fields["expect_cluster_id"] = self.expected_cluster_id
        if self.token is not None and daemon_id is not None and daemon_id == self.daemon_id:
            fields["token"] = self.token
        if self.stream_id_mark:
            fields["stream_id_mark"] = self.stream_id_mark
        return fields

    def registered(self, daemon_id: int, token, cluster_id) -> None:
        """A `register` reply: remember (and persist) the incarnation and the cluster."""
        self.daemon_id = daemon_id
        self.token = _text(token)
        self.cluster_id = _text(cluster_id) or self.cluster_id
        self.save()

    def expect_cluster(self, cluster_id: str | None) -> None:
        """Bind this daemon to `cluster_id` (None: any); ValueError when its data is of
        another cluster."""
        if cluster_id is None:
            return
        if self.cluster_id is not None and self.cluster_id != cluster_id:
            raise ValueError(f"--cluster-id {cluster_id}, but this daemon's data directory "
                             f"holds data of cluster {self.cluster_id}")
        self.expected_cluster_id = cluster_id

    def saw_stream(self, stream_id: int) -> None:
        if stream_id > self.stream_id_mark:
            self.stream_id_mark = stream_id
            self.save()

    def save(self) -> None:
        """Raises OSError (the caller's daemon cannot keep its identity: it must stop)."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {"cluster_id": self.cluster_id, "daemon_id": self.daemon_id,
                 "token": self.token, "stream_id_mark": self.stream_id_mark}
        write_atomic(self.directory / IDENTITY_FILE, json.dumps(state).encode())


def _text(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= TEXT_CHARS_MAX:
        raise ValueError(f"expected a short string, got {value!r}")
    return value


def _int(value, default):
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= STREAM_ID_MAX:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
