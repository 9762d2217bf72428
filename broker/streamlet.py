"""A streamlet: one partition of a stream on this broker, as groups numbered densely from 0.

Q slots are open to appends at once; a producer's chunks go to slot `producer_id % Q`, so one
producer's chunks to a streamlet stay in one group at a time, in order. Groups are created
lazily as data arrives; a full group closes and a new one takes its slot.

A slot is the streamlet's ordered unit: its records are numbered densely from 0 across its
groups, in append order (the number is stamped into each chunk, so recovery and reload find
it again; kera.broker.rebuild keeps a gap-free prefix of each slot). A group's numbers continue
from the slot's previous group; the first group of a slot, and the first after a recovery or
reload, continues from `next_numbers[slot]`.
"""

from __future__ import annotations

import struct
from typing import Protocol

from kera.broker.group import Group
from kera.broker.locks import LockTable
from kera.broker.segment import Segment
from kera.broker.segment_pool import SegmentPool

_PRODUCER_SEQ = struct.Struct("<QQ")  # producer_id, sequence at byte 16 of a chunk header


def growth(group: Group | None, sizes, segment_size_bytes: int, group_segments: int) -> tuple[int, int]:
    """(segments, groups) that appending chunks of `sizes` bytes, in order, to a slot whose open
    group is `group` (None or closed: the slot has none) would open; the same rule as
    Streamlet.append, without appending. Chunks larger than a segment are refused anyway."""
    room = segs_left = 0
    if group is not None and not group.closed:
        segs_left = group_segments - len(group.segments)
        if group.segments:
            last = group.segments[-1]
            room = last.capacity_bytes - last.used_bytes
    segments = groups = 0
    for size in sizes:
        if size <= room:
            room -= size
        elif size <= segment_size_bytes:
            if segs_left == 0:
                groups += 1
                segs_left = group_segments
            segs_left -= 1
            segments += 1
            room = segment_size_bytes - size
    return segments, groups


class GroupListener(Protocol):
    def group_opened(self, group: Group) -> None: ...
    def group_closed(self, group: Group) -> None: ...


class Streamlet:
    __slots__ = ("stream_id", "index", "active_groups", "group_segments", "segment_size_bytes",
                 "groups", "slots", "listener", "first_group", "epoch", "next_numbers", "locks",
                 "pool")

    def __init__(self, stream_id: int, index: int, active_groups: int, group_segments: int,
                 segment_size_bytes: int, listener: GroupListener | None = None,
                 pool: SegmentPool | None = None):
        self.stream_id = stream_id
        self.index = index
        self.active_groups = active_groups
        self.group_segments = group_segments
        self.segment_size_bytes = segment_size_bytes
        self.groups: list[Group] = []   # groups first_group, first_group + 1, ...
        # Groups below this id were deleted by retention (kera.broker.retention).
        self.first_group = 0
        self.slots: list[Group | None] = [None] * active_groups
        self.listener = listener
        self.pool = pool            # segment memory for the groups it opens
        # Which history of this streamlet the groups are (kera.broker.history_epoch): fetches
        # carrying another epoch are refused, not read at the same group numbers.
        self.epoch = 0
        # Per slot, the number of its next record when its previous group is not in `slots`
        # (set from the recovered or reloaded groups by adopt_numbers).
        self.next_numbers = [0] * active_groups
        # Conditional appends' locks (kera.broker.locks), made at the first one.
        self.locks: LockTable | None = None

    def append(self, chunk, size: int, count: int, producer_id: int) -> tuple[Group, Segment, int]:
        """Store a verified chunk in its producer's slot; returns (group, segment, index)."""
        slot = producer_id % self.active_groups
        group = self.slots[slot]
        if group is None or group.closed:   # closed by time (retention) while idle
            group = self._open_group(slot)
        loc = group.append(chunk, size, count)
        if loc is None:  # the group was full and is now closed
            if self.listener is not None:
                self.listener.group_closed(group)
            group = self._open_group(slot)
            loc = group.append(chunk, size, count)
            assert loc is not None, "a chunk no larger than a segment fits a new group"
        return group, loc[0], loc[1]

    def next_number(self, slot: int) -> int:
        """The record number the next record appended to `slot` gets."""
        prev = self.slots[slot]
        if prev is not None and prev.number_base is not None:
            return prev.number_base + prev.head
        return self.next_numbers[slot]

    def cursor_at_number(self, number: int) -> tuple[int, dict[int, int]]:
        """(low, offsets) of the record numbered `number` in a one-slot streamlet: in the group
        holding it; the first retained record when it was deleted; the end when not written."""
        last = None
        for group in self.groups:
            if group.number_base is None or group.head == 0:
                continue
            last = group
            if number < group.number_base + group.head:
                return group.id, {group.id: max(0, number - group.number_base)}
        if last is None:
            return self.first_group, {}
        return last.id, {last.id: last.head}

    def number_span(self) -> tuple[int, int]:
        """(first retained, durable end) record numbers of a one-slot streamlet: a Kafka
        partition's log start offset and high watermark. One slot's groups become durable in
        order, so the last group with durable records gives the end."""
        first = end = None
        for group in self.groups:
            if group.number_base is not None:
                first = group.number_base
                break
        for group in reversed(self.groups):
            if group.number_base is not None and group.durable:
                end = group.number_base + group.durable
                break
        if first is None:   # every group deleted: the slot's next number (its last group's end)
            first = self.next_number(0)
        return first, first if end is None else end

    def lock_table(self) -> LockTable:
        if self.locks is None:
            self.locks = LockTable()
        return self.locks

    def adopt_numbers(self) -> None:
        """Continue each slot's numbering after the groups it holds (recovered or reloaded)."""
        for group in self.groups:
            # An empty group (a placeholder, or one a rebuild cut to nothing) says nothing.
            if group.number_base is not None and group.head:
                end = group.number_base + group.head
                if end > self.next_numbers[group.slot]:
                    self.next_numbers[group.slot] = end

    def adopt_floor(self, floor) -> None:
        """Go on after what retention deleted, as the coordinator kept it for this streamlet
        (kera.codec.schema.number_floor; None: nothing kept): group ids from its first group when no
        group is held, each slot's numbers from at least its floor. Locks written before an
        emptied one-slot streamlet's floor are unknown: they count as written just below it."""
        if floor is None:
            return
        first_group, numbers = floor
        if not self.groups and first_group > self.first_group:
            self.first_group = first_group
        for slot, number in enumerate(numbers[:len(self.next_numbers)]):
            self.next_numbers[slot] = max(self.next_numbers[slot], number)
        if len(self.next_numbers) == 1 and numbers[0] and not self.groups:
            table = self.lock_table()
            table.floor = max(table.floor, numbers[0] - 1)

    def _open_group(self, slot: int) -> Group:
        group = Group(self.first_group + len(self.groups), slot, self.group_segments,
                      self.segment_size_bytes, self.stream_id, self.index)
        group.number_base = self.next_number(slot)
        group.pool = self.pool
        self.groups.append(group)
        self.slots[slot] = group
        if self.listener is not None:
            self.listener.group_opened(group)
        return group

    def group(self, group_id: int) -> Group | None:
        i = group_id - self.first_group
        return self.groups[i] if 0 <= i < len(self.groups) else None

    def find_chunk(self, producer_id: int, sequence: int | None, max_chunks: int):
        """Newest chunk of `producer_id` (with `sequence`, if given) in its slot, scanning chunk
        headers newest first and at most `max_chunks` of them. Returns (group, segment, index,
        sequence) or None. A rare path: a producer forgotten by the bounded duplicate table, or
        a retry of a chunk older than the producer's last."""
        slot = producer_id % self.active_groups
        scanned = 0
        for group in reversed(self.groups):
            if group.slot != slot:
                continue
            for seg, i in group.iter_chunks_reversed():
                if scanned >= max_chunks:
                    return None
                scanned += 1
                mv = seg.view(i)
                if mv is None:
                    return None
                pid, seq = _PRODUCER_SEQ.unpack_from(mv, 16)
                if pid == producer_id and (sequence is None or seq == sequence):
                    return group, seg, i, seq
                if pid == producer_id and sequence is not None and seq < sequence:
                    return None  # went past it: sequences only grow going forward
        return None

    def describe_groups(self, low: int = 0, limit: int | None = None) -> list[list]:
        low = max(0, low - self.first_group)
        groups = self.groups[low:] if limit is None else self.groups[low:low + limit]

        return [g.describe() for g in groups]

    def release(self) -> list:
        """Free the buffers (stream deleted); returns the produce waiters left hanging."""
        waiters = []
        for group in self.groups:
            waiters.extend(group.take_waiters())
            group.release()
            if not group.closed and self.listener is not None:
                group.closed = True
                self.listener.group_closed(group)
        return waiters
