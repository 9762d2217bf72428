"""Rebuilding a dead broker's streamlet from the chunks its replicas hold. Sans-IO.

Chunks arrive in any order (several virtual logs, backups and source incarnations), each stamped
with where the dead broker put it (group, base offset). `StreamletRebuild.add` places every
group's chunks at exactly their recorded offsets, in order: a chunk ahead of the group's head
waits (bounded by the reader's window) until the ones before it arrive, and one at an offset
already placed is another copy of the same chunk and is dropped. `finish` then decides what the
streamlet holds and `install` hands it to the broker: every group closed (appends go to new
groups, numbered after the last), the recovered chunks referenced by the broker's own virtual
logs (re-replicated under its incarnation), and the duplicate-detection table rebuilt from the
chunk headers, so a producer retrying an unacknowledged chunk is not stored twice; and the
lock table of conditional appends (kera.broker.locks) replayed from the kept conditional chunks.

What is kept is a consistent prefix of each slot's history, never invented data:

* A hole inside a group (a chunk whose successors survive but which no replica holds) cuts the
  group there and drops the slot's later groups.
* A hole in a producer's sequences (chunk k missing, k+1 present, or a first chunk that is not
  sequence 0 when the streamlet starts at group 0) cuts the slot at k+1.
* A jump in a slot's record numbers from one of its groups to the next (the earlier group lost
  its tail, or a whole group is missing, and the lost chunks' producers sent nothing later)
  drops the later group and the slot's groups after it.

All are safe for acknowledged data. On the dead broker a slot's new group took the virtual
log of the slot's previous group unless that one was wholly durable already
(kera.broker.placement._slot_vlog), and durability walks a log in order, so whatever follows a
missing chunk in its slot was never durable: never acknowledged, never read. The producer
retries it, and the rebuilt table then classifies its chunks right (kept ones are duplicates,
dropped ones are appended again, in order). Dropped chunks are counted and logged.

A chunk is readable at once when the replicas still hold it on R-1 backups (with this broker's
copy: R copies); otherwise once the broker's own replication of it is acknowledged.

Compacted chunks (FLAG_SPARSE, docs/COMPACTION.md) are kept aside until `finish`: each
rewritten segment is its newest whole rewrite (pieces 0 to the one marked last, back to back)
in place of the chunks it replaced, whichever of those the replicas still hold; a rewrite that
did not finish is left out, its segment then being what an earlier whole rewrite or its
originals hold. Either way nothing is lost: a rewrite's originals are released only once it
is durable. Its chunks have no producer order, and the chunks it replaced leave holes in their
producers' sequences by design, so a rewrite resets the sequence rule (the offset and number
rules still see holes after it).
"""

from __future__ import annotations

import logging
from array import array

from kera.broker.group import Group
from kera.broker.producers import Entry
from kera.broker.streamlet import Streamlet
from kera.broker.txn_writes import rebuild_index
from kera.codec import txn
from kera.codec.chunk import (COMPACTED_PRODUCER_ID, FLAG_CONDITION, FLAG_KAFKA, FLAG_SPARSE,
                              MARKER_PRODUCER_ID, UNSET_U32, UNSET_U64, Chunk, ChunkHeader, compacted,
                              offsets_covered, read_condition, read_header)
from kera.errors import CorruptChunk

log = logging.getLogger(__name__)



class _GroupBuild:
    __slots__ = ("group", "pending", "pids", "seqs", "nexts", "durable_end", "durable_open",
                 "conditions")

    def __init__(self, group: Group):
        self.group = group
        self.pending: dict[int, tuple] = {}    # base offset -> (chunk, header, durable)
        self.pids = array("Q")                 # producer of each placed chunk, in order
        self.seqs = array("Q")                 # its sequence
        self.nexts = array("Q")                # the sequence its producer's next chunk has
        self.durable_end = 0                   # end of the leading run of readable chunks
        self.durable_open = True               # the run has not been broken yet
        self.conditions: list = []             # (end offset, lock ids) of conditional chunks


class StreamletRebuild:
    def __init__(self, stream_id: int, streamlet: int, active_groups: int, group_segments: int,
                 segment_size_bytes: int):
        self.stream_id = stream_id
        self.streamlet = streamlet
        self.active_groups = active_groups
        self.group_segments = group_segments
        self.segment_size_bytes = segment_size_bytes
        self.groups: dict[int, _GroupBuild] = {}
        self.pending_bytes = 0
        self.chunks = 0            # placed
        self.bytes = 0
        self.duplicates = 0        # copies of chunks already placed
        self.rejected = 0          # unstamped or oversized chunks
        self.dropped = 0           # placed or waiting chunks left out by the cut rules
        # Chunks a whole rewrite replaced, and those of rewrites that did not finish: the
        # segment is whole without them, nothing is lost (docs/COMPACTION.md).
        self.superseded = 0
        self.finished = False
        # Compacted chunks (docs/COMPACTION.md), kept aside until `finish` gives each segment
        # its newest whole rewrite: (group, segment) -> generation -> piece -> (chunk, header,
        # durable).
        self.rewrites: dict[tuple[int, int], dict[int, dict[int, tuple]]] = {}

    # ------------------------------------------------------------------ placing
    def add(self, chunk, h: ChunkHeader, durable: bool) -> None:
        """A verified chunk of this streamlet (`durable`: held on enough live replicas)."""
        assert (h.stream_id, h.streamlet) == (self.stream_id, self.streamlet)
        size = len(chunk)
        if h.group == UNSET_U32 or h.base_offset == UNSET_U64 or size > self.segment_size_bytes \
                or (h.record_count == 0 and not h.flags & FLAG_SPARSE):
            self.rejected += 1
            return
        if h.flags & FLAG_SPARSE:
            self._keep_rewrite(chunk, h, durable)
            return
        gb = self.groups.get(h.group)
        if gb is None:
            gb = self.groups[h.group] = _GroupBuild(Group(
                h.group, _slot(chunk, h, self.active_groups), self.group_segments,
                self.segment_size_bytes, self.stream_id, self.streamlet))
        head = gb.group.head
        base = h.base_offset
        if base < head or base in gb.pending:
            self.duplicates += 1
            return
        if base > head:
            gb.pending[base] = (chunk, h, durable)
            self.pending_bytes += size
            return
        self._place(gb, chunk, h, durable)
        pending = gb.pending
        while pending:
            nxt = pending.pop(gb.group.head, None)
            if nxt is None:
                break
            self.pending_bytes -= len(nxt[0])
            self._place(gb, *nxt)

    def _keep_rewrite(self, chunk, h: ChunkHeader, durable: bool) -> None:
        """Keep a compacted chunk aside (compacted streams have one slot: active_groups 1)."""
        if self.active_groups != 1:
            self.rejected += 1
            return
        place = compacted(h)
        pieces = self.rewrites.setdefault((h.group, h.segment), {}).setdefault(
            place.generation, {})
        if place.piece in pieces:
            self.duplicates += 1
            return
        pieces[place.piece] = (chunk, h, durable)
        self.pending_bytes += len(chunk)

    def _place(self, gb: _GroupBuild, chunk, h: ChunkHeader, durable: bool) -> None:
        group = gb.group
        size = len(chunk)
        if group.number_base is None and h.number is not None:
            # Every chunk of a group carries base + offset: the first one placed gives the base,
            # and appending re-stamps each chunk with the number it already carries.
            group.number_base = h.number - h.base_offset
        loc = group.append(chunk, size, offsets_covered(h))
        if loc is None:
            # Full by this broker's arithmetic though the dead one found room: keep every chunk
            # at its recorded offset anyway (segment boundaries are not part of a position).
            group.closed = False
            group.max_segments = len(group.segments) + 1
            loc = group.append(chunk, size, offsets_covered(h))
        if h.flags & FLAG_CONDITION:
            gb.conditions.append((group.head, _locks_of(chunk)))
        gb.pids.append(h.producer_id)
        gb.seqs.append(h.sequence if h.flags & FLAG_KAFKA else txn.plain_sequence(h.sequence))
        gb.nexts.append(next_sequence(h))
        if durable and gb.durable_open:
            gb.durable_end = group.head
        else:
            gb.durable_open = False
        self.chunks += 1
        self.bytes += size

    # ------------------------------------------------------------------ deciding
    def finish(self) -> list[Group]:
        """Apply the cut rules; returns the groups, dense from the first one found (empty
        placeholders where a group holds nothing), all closed."""
        assert not self.finished
        self.finished = True
        if self.rewrites:
            self._apply_rewrites()
        ids = sorted(self.groups)
        if not ids:
            return []
        cuts: dict[int, tuple[int, int]] = {}   # slot -> (group, chunks kept in it)

        def cut(slot: int, gid: int, keep: int, why: str) -> None:
            if slot not in cuts or (gid, keep) < cuts[slot]:
                cuts[slot] = (gid, keep)
                log.warning("stream %d streamlet %d: %s in group %d: slot %d keeps its first "
                            "%d chunks there and drops its later groups", self.stream_id,
                            self.streamlet, why, gid, slot, keep)

        for gid in ids:
            gb = self.groups[gid]
            if gb.pending:
                cut(gb.group.slot, gid, len(gb.pids), f"{len(gb.pending)} chunks after a gap")
        for slot, gid, keep, why in self._sequence_holes(ids):
            cut(slot, gid, keep, why)
        for slot, gid, why in self._number_gaps(ids, cuts):
            cut(slot, gid, 0, why)
        for gid in ids:
            gb = self.groups[gid]
            c = cuts.get(gb.group.slot)
            self.dropped += len(gb.pending)
            self.pending_bytes -= sum(len(v[0]) for v in gb.pending.values())
            gb.pending.clear()
            if c is None or gid < c[0]:
                continue
            keep = c[1] if gid == c[0] else 0
            self.dropped += len(gb.pids) - keep
            _truncate(gb, keep)
        # Trailing groups left empty are forgotten; inner ones stay as empty placeholders so
        # that group numbers keep their meaning.
        while ids and self.groups[ids[-1]].group.head == 0:
            del self.groups[ids.pop()]
        if not ids:
            return []
        out = []
        for gid in range(ids[0], ids[-1] + 1):
            gb = self.groups.get(gid)
            if gb is None:
                gb = self.groups[gid] = _GroupBuild(Group(
                    gid, gid % self.active_groups, self.group_segments, self.segment_size_bytes,
                    self.stream_id, self.streamlet))
            gb.group.closed = True
            out.append(gb.group)
        return out

    def _sequence_holes(self, ids: list[int]) -> list[tuple[int, int, int, str]]:
        """(slot, group, chunks kept, why) for each chunk whose producer's previous sequence is
        missing (or, when the streamlet starts at group 0, whose producer's first chunk is not
        sequence 0)."""
        out = []
        starts_at_zero = ids[0] == 0
        expected: dict[int, int] = {}   # producer -> the sequence its next chunk must have
        for gid in ids:
            gb = self.groups[gid]
            for k, (pid, seq, nxt) in enumerate(zip(gb.pids, gb.seqs, gb.nexts)):
                if nxt == NO_SEQUENCE:
                    if pid == COMPACTED_PRODUCER_ID:
                        # A rewrite replaced finished, durable chunks: its producers' sequences
                        # have holes there by design. The offset and number rules still see
                        # holes after it.
                        expected.clear()
                        starts_at_zero = False
                    continue   # a Kafka producer without idempotence: no order to check
                want = expected.get(pid)
                if (want is not None and seq != want) or (
                        want is None and seq != 0 and starts_at_zero):
                    out.append((gb.group.slot, gid, k, f"producer {pid:#x} sequence {seq} "
                                f"where {'the first' if want is None else want} was due"))
                expected[pid] = nxt
        return out

    # ------------------------------------------------------------------ rewrites
    def _apply_rewrites(self) -> None:
        """Give each rewritten segment its newest whole rewrite, in place of the chunks it
        replaced (docs/COMPACTION.md: a rewrite's chunks were durable before its originals
        were released, so a whole one is the segment; a partial one is ignored, and the
        segment is what an earlier whole rewrite or its originals hold)."""
        runs: dict[int, list] = {}
        for (gid, segno), gens in sorted(self.rewrites.items()):
            self.pending_bytes -= sum(len(c) for g in gens.values() for c, _, _ in g.values())
            run = _newest_whole(gens)
            left_out = sum(map(len, gens.values())) - (0 if run is None else len(run))
            if left_out:
                self.superseded += left_out
                log.info("stream %d streamlet %d group %d segment %d: %d compacted chunks of "
                         "rewrites that did not finish left out", self.stream_id,
                         self.streamlet, gid, segno, left_out)
            if run is not None:
                runs.setdefault(gid, []).append(run)
        self.rewrites.clear()
        for gid, group_runs in runs.items():
            self._regroup(gid, group_runs)

    def _regroup(self, gid: int, runs: list) -> None:
        """Place group `gid` again: its rewrites' chunks, and its other chunks outside them."""
        ranges = [(r[0][1].base_offset, _run_end(r)) for r in runs]
        old = self.groups.pop(gid, None)
        items = [c for r in runs for c in r]
        for chunk, h, durable in ([] if old is None else self._taken_back(old)):
            if any(lo <= h.base_offset < hi for lo, hi in ranges):
                self.superseded += 1      # replaced by a rewrite
            else:
                items.append((chunk, h, durable))
        gb = self.groups[gid] = _GroupBuild(Group(
            gid, gid % self.active_groups, self.group_segments, self.segment_size_bytes,
            self.stream_id, self.streamlet))
        for chunk, h, durable in sorted(items, key=lambda item: item[1].base_offset):
            base, size = h.base_offset, len(chunk)
            if base < gb.group.head or base in gb.pending:
                self.duplicates += 1
            elif base > gb.group.head:
                gb.pending[base] = (chunk, h, durable)
                self.pending_bytes += size
            else:
                self._place(gb, chunk, h, durable)

    def _taken_back(self, gb: _GroupBuild) -> list:
        """The chunks placed in or waiting for a group under construction, copied out, and the
        group released (its placed chunks count as readable as far as its readable run)."""
        out = []
        for seg in gb.group.segments:
            for i in range(len(seg)):
                chunk = bytes(seg.view(i))
                out.append((chunk, read_header(chunk), seg.end_offset(i) <= gb.durable_end))
                self.chunks -= 1
                self.bytes -= len(chunk)
        for chunk, h, durable in gb.pending.values():
            self.pending_bytes -= len(chunk)
            out.append((chunk, h, durable))
        gb.group.release()
        return out

    def _number_gaps(self, ids: list[int], cuts: dict) -> list[tuple[int, int, str]]:
        """(slot, group, why) for each slot whose record numbers jump from one of its groups to
        the next (what the other rules cut away is not looked at): the earlier group lost its
        tail, or a whole group of the slot is missing, and no producer's sequences show it (the
        lost chunks' producers sent nothing later). What follows was never durable (see the
        module docstring): the later group goes, as after a hole inside a group, or the slot's
        numbers would skip records no one can read."""
        expect: dict[int, int] = {}
        out = []
        for gid in ids:
            group = self.groups[gid].group
            slot = group.slot
            c = cuts.get(slot)
            cut_away = c is not None and (gid > c[0] or (gid == c[0] and c[1] == 0))
            if cut_away or group.head == 0 or group.number_base is None:
                continue    # a group cut to a few chunks still starts where its numbers say
            nxt = expect.get(slot)
            if nxt is not None and group.number_base != nxt:
                out.append((slot, gid, f"records numbered from {group.number_base} after {nxt}"))
                cuts = {**cuts, slot: (gid, 0)}    # nothing of the slot is looked at after it
                continue
            expect[slot] = group.number_base + group.head
        return out

    def newest_entries(self) -> dict[int, Entry]:
        """Per producer, its newest kept chunk (for the duplicate-detection table)."""
        newest: dict[int, Entry] = {}
        for gid in sorted(self.groups):
            gb = self.groups[gid]
            k = 0
            for seg in gb.group.segments:
                for i in range(len(seg)):
                    pid = gb.pids[k]
                    if gb.nexts[k] != NO_SEQUENCE:
                        newest[pid] = Entry(gb.seqs[k], gid, seg.number, seg.bases[i],
                                            seg.end_offset(i))
                    k += 1
        return newest

    def release(self) -> None:
        """Drop everything (the stream was deleted, or the job abandoned)."""
        for gb in self.groups.values():
            gb.group.release()
            gb.pending.clear()
        self.groups.clear()
        self.rewrites.clear()
        self.pending_bytes = 0


# `next_sequence` of a chunk whose producer has no sequence rule (kera.broker.core
# txn.ANONYMOUS_PRODUCER_IDS with a Kafka batch): never a producer-table entry, never a cut.
NO_SEQUENCE = 2**64 - 1


def next_sequence(h) -> int:
    """The sequence the chunk after `h` of its producer has: kera's count chunks, Kafka's
    idempotent producers' count records (kera.broker.producers.classify_kafka); a compacted
    chunk (its sequence names its place in a rewrite) has none."""
    if h.flags & FLAG_SPARSE or h.producer_id == MARKER_PRODUCER_ID:
        return NO_SEQUENCE
    if not h.flags & FLAG_KAFKA:
        return txn.plain_sequence(h.sequence) + 1
    if txn.is_anonymous_kafka(h.producer_id):
        return NO_SEQUENCE
    return h.sequence + h.record_count


def _newest_whole(gens: dict) -> list | None:
    """The chunks of the newest whole rewrite among `gens` (generation -> piece -> (chunk,
    header, durable)): pieces 0 to the one marked last, back to back; None when none is."""
    for gen in sorted(gens, reverse=True):
        pieces = gens[gen]
        last = [p for p, (_, h, _) in pieces.items() if compacted(h).last]
        if len(last) != 1 or sorted(pieces) != list(range(last[0] + 1)):
            continue
        run = [pieces[p] for p in range(last[0] + 1)]
        if all(a[1].base_offset + offsets_covered(a[1]) == b[1].base_offset
               for a, b in zip(run, run[1:])):
            return run
    return None


def _run_end(run: list) -> int:
    h = run[-1][1]
    return h.base_offset + offsets_covered(h)


def _truncate(gb: _GroupBuild, keep: int) -> None:
    """Keep only the first `keep` chunks of a group under construction."""
    group = gb.group
    if keep >= len(gb.pids):
        return
    del gb.pids[keep:]
    del gb.seqs[keep:]
    del gb.nexts[keep:]
    left = keep
    for si, seg in enumerate(group.segments):
        n = len(seg)
        if left >= n:
            left -= n
            continue
        if left == 0:
            drop = group.segments[si:]
            del group.segments[si:]
            del group.seg_bases[si:]
        else:
            seg.used_bytes = seg.positions[left]
            for arr in (seg.positions, seg.sizes, seg.bases, seg.counts):
                del arr[left:]
            drop = group.segments[si + 1:]
            del group.segments[si + 1:]
            del group.seg_bases[si + 1:]
        for s in drop:
            s.release()
        break
    if group.segments:
        last = group.segments[-1]
        group.head = last.end_offset(len(last) - 1)
    else:
        group.head = 0
    gb.durable_end = min(gb.durable_end, group.head)


# ---------------------------------------------------------------------- installing

class Installed:
    """What `install` did: where the re-replication must reach (per virtual log, the
    position just after the last recovered reference) and figures for the stats."""
    __slots__ = ("targets", "groups", "chunks", "bytes", "readable_records")

    def __init__(self):
        self.targets: dict[object, tuple[int, int]] = {}
        self.groups = 0
        self.chunks = 0
        self.bytes = 0
        self.readable_records = 0

    def replicated(self) -> bool:
        return all((vlog.walk_seg, vlog.walk_idx) >= pos for vlog, pos in self.targets.items())


def install(core, rebuild: StreamletRebuild) -> Installed | None:
    """Make the rebuilt streamlet the broker's (None when its stream is gone)."""
    groups = rebuild.finish()
    stream = core.streams.get(rebuild.stream_id)
    if stream is None:
        rebuild.release()
        return None
    info = stream.info
    sl = rebuild.streamlet
    old = stream.streamlets.get(sl)
    if old is not None:
        # Something appeared there before recovery finished (a reload from the broker's own
        # disk): the replicas are the complete copy, so they win.
        log.warning("stream %s streamlet %d: replacing what was loaded with the data "
                    "recovered from the backups", info.name, sl)
        for waiter in old.release():
            core.fail_waiter(waiter, _not_ready())
    groups = _above_floor(info, sl, groups)
    streamlet = Streamlet(info.id, sl, info.active_groups, info.group_segments,
                          info.segment_size_bytes, core.placement, core.segment_pool)
    first = groups[0].id if groups else 0
    if first:
        streamlet.first_group = first
    streamlet.groups = groups
    stream.streamlets[sl] = streamlet   # before group_opened: it looks at the slot's history
    done = Installed()
    tier = getattr(core, "tier", None)
    for group in groups:
        gb = rebuild.groups[group.id]
        if group.head == 0:
            continue   # a placeholder: nothing to replicate or read
        group.closed = False
        # Stamped now by the retention clock (group_opened), not by its records' timestamps:
        # those are the producers' (any clock, any epoch), and an old one would have
        # retention delete a recovered group at once that its dead owner still kept.
        core.placement.group_opened(group)
        vlog = group.vlog
        for seg in group.segments:
            if tier is not None:
                tier.opened(seg)
            if vlog is not None:
                for i in range(len(seg)):
                    vlog.add(seg, i, seg.sizes[i])
        if vlog is not None:
            done.targets[vlog] = (len(vlog.vsegs) - 1, len(vlog.vsegs[-1]))
            group.durable = gb.durable_end
        else:
            group.durable = group.head
        group.closed = True
        core.placement.group_closed(group)
        done.groups += 1
        done.chunks += len(gb.pids)
        done.bytes += sum(s.used_bytes for s in group.segments)
        done.readable_records += group.durable
    streamlet.adopt_numbers()
    streamlet.adopt_floor(info.floors.get(sl))   # retention emptied a slot: go on after it
    _replay_locks(streamlet, groups, rebuild)
    for pid, entry in rebuild.newest_entries().items():
        core.producers.put((pid, info.id, sl), entry)
    rebuild_index(core.txn, info, streamlet)
    return done


def _slot(chunk, h: ChunkHeader, active_groups: int) -> int:
    """The slot a chunk was appended to: its producer's, or a marker's own (kera.codec.txn)."""
    if h.producer_id == MARKER_PRODUCER_ID:
        return txn.marker_slot(chunk, h) % active_groups
    return h.producer_id % active_groups


def _above_floor(info, sl: int, groups: list[Group]) -> list[Group]:
    """`groups` without those retention deleted before the streamlet's floor was reported
    (their replicas may not have been dropped yet): deleted data stays deleted."""
    floor = info.floors.get(sl)
    if floor is None or not groups or groups[0].id >= floor[0]:
        return groups
    kept = [g for g in groups if g.id >= floor[0]]
    log.info("stream %s streamlet %d: %d recovered groups below group %d had been deleted by "
             "retention: not restored", info.name, sl, len(groups) - len(kept), floor[0])
    return kept


def _locks_of(chunk) -> tuple[int, ...] | None:
    """A kept conditional chunk's lock ids; None when unreadable (then every lock is taken as
    written at the slot's end: conservative)."""
    try:
        return read_condition(Chunk(chunk, check=False))[0]
    except CorruptChunk:
        return None


def _replay_locks(streamlet: Streamlet, groups: list[Group], rebuild: StreamletRebuild) -> None:
    """The lock table the dead owner had, from the kept conditional chunks in number order.
    Locks written in groups retention deleted are unknown: the floor is then the number
    before the first kept record (kera.broker.locks)."""
    replay = []
    for group in groups:
        for end, locks in rebuild.groups[group.id].conditions:
            if end <= group.head and group.number_base is not None:
                replay.append((group.number_base + end - 1, locks))
    first = next((g for g in groups if g.head and g.number_base is not None), None)
    if not replay and (first is None or first.id == 0):
        return
    table = streamlet.lock_table()
    if first is not None and first.id > 0:
        table.floor = first.number_base - 1
    for number, locks in sorted(replay, key=lambda r: r[0]):
        if locks is None:
            table.floor = max(table.floor, number)
        else:
            table.record(locks, number)


def _not_ready():
    from kera.errors import NotReady
    return NotReady("the streamlet was replaced by its recovered copy; retry")
