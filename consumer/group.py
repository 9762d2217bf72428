"""The consumer's side of its consumer group, called from the caller's threads: commits, the
group metadata a transactional producer sends with positions, the committed positions, and
leaving on close.

The membership itself (joining, heartbeats, assignment, queued commits) is the sans-IO task
kera.consumer.membership.Membership, driven by the request thread under the consumer's state
lock; this class hands it commits under that lock and wakes the request thread to send them.
What was handed out comes from the consumer's cache (kera.consumer.cache.Cache).
"""

from __future__ import annotations

import logging
from typing import Callable

from kera.codec.position import Position, Record
from kera.consumer.cache import Cache
from kera.consumer.membership import GroupMetadata, Membership, positions_from_wire, positions_to_wire
from kera.consumer.reading import Reading
from kera.errors import BadRequest, KeraError

log = logging.getLogger(__name__)


class GroupSide:
    def __init__(self, name: str, membership: Membership, reading: Reading, meta,
                 wake: Callable[[], None], request_timeout_s: float):
        self.name = name
        self.membership = membership
        self.reading = reading
        self.cache: Cache = reading.cache
        self.meta = meta                  # kera.client.metadata.Metadata: coordinator calls
        self.wake = wake                  # the request thread: a commit is queued
        self.request_timeout_s = request_timeout_s
        # group_metadata() as of the last chunk handed out (note_polled).
        self.polled_as: GroupMetadata | None = None

    def commit(self, held: list[Position], timeout_s: float | None, asynchronous: bool) -> None:
        """Queue a commit of `held`; wait for its outcome unless `asynchronous`."""
        with self.reading.lock:
            future = self.membership.commit(held)
        self.wake()
        if asynchronous:
            future.add_done_callback(_log_commit_failure)
            return
        future.result(self.request_timeout_s if timeout_s is None else timeout_s)

    def metadata(self) -> GroupMetadata:
        """This member's group, member id and epoch as of the last chunk handed out."""
        if self.polled_as is not None:
            return self.polled_as
        return GroupMetadata(self.name, self.membership.member_id, self.membership.member_epoch)

    def note_polled(self) -> None:
        """Remember who this member was when it handed out a chunk: group_metadata() answers
        that, not who it is now, so positions of records read before a rebalance or a
        coordinator restart (after which the request thread may already hold other parts,
        or none) are refused with them, as Kafka's metadata changes only at a poll."""
        m = self.membership
        self.polled_as = GroupMetadata(self.name, m.member_id, m.member_epoch)

    def committed(self, parts=None) -> list[Position]:
        """The group's committed positions (of `parts`, default every part it has)."""
        header, _ = self.meta.call("group_offsets", {"group": self.name},
                                   timeout_s=self.request_timeout_s)
        out = positions_from_wire(header["positions"])
        wanted = None if parts is None else {tuple(p) for p in parts}
        return [p for p in out if wanted is None or (p.stream, p.streamlet) in wanted]

    def leave(self) -> None:
        """On close: commit what was handed out (when auto-committing) and leave, so the
        group reassigns this consumer's streamlets at once instead of after its timeout."""
        m = self.membership
        if not m.member_id:
            return
        try:
            if m.auto_commit_s is not None and self.cache.parts():
                self.meta.call("group_commit", m.ids() | {
                    "positions": positions_to_wire(self.cache.positions())},
                    timeout_s=self.request_timeout_s)
            op, fields = m.leave_request()
            self.meta.call(op, fields, timeout_s=self.request_timeout_s)
        except KeraError as err:
            log.warning("group '%s': leaving failed (%s): the coordinator drops this member "
                        "after its session timeout", self.name, err)


def position_after(record: Record, held: list[Position]) -> list[Position]:
    """The position just after `record` (its group, the next offset) in the streamlet history
    of `held`, the consumer's positions there. With one active group per streamlet the groups
    below are finished once one of its records was read."""
    return [Position(record.stream, record.streamlet, record.group, record.offset + 1,
                     held[0].epoch if held else None)]


def needs_group(what: str) -> BadRequest:
    return BadRequest(f"{what} needs a consumer group: Consumer(..., group='name')")


def _log_commit_failure(future) -> None:
    """An asynchronous commit's outcome: a failure is logged (the caller did not wait)."""
    err = future.exception()
    if err is not None:
        log.warning("asynchronous commit failed: %s", err)
