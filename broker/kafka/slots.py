"""Kafka partitions of streams with several active groups: one partition per streamlet and slot.

A streamlet with Q active groups has Q slots open to appends; each slot numbers its records
densely from 0 (kera.broker.streamlet), so each slot is a Kafka partition with dense offsets.
Partition `p` of a stream with Q active groups is slot `p % Q` of streamlet `p // Q`: the Q
partitions of a streamlet are adjacent and share its owner, and with Q = 1 partition p is
streamlet p, as before. kera's own producer with id `i` writes slot `i % Q` of the streamlet
its key picks, so its records are read by a Kafka consumer from partition
`streamlet * Q + i % Q`.

The record numbers of one slot are read here from the streamlet the core holds (its public
groups, each tagged with its slot): the core's own number lookups
(Broker.number_span, cursor_at_number) serve one-slot streamlets only. A read of one slot is a
kera read whose cursor stands at the end of every other slot's groups, so the core serves that
slot's chunks alone, in order (kera.broker.core.Broker._read serves each slot's lowest
unfinished group). Sans-IO: plain functions of the core's objects.

A Kafka batch is appended to slot `kera producer id % Q`, so a batch for a slot is stored under
an id with that residue (`producer_id`): an idempotent producer's is a hash of its id, epoch
and slot; an anonymous producer's (no idempotence) is the slot number itself, below
ANONYMOUS_IDS, which the core treats as anonymous Kafka batches (no sequence rule, as a Kafka
broker has none for them: kera.codec.txn.ANONYMOUS_PRODUCER_IDS). kera's own producers must
therefore not pick ids below ANONYMOUS_IDS for such streams (their random ids never do).
"""

from __future__ import annotations

import hashlib
import struct

from kera.broker.reads import FETCH_GROUPS_MAX
from kera.broker.producers import ANONYMOUS_PRODUCER_ID
from kera.codec.txn import ANONYMOUS_PRODUCER_IDS
from kera.broker.time_index import record_at_or_after
from kera.errors import BadRequest

# kera producer ids below this are the slots' anonymous writers (a Kafka producer without
# idempotence writing slot s of a stream with several active groups has id s): a stream has at
# most 256 active groups (kera.coordinator.validate.ACTIVE_GROUPS_MAX). Hashed ids skip them.
ANONYMOUS_IDS = ANONYMOUS_PRODUCER_IDS
_PID_SLOT = struct.Struct("<QH")


def partitions(info) -> int:
    """How many Kafka partitions a stream has: one per streamlet and slot."""
    return info.streamlets * info.active_groups


def place(info, partition: int) -> tuple[int, int] | None:
    """(streamlet, slot) of Kafka partition `partition`; None when the stream has none."""
    if not 0 <= partition < partitions(info):
        return None
    return divmod(partition, info.active_groups)


def partition_of(info, streamlet: int, slot: int) -> int:
    return streamlet * info.active_groups + slot


def span(core, info, sl: int, slot: int) -> tuple[int, int]:
    """(first retained, durable end) record numbers of one slot: the partition's log start
    offset and high watermark. The core checks that this broker may read the streamlet."""
    if info.active_groups == 1:
        return core.reads.number_span(info.id, sl)
    core.reads.first_group(info.id, sl)           # not_owner, not_ready, unknown: refused here
    streamlet = core.streams[info.id].streamlets.get(sl)
    if streamlet is None:                   # nothing here yet: from what retention deleted
        floor = info.floors.get(sl)
        number = floor[1][slot] if floor and slot < len(floor[1]) else 0
        return number, number
    return slot_span(streamlet, slot)


def slot_span(streamlet, slot: int) -> tuple[int, int]:
    """As Streamlet.number_span, over one slot's groups: they become durable in order."""
    groups = [g for g in streamlet.groups if g.slot == slot and g.number_base is not None]
    first = groups[0].number_base if groups else streamlet.next_number(slot)
    for g in reversed(groups):
        if g.durable:
            return first, g.number_base + g.durable
    return first, first


def cursor(core, info, sl: int, slot: int, number: int) -> tuple[dict, int]:
    """({"low", "offsets"}, read factor) of a kera read of one slot from record `number` (the
    first retained when deleted, the end when not written). The other slots' groups stand at
    their heads, so they give nothing; the factor is how many slots the core shares the read's
    bytes among, by which the caller multiplies its max bytes so that this slot gets them."""
    if info.active_groups == 1:
        low, offsets = core.reads.cursor_at_number(info.id, sl, number)
        return {"low": low, "offsets": offsets}, 1
    core.reads.first_group(info.id, sl)
    streamlet = core.streams[info.id].streamlets.get(sl)
    if streamlet is None:
        return {"low": 0, "offsets": {}}, 1
    low, offsets = slot_cursor(streamlet, slot, number)
    return {"low": low, "offsets": offsets}, _sharing(streamlet, low, offsets)


def slot_cursor(streamlet, slot: int, number: int) -> tuple[int, dict[int, int]]:
    """(low, offsets) at record `number` of `slot`, every other slot's groups at their ends."""
    target = None
    for g in streamlet.groups:
        if g.slot != slot or g.number_base is None or g.head == 0:
            continue
        target = (g.id, max(0, number - g.number_base))
        if number < g.number_base + g.head:
            break
    else:
        if target is not None:
            last = streamlet.group(target[0])
            target = (last.id, last.head)
    if target is None:   # nothing of the slot held: its next group, after every one held
        low = streamlet.first_group + len(streamlet.groups)
        return low, {}
    low = target[0]
    offsets = {g.id: g.head for g in _window(streamlet, low) if g.slot != slot}
    offsets[low] = target[1]
    return low, offsets


def _window(streamlet, low: int) -> list:
    """The groups a read from group `low` looks at (the core reads FETCH_GROUPS_MAX of them)."""
    at = max(0, low - streamlet.first_group)
    return streamlet.groups[at:at + FETCH_GROUPS_MAX]


def _sharing(streamlet, low: int, offsets: dict[int, int]) -> int:
    """Slots with a group the core would serve from this cursor (each gets a fair share)."""
    seen = set()
    for g in _window(streamlet, low):
        if not (g.finished and offsets.get(g.id, 0) >= g.head):
            seen.add(g.slot)
    return max(1, len(seen))


def number_at_time(core, info, sl: int, slot: int, timestamp_us: int) -> tuple[int, int] | None:
    """(record number, timestamp µs) of the slot's first durable record at or after
    `timestamp_us`; None when there is none (Kafka's ListOffsets by timestamp)."""
    if info.active_groups == 1:
        return core.reads.number_at_time(info.id, sl, timestamp_us)
    low, offsets = core.reads.cursor_at_time(info.id, sl, timestamp_us)
    streamlet = core.streams[info.id].streamlets.get(sl)
    for g in streamlet.groups if streamlet is not None else ():
        off = offsets.get(g.id, 0)
        if g.slot == slot and g.id >= low and g.number_base is not None and off < g.durable:
            found = record_at_or_after(g, off)
            if found is not None:
                return g.number_base + found[0], found[1]
    return None


def producer_id(kera_pid: int, info, slot: int) -> int:
    """The kera producer id a Kafka batch for `slot` is stored under: the core appends a chunk
    to slot `id % Q`. With Q = 1 the id is kept. Otherwise an idempotent producer's id is a
    63-bit hash of (id, slot) moved to the slot's residue, so each (producer, epoch,
    partition) keeps its own sequences; an anonymous one's is the slot itself."""
    q = info.active_groups
    if q == 1:
        return kera_pid
    if kera_pid == ANONYMOUS_PRODUCER_ID:
        return slot
    digest = hashlib.blake2b(_PID_SLOT.pack(kera_pid, slot), digest_size=8).digest()
    h = int.from_bytes(digest, "little") >> 1
    h = h - h % q + slot
    if h < ANONYMOUS_IDS:
        h += (ANONYMOUS_IDS - h + q - 1) // q * q
    return h


def numbers(core, sid: int, sl: int, slot: int, at_us: int | None = None) -> dict:
    """The `numbers` op's reply for slot `slot` of streamlet `sl` (a Kafka partition's offsets,
    for `kera group` on Kafka groups): `start`, `end` and, given `at_us`, `at_time`, the number
    of the first durable record at or after it (None: none is)."""
    core.reads.first_group(sid, sl)               # unknown stream, not owner, not ready: refused
    info = core.streams[sid].info
    if not 0 <= slot < info.active_groups:
        raise BadRequest(f"stream {info.name!r} has {info.active_groups} active groups per "
                         f"streamlet: no slot {slot}")
    start, end = span(core, info, sl, slot)
    reply = {"start": start, "end": end}
    if at_us is not None:
        found = number_at_time(core, info, sl, slot, at_us)
        reply["at_time"] = None if found is None else found[0]
    return reply
