"""Retention: deleting whole groups of streams that keep data for a time or up to a size, and
freeing the backup replicas nothing references any more.

Rules (per streamlet, stream descriptor fields `retention_ms` / `retention_bytes`, 0 = no
limit):

- Only *finished* groups (closed, every record durable) are deleted, and only from the oldest
  one up: the retained groups of a streamlet always are `first_group, first_group + 1, ...`,
  so a reader's position is either retained or before `first_group` (refused with
  `offset_out_of_range`).
- By time: a group whose last append is more than `retention_ms` ago, by the retention clock
  (below).
  So that an open group cannot keep data forever, an active group whose first append is more
  than `retention_ms` ago is closed (its slot's next chunk opens a new group): data lives at
  most about twice `retention_ms`.
- By size: the oldest groups while the streamlet still holds at least `retention_bytes`
  without them (as Kafka's retention.bytes: a streamlet may exceed it by up to one group).
- Until consumed (`retain_until_consumed`, Pravega's consumption-based retention): by time
  only groups every consumer group of the stream has committed past (the coordinator's
  `consumed` marks, kera.coordinator.groups.consumed_below, sent in heartbeat replies); with
  `retention_ms` 0, as soon as they are. The size bound applies regardless, so unconsumed data
  cannot outgrow `retention_bytes`; a stream nobody consumes keeps its data up to it.
- On request (Kafka's DeleteRecords: `delete_below`): the groups wholly below a record
  number, under the same rules; what must wait (durability, a floor) is retried each pass.
- Only under a cleanup policy that deletes (`delete`, `compact,delete`: kera.codec.cleanup): a
  `compact`-only stream keeps every key's last record however old, as Kafka does.

The retention clock (`RetentionClock`) is the wall clock at the broker's start advanced by the
monotonic clock, so a wall-clock step cannot collapse ages within a process: group stamps and
ages come from it. When the wall clock moves more than `CLOCK_STEP_THRESHOLD_MS` away from it,
the step is logged and not followed. After a restart (a step while the broker was down cannot
be told from downtime) one pass deletes at most `GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX` groups
by age until it caught up, each such pass with a warning, so a wrong clock at start is noticed
before it deleted much; reloaded stamps later than the clock are clamped to it
(kera.broker.reload), so a reloaded group's age is never more than its files say. Groups
rebuilt by recovery are stamped at recovery, not by their records' (producer-chosen)
timestamps: a failover never makes data older.

A slot's last group goes only once the coordinator holds the slot's *number floor* (its next
record number, and the streamlet's next group id when no group is left; kera.codec.schema), sent in
heartbeats: otherwise a failover right after would find nothing to continue the numbering from
(`_floor_kept`).

A deleted group's segments leave memory or disk (kera.broker.tier). A virtual segment whose
every referenced chunk is gone (retention, or its stream deleted) is of no use on its backups:
each of them is sent `drop_replica`, and the broker forgets the segment's references.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict, deque
from itertools import islice
from typing import NamedTuple, Protocol

from kera.codec import cleanup, schema
from kera.errors import BadRequest

log = logging.getLogger(__name__)

DELETED_ENDS_MAX = 256   # per streamlet: ends of the latest deleted groups (see `gone`)
# Number floors (kera.codec.schema.number_floor) sent in one heartbeat at most; the rest go in the
# next ones. A floor is a few numbers per streamlet, so this keeps a heartbeat small.
FLOORS_PER_HEARTBEAT_MAX = 256
# Floors remembered as acknowledged (so not sent again): one per streamlet ever emptied here.
# Past this many (streams deleted since) the memory is dropped: each is then sent once more.
FLOORS_KEPT_MAX = 65_536
# Wall and monotonic clocks drifting apart by more than this between two readings is a step,
# not a slew: NTP slews by at most 0.5 ms/s, and readings are a loop turn (well under 1 s) apart.
CLOCK_STEP_THRESHOLD_MS = 5_000
# Groups one retention pass (every 0.5 s) may delete by age after a step or a restart, until
# it deletes fewer: ~16 groups/s, so a mistaken step of the clock is in the log well before a
# streamlet of hundreds of groups is gone; data past retention is still deleted, slowly.
GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX = 8


class RetentionClock:
    """Retention's time in ms: the wall clock read once at start plus the monotonic time since.

    Within a process ages follow the monotonic clock only, so a step of the wall clock (either
    way) neither ages nor rejuvenates anything; the step is logged so an operator sees the two
    clocks disagree. A restart anchors on the wall clock again: reloaded stamps are clamped
    (kera.broker.reload) and, while `suspect`, a pass deletes at most
    GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX groups by age, so a wrong clock at start is in the
    log well before much is gone."""
    __slots__ = ("wall0_ms", "mono0_ms", "now_ms", "suspect", "steps", "_offset_ms")

    def __init__(self):
        self.wall0_ms: int | None = None
        self.mono0_ms = 0
        self.now_ms = 0
        # After a restart: deletions by age are bounded until they caught up.
        self.suspect = True
        self.steps = 0
        self._offset_ms = 0   # wall clock minus retention time at the last logged step

    def update(self, wall_ms: int, mono_ms: int | None = None) -> int:
        """Read both clocks; `mono_ms` None: the caller has one clock only (tests), trusted."""
        if mono_ms is None:
            self.wall0_ms, self.mono0_ms = wall_ms, wall_ms
            mono_ms = wall_ms
        elif self.wall0_ms is None:
            self.wall0_ms, self.mono0_ms = wall_ms, mono_ms
        now = self.wall0_ms + mono_ms - self.mono0_ms
        offset = wall_ms - now
        if abs(offset - self._offset_ms) > CLOCK_STEP_THRESHOLD_MS:
            self.steps += 1
            self._offset_ms = offset
            log.warning("the wall clock stepped: it is now %+.1f s from retention's clock, "
                        "which keeps aging groups by the monotonic clock (a restart adopts the "
                        "wall clock, deleting at most %d groups by age per pass until caught "
                        "up)", offset / 1000, GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX)
        self.now_ms = now
        return now


class ReplicaDrop(NamedTuple):
    """A `drop_replica` request to send to one backup."""
    backup_id: int
    address: str
    fields: dict


def group_bytes(group) -> int:
    return sum(seg.used_bytes for seg in group.segments)


class RetentionHost(Protocol):
    """What retention needs of the broker core (kera.broker.core.Broker), and nothing more."""
    broker_id: int | None
    streams: dict          # sid -> the broker's Stream (info, streamlets)
    tier: object           # kera.broker.tier.Tier: segment_deleted, record_first_group
    counters: object       # kera.daemon.metrics.Counters
    placement: object      # kera.broker.placement.Placement: close_group


class Retention:
    def __init__(self, broker: RetentionHost):
        self.broker = broker
        self.clock = RetentionClock()
        self._by_age_left: int | None = None   # deletions by age left in this pass (bounded)
        # (sid, sl) -> {group id: its end offset}, for the latest deleted groups only.
        self.deleted_ends: dict[tuple[int, int], OrderedDict] = {}
        self._vseg_segs: dict = {}       # VirtualSegment -> distinct segments it references
        self._drop_from: dict = {}       # VirtualLog -> vsegs below this are all dropped
        self.scan_vsegs = False          # something was deleted: look for replicas to drop
        self.drops: deque[ReplicaDrop] = deque()
        # Retain-until-consumed streams: sid -> per streamlet, the group below which every
        # consumer group has consumed (kera.coordinator.groups.consumed_below), and the
        # coordinator's token for that view (-1: none yet).
        self.consumed: dict[int, list[int]] = {}
        self.consumed_at = -1
        # (sid, sl) -> (first group, next number per slot) to send the coordinator before a
        # slot's last group may go (kera.codec.schema.number_floor), and those it acknowledged.
        self.floors: dict[tuple[int, int], tuple] = {}
        self.floors_kept: dict[tuple[int, int], tuple] = {}
        # DeleteRecords' offsets not reached yet: (sid, sl) -> record number. Groups wholly
        # below one wait for their records' durability or their floor; each pass retries
        # them. At most one per streamlet of this broker; in memory only (a failover forgets
        # them, as it would a Kafka request in flight).
        self.delete_marks: dict[tuple[int, int], int] = {}

    def set_consumed(self, marks, token) -> None:
        if not isinstance(marks, list) or not isinstance(token, int) or not all(
                isinstance(m, list) and len(m) == 2 and isinstance(m[0], int)
                and isinstance(m[1], list) and all(isinstance(g, int) for g in m[1])
                for m in marks):
            raise BadRequest("heartbeat reply with malformed 'consumed' marks")
        self.consumed = {sid: groups for sid, groups in marks}
        self.consumed_at = token

    # ------------------------------------------------------------------ enforcement
    def enforce(self, wall_ms: int) -> int:
        """One pass over every stream with a limit; returns how many groups were deleted."""
        deleted = 0
        clock = self.clock
        self._apply_delete_marks()
        self._by_age_left = GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX if clock.suspect else None
        for stream in list(self.broker.streams.values()):
            info = stream.info
            if not info.retention_ms and not info.retention_bytes and \
                    not info.retain_until_consumed:
                continue
            if not cleanup.deletes(info.cleanup_policy):
                continue   # compact only: every key's last record is kept however old (Kafka)
            for streamlet in stream.streamlets.values():
                if info.retention_ms:
                    self._close_old(streamlet, info.retention_ms, wall_ms)
                n = self._trim(streamlet, info, wall_ms)
                if n:
                    deleted += n
                    self.broker.tier.record_first_group(streamlet.stream_id, streamlet.index,
                                                        streamlet.first_group)
        if clock.suspect:
            if self._by_age_left == 0:
                self.broker.counters.add("retention_passes_bounded")
                log.warning("retention deleted %d groups by age this pass, the most allowed "
                            "after a clock step or a restart; more are due", 
                            GROUPS_DELETED_BY_AGE_AFTER_STEP_MAX)
            else:
                clock.suspect = False   # caught up: ages are trusted again
        if deleted:
            self.broker.counters.add("groups_deleted", deleted)
            self.scan_vsegs = True
        if self.scan_vsegs:
            self.scan_vsegs = False
            self._drop_replicas()
        return deleted

    def delete_below(self, streamlet, number: int) -> int:
        """Delete the oldest finished groups whose records all lie below record `number` of a
        one-slot streamlet, as retention deletes (whole groups, oldest first, a slot's last
        group only once its floor is kept): Kafka's DeleteRecords (kera.broker.kafka.records).
        Returns how many groups went."""
        groups, n = streamlet.groups, 0
        while groups and groups[0].finished and groups[0].number_base is not None and \
                groups[0].number_base + groups[0].head <= number and \
                self._floor_kept(streamlet, groups[0]):
            self._delete(streamlet, groups[0])
            n += 1
        if n:
            self.broker.tier.record_first_group(streamlet.stream_id, streamlet.index,
                                                streamlet.first_group)
            self.broker.counters.add("groups_deleted", n)
            self.scan_vsegs = True
        key, first = (streamlet.stream_id, streamlet.index), groups[0] if groups else None
        if first is not None and first.number_base is not None and \
                first.number_base + first.head <= number:
            self.delete_marks[key] = max(number, self.delete_marks.get(key, 0))
        else:
            self.delete_marks.pop(key, None)
        return n

    def _apply_delete_marks(self) -> None:
        for (sid, sl), number in list(self.delete_marks.items()):
            stream = self.broker.streams.get(sid)
            streamlet = None if stream is None else stream.streamlets.get(sl)
            if streamlet is None:
                del self.delete_marks[(sid, sl)]   # deleted, or moved to another broker
            else:
                self.delete_below(streamlet, number)

    # ------------------------------------------------------------------ number floors
    def _floor_kept(self, streamlet, group) -> bool:
        """Whether `group` may go now. Deleting a slot's last group leaves nothing stored to
        continue its numbering (and, with the streamlet's last group, its group ids) from after
        a failover. So that group goes only once the coordinator acknowledged the floor it
        leaves; until then the floor is sent with the heartbeats and the group waits (about a
        heartbeat interval, longer while the coordinator is unreachable)."""
        if any(g.slot == group.slot for g in islice(streamlet.groups, 1, None)):
            return True   # a later group of the slot carries its numbers (and ids)
        number = streamlet.next_number(group.slot)
        first_group = group.id + 1 if len(streamlet.groups) == 1 else 0
        key = (streamlet.stream_id, streamlet.index)
        kept = self.floors_kept.get(key)
        if not number or kept is not None and kept[1][group.slot] >= number and \
                kept[0] >= first_group:
            return True
        numbers = [0] * len(streamlet.slots)
        numbers[group.slot] = number
        self.floors[key] = schema.merged_floor(self.floors.get(key), (first_group, tuple(numbers)))
        return False

    def floors_to_send(self) -> list[list]:
        """The heartbeat's `floors`: [[sid, sl, first group, [numbers]], ...]."""
        return [[sid, sl, first_group, list(numbers)] for (sid, sl), (first_group, numbers)
                in islice(self.floors.items(), FLOORS_PER_HEARTBEAT_MAX)]

    def floors_acknowledged(self, sent) -> None:
        """The coordinator kept `sent`: forget those not changed since."""
        if len(self.floors_kept) > FLOORS_KEPT_MAX:
            self.floors_kept.clear()
        for sid, sl, first_group, numbers in sent:
            floor = (first_group, tuple(numbers))
            self.floors_kept[(sid, sl)] = schema.merged_floor(self.floors_kept.get((sid, sl)), floor)
            if self.floors.get((sid, sl)) == floor:
                del self.floors[(sid, sl)]

    def _close_old(self, streamlet, retention_ms: int, wall_ms: int) -> None:
        for group in streamlet.slots:
            if group is not None and not group.closed and group.head and \
                    group.created_ms + retention_ms <= wall_ms:
                self.broker.counters.add("groups_closed_by_time")
                self.broker.placement.close_group(group)

    def _trim(self, streamlet, info, wall_ms: int) -> int:
        groups = streamlet.groups
        total = sum(group_bytes(g) for g in groups) if info.retention_bytes else 0
        n = 0
        while groups and groups[0].finished:
            g = groups[0]
            size = group_bytes(g) if info.retention_bytes else 0
            expired = self._expired(info, streamlet.index, g, wall_ms)
            over = info.retention_bytes and total - size >= info.retention_bytes
            if not (expired or over) or not self._floor_kept(streamlet, g):
                break
            if not over and self._by_age_left is not None:
                if self._by_age_left == 0:
                    break
                self._by_age_left -= 1
            total -= size
            self._delete(streamlet, g)
            n += 1
        return n

    def _expired(self, info, sl: int, g, wall_ms: int) -> bool:
        """Past its age (retention_ms), and, for a retain-until-consumed stream, consumed by
        every consumer group (then retention_ms 0 means: as soon as consumed)."""
        aged = g.last_ms + info.retention_ms <= wall_ms if info.retention_ms else \
            info.retain_until_consumed
        if not aged or not info.retain_until_consumed:
            return bool(aged)
        marks = self.consumed.get(info.id)
        return marks is not None and sl < len(marks) and g.id < marks[sl]

    def _delete(self, streamlet, group) -> None:
        assert streamlet.groups[0] is group and group.finished
        tier = self.broker.tier
        for seg in group.segments:
            tier.segment_deleted(seg)
        streamlet.groups.pop(0)
        streamlet.first_group = group.id + 1
        self._trim_transactions(streamlet, group)
        ends = self.deleted_ends.setdefault((streamlet.stream_id, streamlet.index), OrderedDict())
        ends[group.id] = group.head
        while len(ends) > DELETED_ENDS_MAX:
            ends.popitem(last=False)
        log.debug("stream %d streamlet %d: group %d deleted (%d records)", streamlet.stream_id,
                  streamlet.index, group.id, group.head)

    def _trim_transactions(self, streamlet, group) -> None:
        """Aborted ranges whose marker went with `group` are forgotten (kera.broker.transactions)."""
        txn = getattr(self.broker, "txn", None)
        idx = None if txn is None else txn.indexes.get((streamlet.stream_id, streamlet.index))
        if idx is not None and group.number_base is not None:
            idx.trim(group.slot, group.number_base + group.head)

    def stream_deleted(self, stream_id: int) -> None:
        for key in [k for k in self.deleted_ends if k[0] == stream_id]:
            del self.deleted_ends[key]
        self.scan_vsegs = True

    # ------------------------------------------------------------------ readers
    def gone(self, sid: int, streamlet, low: int, offsets: dict) -> bool:
        """Does a cursor with `low` below the streamlet's first retained group miss records?
        Not when it had read every deleted group in [low, first_group) to its end (known for
        the latest DELETED_ENDS_MAX deleted groups only: older ones count as missed)."""
        first = streamlet.first_group
        if first - low > len(offsets):
            return True
        ends = self.deleted_ends.get((sid, streamlet.index), {})
        for g in range(low, first):
            end = ends.get(g)
            if end is None or offsets.get(g, 0) < end:
                return True
        return False

    # ------------------------------------------------------------------ replicas
    def _drop_replicas(self) -> None:
        broker = self.broker
        for vlog in broker.vlog_list:
            vsegs = vlog.vsegs
            start = self._drop_from.get(vlog, 0)
            for k in range(start, len(vsegs)):
                vs = vsegs[k]
                if vs.replicas == []:                      # [] marks a dropped one
                    continue
                if not vs.finished:
                    # The open one, once everything it references is gone (an idle stream
                    # whose data expired): close it, so that it finishes and can be dropped.
                    if vs is vlog.open and vs.segs and all(s.released for s in vs.segs):
                        vlog.close_open()
                        self.scan_vsegs = True
                    elif vs.closed and vs.segs and all(s.released for s in vs.segs):
                        self.scan_vsegs = True             # finishing: look again next pass
                    continue
                segs = self._vseg_segs.get(vs)
                if segs is None:
                    segs = self._vseg_segs[vs] = tuple({id(s): s for s in vs.segs}.values())
                if all(s.released for s in segs):
                    self._drop(vlog, vs)

            while start < len(vsegs) and vsegs[start].replicas == []:
                start += 1
            self._drop_from[vlog] = start


    def _drop(self, vlog, vs) -> None:
        # The wire number (kera.broker.virtual_log: the incarnation's epoch in the high bits).
        fields = {"broker_id": self.broker.broker_id, "vlog": vlog.id,
                  "vseg": getattr(vlog, "vseg_base", 0) + vs.number}


        for r in vs.replicas:
            if r is not None:
                self.drops.append(ReplicaDrop(r.backup_id, r.address, dict(fields)))
        # Nothing references the chunks any more: forget the references and the replicas
        # (an empty replica list marks the virtual segment dropped).
        vs.replicas = []
        vs.segs = []
        vs.idxs = array("I")
        self._vseg_segs.pop(vs, None)
        self.broker.counters.add("replicas_dropped")

    def take_drops(self) -> list[ReplicaDrop]:
        """`drop_replica` requests to send: virtual segments nothing references any more."""
        drops = list(self.drops)
        self.drops.clear()
        return drops
