"""Restart from the broker's own disk: the segment files a broker wrote (tiering, and every
durable segment at an orderly stop) become its streamlets' groups again.

Two steps, so the sans-IO core never touches a file:

1. `load_dir(root)` (I/O, at startup, before serving): every segment file whose record checks
   out is mapped and every chunk verified (both checksums, the broker's stamps, dense record
   offsets, the record's chained checksum); the per-chunk index is rebuilt from the chunk
   headers. Damaged files are logged and skipped (never deleted).
2. `install(broker, stream, loaded)` (pure, when the coordinator's metadata names a stream this
   broker owns streamlets of): the verified segments become groups, each *sealed* (closed,
   wholly durable: appends go to new groups, numbered after the last one found), and the
   duplicate-detection table learns every producer's newest chunk, so a producer retrying
   after the restart is not appended twice.

Identity and stream ownership still come from the coordinator. Files of streams or streamlets
the metadata no longer gives this broker are left on disk (logged), never deleted.

A group found only in part (its first segments on disk, the rest lost with the broker's
memory in a crash) keeps the contiguous part from its first segment; groups missing entirely
between two found ones become empty closed groups, so group numbers keep their meaning.
Recovering what a crash lost from the backups is the recovery module's job; this module is
usable by it: `load_dir` and `install` take no server state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from kera.broker import history_epoch, tier_files
from kera.broker.group import Group
from kera.broker.locks import LockTable
from kera.broker.producers import Entry
from kera.broker.txn_writes import rebuild_index
from kera.codec import txn
from kera.codec.chunk import MARKER_PRODUCER_ID
from kera.broker.segment import Segment
from kera.broker.streamlet import Streamlet
from kera.broker.tier_files import CorruptSegment, LoadedSegment
from kera.codec.chunk import read_header
from kera.errors import CorruptChunk

log = logging.getLogger(__name__)


class Loaded(NamedTuple):
    """What `load_dir` found: verified segments per (stream id, streamlet), and the first
    retained group retention recorded per streamlet."""
    segments: dict[tuple[int, int], list[LoadedSegment]]
    first_groups: dict[tuple[int, int], int]
    corrupt: int
    # {(stream id, streamlet): history epoch} recorded in the data dir (kera.broker.history_epoch)
    epochs: dict[tuple[int, int], int] | None = None

    @property
    def empty(self) -> bool:
        return not self.segments and not self.first_groups


def load_dir(root: Path) -> Loaded:
    root = Path(root)
    segments: dict[tuple[int, int], list[LoadedSegment]] = {}
    corrupt = 0
    for record in tier_files.scan(root):
        try:
            loaded = tier_files.load(root, record)
        except (OSError, CorruptSegment, ValueError) as err:
            log.error("segment %s failed verification, not loaded: %s", record.key, err)
            corrupt += 1
            continue
        segments.setdefault((record.stream_id, record.streamlet), []).append(loaded)
    first_groups = tier_files.read_first_groups(root)
    if segments:
        log.info("found %d verified segments of %d streamlets under %s",
                 sum(map(len, segments.values())), len(segments), root)
    epochs = {key: history_epoch.read(root, *key) for key in segments}
    return Loaded(segments, first_groups, corrupt, epochs)


def install(broker, stream, loaded: Loaded) -> int:
    """Install the segments found for `stream`'s streamlets this broker owns; returns how many
    streamlets were installed. Claimed entries are removed from `loaded`."""
    info = stream.info
    installed = 0
    keys = {k for k in list(loaded.segments) + list(loaded.first_groups) if k[0] == info.id}
    for key in sorted(keys):
        sl = key[1]
        segs = loaded.segments.pop(key, [])
        first_recorded = loaded.first_groups.pop(key, 0)
        if sl >= info.streamlets or info.placement[sl] != broker.broker_id:
            log.warning("segment files of stream %s streamlet %d are kept on disk but not "
                        "loaded: the streamlet is not this broker's", info.name, sl)
            continue
        if sl in stream.streamlets:
            log.warning("stream %s streamlet %d already holds data: files not loaded", info.name, sl)
            continue
        streamlet = stream.streamlets[sl] = _streamlet(broker, info, sl, segs, first_recorded)
        if info.replication == 1:   # the history continues: same epoch (history_epoch)
            streamlet.epoch = (loaded.epochs or {}).get(key, history_epoch.UNKNOWN_EPOCH)
        installed += 1
    return installed


def _streamlet(broker, info, sl: int, segs: list[LoadedSegment], first_recorded: int) -> Streamlet:
    streamlet = Streamlet(info.id, sl, info.active_groups, info.group_segments,
                          info.segment_size_bytes, broker.placement, broker.segment_pool)
    by_group: dict[int, list[LoadedSegment]] = {}
    for ls in segs:
        by_group.setdefault(ls.record.group, []).append(ls)
    # Files below the recorded first group were deleted by retention (a deletion cut short).
    first = max(first_recorded, min(by_group, default=first_recorded))
    last = max(max(by_group, default=first - 1), first - 1)

    streamlet.first_group = first
    newest: dict[int, Entry] = {}
    for gid in range(first, last + 1):
        group = _group(broker, info, sl, gid, by_group.get(gid, []), newest)
        streamlet.groups.append(group)
    streamlet.adopt_numbers()
    streamlet.adopt_floor(info.floors.get(sl))   # retention emptied a slot: go on after it
    if info.active_groups == 1 and streamlet.next_numbers[0]:
        # Which locks the reloaded records wrote is not read back (that would read every chunk
        # on disk): every lock counts as written by the last one (kera.broker.locks).
        streamlet.locks = LockTable(floor=streamlet.next_numbers[0] - 1)
    for pid, entry in newest.items():
        if pid != MARKER_PRODUCER_ID:   # a transaction's control chunks: no producer's
            seq = txn.plain_sequence(entry.sequence)   # a Kafka sequence never has bit 63
            broker.producers.put((pid, info.id, sl), entry._replace(sequence=seq))
    rebuild_index(broker.txn, info, streamlet)
    log.info("stream %s streamlet %d: reloaded groups %d..%d from disk", info.name, sl, first, last)
    return streamlet


def _group(broker, info, sl: int, gid: int, segs: list[LoadedSegment], newest: dict) -> Group:
    segs = sorted(segs, key=lambda ls: ls.record.segment)
    slot = segs[0].record.slot if segs else gid % info.active_groups
    group = Group(gid, slot, info.group_segments, info.segment_size_bytes, info.id, sl)
    group.closed = True    # a restart seals every group: new chunks open new groups
    end = 0
    for number, ls in enumerate(segs):
        r = ls.record
        if r.segment != number or r.base_offset != end:
            log.error("stream %s streamlet %d group %d: segment %d is missing; the %d later "
                      "segments on disk are not loaded", info.name, sl, gid, number, len(segs) - number)
            break
        seg = Segment(group, number, r.capacity_bytes)
        seg.drop_memory()                # the bytes stay on disk, mapped when read
        seg.used_bytes = r.length
        seg.positions, seg.sizes, seg.bases, seg.counts = ls.positions, ls.sizes, ls.bases, ls.counts
        broker.tier.adopt(seg, r.key, r.length)
        group.segments.append(seg)
        group.seg_bases.append(r.base_offset)
        end = r.end_offset
        group.created_ms = min(group.created_ms or r.created_ms, r.created_ms)
        group.last_ms = max(group.last_ms, r.last_ms)
        for pid, (seq, i) in ls.producers.items():
            newest[pid] = Entry(seq, gid, number, seg.bases[i], seg.end_offset(i))
    if not group.segments:
        log.warning("stream %s streamlet %d group %d: no segment on disk (lost)", info.name, sl, gid)
    else:
        group.number_base = _first_number(group.segments[0])
    group.head = group.durable = end
    now = broker.wall_ms
    if now:
        # Stamps later than the retention clock (a clock that stepped back while the broker was
        # down) are clamped to it: an age is never more than the files say, nor negative.
        group.created_ms = min(group.created_ms, now)
        group.last_ms = min(group.last_ms, now)
    return group


def _first_number(seg: Segment) -> int | None:
    """The record number of a group's first record, from its first chunk's header (None: not
    readable, or written before record numbers)."""
    view = seg.view(0) if len(seg) else None
    if view is None:
        return None
    try:
        return read_header(view).number
    except CorruptChunk:
        return None
