"""A streamlet's history epoch: which history of the streamlet a position points into.

A streamlet's history begins when its first chunk is stored on an owner that holds nothing of
it. The epoch names that beginning with a number the coordinator issued: the owner's
incarnation epoch at that moment (kera.broker.recovery). It stays the same while the history
continues and changes when the history restarts empty:

* R>=2: the history survives the loss of any one copy (failover rebuilds it from backups), so
  its epoch is the constant `REPLICATED_EPOCH`. Losing every copy at once is outside what the
  store promises and is not detected by the epoch.
* R=1: the epoch is the owner's incarnation epoch when the history began, kept in the
  streamlet's directory of the data dir (`EPOCH_FILE`) and read again when a restart reloads
  the streamlet's segments. A broker restarted without its data starts a new history, under
  its new incarnation epoch: positions into the old one are refused (`position_lost`).

A streamlet reloaded from segment files with no epoch file (written by older code) gets
`UNKNOWN_EPOCH`; positions without an epoch (saved by older code) are not checked.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kera.broker.tier_files import streamlet_dir
from kera.daemon.durable import write_atomic

log = logging.getLogger(__name__)

REPLICATED_EPOCH = 0
UNKNOWN_EPOCH = 0
EPOCH_FILE = "history_epoch"
# Longest epoch file accepted, in bytes: a decimal 64-bit integer and a newline.
EPOCH_FILE_BYTES_MAX = 21


def epoch_for_new_history(replication: int, incarnation_epoch: int | None) -> int:
    return REPLICATED_EPOCH if replication > 1 else (incarnation_epoch or UNKNOWN_EPOCH)


def write(root: Path, stream_id: int, streamlet: int, epoch: int) -> None:
    """Record the epoch of a history that just began (before its first chunk is acked)."""
    directory = streamlet_dir(Path(root), stream_id, streamlet)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / EPOCH_FILE, f"{epoch}\n".encode())


def read(root: Path, stream_id: int, streamlet: int) -> int:
    """The recorded epoch of a streamlet found on disk; UNKNOWN_EPOCH if none or unreadable."""
    path = streamlet_dir(Path(root), stream_id, streamlet) / EPOCH_FILE
    try:
        with open(path, "rb") as f:
            text = f.read(EPOCH_FILE_BYTES_MAX + 1).strip()
    except FileNotFoundError:
        return UNKNOWN_EPOCH
    except OSError as err:
        log.error("history epoch of stream id %d streamlet %d unreadable: %s", stream_id,
                  streamlet, err)
        return UNKNOWN_EPOCH
    if not text.isdigit() or len(text) > EPOCH_FILE_BYTES_MAX:
        log.error("history epoch file %s is malformed: %r", path, text[:40])
        return UNKNOWN_EPOCH
    return int(text)
