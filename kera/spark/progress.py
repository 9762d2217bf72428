"""The streaming source's progress committed to a consumer group (option `group`).

After Spark commits a micro-batch, the source commits the batch's end positions to the group on
the coordinator, so `kera group describe` and the lag metric show how far the query is behind.
Spark calls the source's `commit(end)` of a batch only when it plans the *next* batch (so the
last batch before an idle spell, or before an availableNow query stops, would never be
committed); but the `start` that Spark hands `latestOffset` is exactly the end of the last batch
in its commit log, asked on every trigger. The source commits both, skipping repeats.
Spark's checkpoint stays the source of truth, as with Spark's Kafka source: a restarted query
resumes from its checkpoint, never from the group, and a commit that fails for a passing reason
(coordinator away) is logged and superseded by the next batch's.

The query commits as a non-member (no member id): the coordinator accepts that only while the
group has no live members, so a group that kera consumers use is refused (`group_not_empty`)
and the query fails, rather than both overwriting each other's positions.
"""

from __future__ import annotations

import json
import logging

from kera.client.coordinator_client import CoordinatorClient
from kera.errors import KeraError
from kera.spark import offsets as ko

log = logging.getLogger(__name__)


class ProgressCommits:
    """Commits a query's progress to `group`, each distinct offset once. Holds no socket."""

    def __init__(self, bootstrap: str, group: str, timeout_s: float, key_file: str | None = None):
        self.bootstrap, self.group, self.timeout_s = bootstrap, group, timeout_s
        self.key_file = key_file   # CURVE key (option keyFile); None: $KERA_KEY_FILE or plaintext
        self._last: str | None = None   # canonical JSON of the offset committed last

    def commit(self, end, snapshot) -> None:
        """Commit a source offset (a batch's end) unless it was the last one committed."""
        offsets = ko.from_json(end)
        key = json.dumps(ko.to_json(offsets))
        if key != self._last:
            commit_progress(self.bootstrap, self.group, offsets, snapshot, self.timeout_s,
                            self.key_file)
            self._last = key


def commit_progress(bootstrap: str, group: str, offsets: dict, snapshot,
                    timeout_s: float, key_file: str | None = None) -> None:
    """Commit the positions of a source offset ({stream: StreamOffset}) to `group`;
    `snapshot(stream) -> (info, {sl: groups})` gives a stream's id and groups (asked only when
    a cursor needs the final offsets of finished groups)."""
    positions = wire_positions(offsets, snapshot)
    if not positions:
        return
    client = CoordinatorClient(bootstrap, timeout_s=timeout_s, key_file=key_file)
    try:
        client.call("group_commit", {"group": group, "member_id": "", "member_epoch": 0,
                                     "positions": positions})
    except KeraError as err:
        if not err.retriable:
            raise      # group_not_empty, bad_request: the query's configuration is wrong
        log.warning("committing progress to group %r failed (%s); the next batch's commit "
                    "supersedes it", group, err)
    finally:
        client.close()


def wire_positions(offsets: dict, snapshot) -> list[list]:
    """group_commit's [[stream, sl, [[g, off, epoch], ...]], ...] of a source offset. A
    stream whose groups had to be asked for and turned out recreated is left out (its cursors
    name the old stream's groups); otherwise that is found by the query's next batch, whose
    commit then replaces these positions."""
    out = []
    for stream, offset in sorted(offsets.items()):
        cursors = offset.cursors
        groups: dict = {}
        if any(ko.finished_below_next(c) for c in cursors.values()):
            info, groups = snapshot(stream)
            if offset.stream_id is not None and info.id != offset.stream_id:
                continue    # the stream was recreated: these cursors are of the old one
        out += [[stream, sl, ko.group_positions(c, groups.get(sl))]
                for sl, c in sorted(cursors.items())]
    return out
