"""Virtual logs: how a broker replicates (KerA's shared virtual logs).

A virtual log is shared by many groups of many streams. It is a sequence of *virtual segments*
that hold only references to chunks already stored in physical segments (segment object, chunk
index), in append order, up to `segment_bytes` of referenced chunk bytes. Each virtual segment
has R-1 replicas on backups, chosen when it is first synced; a replica receives the segment's
chunks as frames of `replicate` writes that append at an exact byte offset.

Durability advances in log order: a reference becomes durable once every current replica of its
virtual segment has acknowledged it, and references are walked strictly in order, so a group's
durable head (each group is served by exactly one virtual log) only moves forward over whole
chunks. A replica whose backup times out or fails is replaced by another backup that starts
empty: everything the virtual segment holds is sent again from offset 0, and the durable walk
waits for the new replica, so nothing is acknowledged on fewer than R copies. With no other
backup free, the same one is retried after a pause (see _replica_failed). Every write at offset
0 carries `reset`: the broker is the only writer of its virtual segments, so a backup discards
whatever it still holds of the replica (in memory or on disk) and takes the write as its new
content, rather than comparing it with a copy it may no longer have in memory. A chunk released
before a replica got it (compacted away, deleted by retention) goes there as a void chunk of its
size (kera.codec.chunk.void), so every copy of a virtual segment has one byte layout: a copy the
broker abandoned is a prefix of the current ones, and recovery, which reads the longest, finds
every acknowledged chunk.

Choice (documented in broker/README): one virtual log carries one replication factor and one
durability mode; the broker keeps V logs per (R, durability) pair that occurs. A log's writes
therefore always go to exactly R-1 backups with one `durability` value.
"""

from __future__ import annotations

import logging
from array import array
from bisect import insort
from dataclasses import dataclass

from kera.codec import wire
from kera.codec.chunk import crc32c, void
from kera.codec.frame_pack import pack
from kera.errors import BadRequest, KeraError, Throttled
from kera.daemon.metrics import Counters

log = logging.getLogger(__name__)

# A write carries at most this many chunks (so never more than wire.MAX_FRAMES frames, which
# the receiving daemon refuses); the rest go in the next write.
WRITE_CHUNKS_MAX = wire.MAX_FRAMES
# Virtual segments already wholly durable whose redundancy is being restored (a backup holding
# them died) are re-sent one at a time per log, so a backup loss cannot flood the network.
BACKGROUND_VSEGS_MAX = 1
THROTTLE_BACKOFF_S = 0.05
# A failed backup that cannot be replaced (no other is free) is retried after this pause.
RETRY_SAME_BACKUP_S = 0.5


@dataclass(slots=True, eq=False)
class Replica:
    backup_id: int
    address: str
    node: str
    sent_idx: int = 0        # references sent (in writes acknowledged or in flight)
    sent_bytes: int = 0
    acked_idx: int = 0       # references the backup acknowledged
    acked_bytes: int = 0
    in_flight: int = 0
    close_sent: bool = False
    close_acked: bool = False
    gen: int = 0             # bumped to disown writes in flight (rewind after `throttled`)
    retry_at: float = 0.0


@dataclass(slots=True, eq=False)
class ReplicationWrite:
    """One `replicate` request to one backup: what the server sends, and what the core needs
    back in `VirtualLog.write_done`."""
    vlog: "VirtualLog"
    vseg: "VirtualSegment"
    replica: Replica
    gen: int
    end_idx: int
    end_bytes: int
    close: bool
    address: str
    fields: dict
    frames: list
    sent_at: float
    chunks: int = 0
    done: bool = False

    @property
    def backup_id(self) -> int:
        return self.replica.backup_id

    @property
    def nbytes(self) -> int:
        return self.end_bytes - self.fields["offset"]


class VirtualSegment:
    __slots__ = ("number", "segs", "idxs", "nbytes", "closed", "finished", "replicas",
                 "excluded", "checksum")

    def __init__(self, number: int, copies: int):
        self.number = number
        self.segs: list = []            # physical Segment of each reference
        self.idxs = array("I")          # chunk index inside that segment
        self.nbytes = 0                 # chunk bytes referenced
        self.closed = False             # no more references will be added
        self.finished = False           # closed, and every replica acknowledged all and the close
        self.replicas: list[Replica | None] = [None] * copies
        self.excluded: dict[int, float] = {}   # backup id -> clock until which it is not reused
        self.checksum = 0               # CRC32C chained over the referenced chunks' header CRCs

    def __len__(self) -> int:
        return len(self.idxs)

    def durable_idx(self) -> int:
        """References acknowledged by every replica; 0 while a replica slot is empty."""
        best = len(self.idxs)
        for r in self.replicas:
            if r is None:
                return 0
            if r.acked_idx < best:
                best = r.acked_idx
        return best

    def all_acked(self) -> bool:
        n = len(self.idxs)
        return self.closed and all(r is not None and r.close_acked and r.acked_idx == n
                                   for r in self.replicas)



def _frames(segs: list, idxs, start: int, end: int) -> tuple[list, int, int]:
    """Payload of a write: references start..end, chunks adjacent in one segment sharing one
    frame, and short runs packed together (kera.codec.frame_pack). Returns (frames, bytes, chunks)."""
    runs, nbytes, chunks = _runs(segs, idxs, start, end)
    return pack(runs), nbytes, chunks


def _runs(segs: list, idxs, start: int, end: int) -> tuple[list, int, int]:
    """References start..end as views of the physical segments (no copy), chunks adjacent in
    one segment sharing one view. Returns (views, bytes, chunks)."""
    frames: list = []
    nbytes = chunks = 0
    run_seg = run_mv = None
    run_start = run_end = 0
    for k in range(start, end):
        seg = segs[k]
        i = idxs[k]
        size = seg.sizes[i]
        chunks += 1
        nbytes += size
        mv = seg.mv
        if mv is None:
            mv = seg.mapped()   # tiered to the broker's disk (kera.broker.tier): map it
            if mv is None:
                # Released (compacted away, retention, stream deleted) before this replica got
                # it: a void chunk of its size keeps every copy of the virtual segment in one
                # byte layout, so that a copy the broker abandoned is a prefix of the current
                # ones and recovery's longest copy holds every acknowledged chunk.
                if run_seg is not None:
                    frames.append(run_mv[run_start:run_end])
                    run_seg = None
                frames.append(void(size))
                continue
        pos = seg.positions[i]
        if seg is run_seg and pos == run_end:
            run_end += size
            continue
        if run_seg is not None:
            frames.append(run_mv[run_start:run_end])
        run_seg, run_mv, run_start, run_end = seg, mv, pos, pos + size
    if run_seg is not None:
        frames.append(run_mv[run_start:run_end])
    return frames, nbytes, chunks



class VirtualLog:
    def __init__(self, log_id: int, replication: int, durability: str, segment_bytes: int,
                 pool, *, in_flight_max: int = 1, exclude_s: float = 10.0,
                 counters: Counters | None = None, vseg_base: int = 0):
        assert replication >= 2, "R=1 streams are durable at append and need no virtual log"
        self.id = log_id
        # Added to segment numbers on the wire: the broker's epoch << 32, so the replicas of
        # each incarnation of a broker id have names of their own (kera.broker.recovery).
        self.vseg_base = vseg_base
        self.copies = replication - 1
        self.durability = durability
        self.segment_bytes = segment_bytes
        self.pool = pool
        self.in_flight_max = in_flight_max
        self.exclude_s = exclude_s
        self.counters = counters if counters is not None else Counters()
        self.vsegs: list[VirtualSegment] = []
        self.open: VirtualSegment | None = None
        self.unfinished: list[tuple[int, VirtualSegment]] = []   # (number, vseg), sorted
        self.walk_seg = 0                # durable walk: virtual segment number ...
        self.walk_idx = 0                # ... and reference index inside it
        self.lag_bytes = 0               # referenced bytes not yet durable
        self.active_groups = 0           # open groups this log serves (for spreading groups)
        # Virtual segments whose backup set changed since the coordinator last heard of it
        # (number -> segment, in change order; see kera.broker.replica_report).
        self.placement_changed: dict[int, VirtualSegment] = {}

    # ------------------------------------------------------------------ append
    def add(self, seg, index: int, size: int) -> None:
        """Reference chunk `index` of physical segment `seg` (already stored and stamped)."""
        vs = self.open
        if vs is None or (vs.nbytes and vs.nbytes + size > self.segment_bytes):
            if vs is not None:
                vs.closed = True
            vs = self.open = VirtualSegment(len(self.vsegs), self.copies)
            self.vsegs.append(vs)
            self.unfinished.append((vs.number, vs))
        vs.segs.append(seg)
        vs.idxs.append(index)
        vs.nbytes += size
        pos = seg.positions[index]
        vs.checksum = crc32c(seg.mv[pos + 4:pos + 8], vs.checksum)
        self.lag_bytes += size

    def close_open(self) -> None:
        """Close the open virtual segment (the next reference opens a new one)."""
        if self.open is not None:
            self.open.closed = True
            self.open = None

    @property
    def has_work(self) -> bool:
        return bool(self.unfinished)

    # ------------------------------------------------------------------ sync
    def sync(self, now: float, broker_id: int) -> list[ReplicationWrite]:
        """One write per replica that has unsent references (or an unsent close) and room in
        its in-flight window, carrying all of them (views of the segments, see _frames)."""
        writes: list[ReplicationWrite] = []
        background = 0
        for number, vs in self.unfinished:
            if number < self.walk_seg:  # already durable: restoring redundancy only
                if background >= BACKGROUND_VSEGS_MAX:
                    continue
                background += 1
            self._staff(vs, now)
            # Replicas that are level (the usual case) get the same references: their writes
            # share one payload, packed once (kera.codec.frame_pack's copy of short runs was a tenth
            # of a broker's samples at 4 KiB chunks, R=3, done once per replica).
            payloads: dict = {}
            for r in vs.replicas:
                if r is not None and r.in_flight < self.in_flight_max and r.retry_at <= now:
                    w = self._write(vs, r, now, broker_id, payloads)
                    if w is not None:
                        writes.append(w)
        return writes

    def _write(self, vs: VirtualSegment, r: Replica, now: float, broker_id: int,
               payloads: dict):
        """The next write to replica `r`, or None when it has nothing to send. `payloads` maps
        (start, end) references of `vs` to the payload already made for another replica's
        write (immutable: zmq sends the same frames to both)."""
        n = len(vs.idxs)
        start = r.sent_idx
        if start < n:
            end = min(n, start + WRITE_CHUNKS_MAX)
        elif vs.closed and not r.close_sent:
            end = n
        else:
            return None
        close = vs.closed and end == n
        payload = payloads.get((start, end))
        if payload is None:
            payload = payloads[start, end] = _frames(vs.segs, vs.idxs, start, end)
        frames, nbytes, chunks = payload
        fields = {"broker_id": broker_id, "vlog": self.id, "vseg": self.vseg_base + vs.number,
                  "offset": r.sent_bytes, "durability": self.durability, "close": close}
        if not r.sent_bytes:
            fields["reset"] = True   # (re)starting the replica: the backup drops what it holds
        r.sent_idx = end
        r.sent_bytes += nbytes
        r.in_flight += 1
        if close:
            r.close_sent = True
        c = self.counters
        c.add("replication_writes")
        c.add("replication_bytes", nbytes)
        c.add("replication_chunks", chunks)
        c.add("replication_frames", len(frames))
        return ReplicationWrite(self, vs, r, r.gen, end, r.sent_bytes, close, r.address, fields,
                                frames, now, chunks)

    def _staff(self, vs: VirtualSegment, now: float) -> None:
        """Fill empty replica slots with live backups (distinct, spread, see BackupPool)."""
        if all(r is not None for r in vs.replicas):
            return
        holders = {r.backup_id for r in vs.replicas if r is not None}
        exclude = holders | {bid for bid, until in vs.excluded.items() if until > now}
        used_nodes = {r.node for r in vs.replicas if r is not None}
        for slot, r in enumerate(vs.replicas):
            if r is not None:
                continue
            b = self.pool.choose(exclude, used_nodes, now)
            if b is None:
                # Only backups that recently failed this segment are left (e.g. one declared
                # dead that came back): take one of them again rather than leave the segment
                # short of copies, and every produce request on it waiting, until the
                # exclusion ends. It starts over from offset 0 with `reset`, which makes it
                # discard what it still holds of the segment.
                b = self.pool.choose(holders, used_nodes, now)
            if b is None:
                return
            self.pool.assign(b.id)
            vs.replicas[slot] = Replica(b.id, b.address, b.node)
            exclude.add(b.id)
            holders.add(b.id)
            used_nodes.add(b.node)
            self.placement_changed[vs.number] = vs
            log.debug("vlog %d vseg %d: replica on backup %d (%s)", self.id, vs.number, b.id, b.address)

    # ------------------------------------------------------------------ acknowledgements
    def write_done(self, w: ReplicationWrite, header: dict | None, error: KeraError | None,
                   now: float) -> dict:
        """Account for a write's reply (or its failure); returns {group: durable end offset}
        for the groups whose durable head moved."""
        if w.done:
            return {}
        w.done = True
        vs, r = w.vseg, w.replica
        if r.gen != w.gen or not any(x is r for x in vs.replicas):
            return {}  # the replica was replaced or rewound since: this reply says nothing
        r.in_flight -= 1
        if error is None:
            length = header.get("length") if isinstance(header, dict) else None
            if not isinstance(length, int) or isinstance(length, bool) or length != w.end_bytes:
                error = BadRequest(f"backup stored {length!r} bytes, expected {w.end_bytes}")
        if error is not None:
            self._replica_failed(vs, r, error, now)
            return {}
        if w.end_idx > r.acked_idx:
            r.acked_idx = w.end_idx
            r.acked_bytes = w.end_bytes
        if w.close:
            r.close_acked = True
        updates = self._advance()
        if vs.all_acked():
            self._finish(vs)
        return updates

    def _replica_failed(self, vs: VirtualSegment, r: Replica, error: KeraError, now: float) -> None:
        if isinstance(error, Throttled):
            # Alive but full of unflushed buffers: the same backup, after a pause.
            self._retry_same(r, now + THROTTLE_BACKOFF_S, from_zero=False)
            self.counters.add("replication_throttled")
            return
        self.counters.add("replica_failures")
        exclude = {x.backup_id for x in vs.replicas if x is not None}
        exclude.update(bid for bid, until in vs.excluded.items() if until > now)
        used_nodes = {x.node for x in vs.replicas if x is not None and x is not r}
        if self.pool.choose(exclude, used_nodes, now) is None:
            # No other backup to move to: keep this one. After a timeout or a storage error
            # resend from what it acknowledged (the protocol makes a repeated write
            # idempotent); after anything else (its replica is not what we think) restart it
            # from offset 0 (with `reset`: it discards what it holds).
            from_zero = error.code not in ("timeout", "storage_error")
            log.warning("vlog %d vseg %d: backup %d (%s) failed (%s: %s) and no other is free; "
                        "retrying it%s", self.id, vs.number, r.backup_id, r.address, error.code,
                        error.message, " from offset 0" if from_zero else "")
            self._retry_same(r, now + RETRY_SAME_BACKUP_S, from_zero)
            return
        log.warning("vlog %d vseg %d: backup %d (%s) failed (%s: %s); re-replicating elsewhere",
                    self.id, vs.number, r.backup_id, r.address, error.code, error.message)
        self._drop_replica(vs, r, now)
        self.pool.suspect(r.backup_id, now + self.exclude_s)

    @staticmethod
    def _retry_same(r: Replica, retry_at: float, from_zero: bool) -> None:
        """Rewind a replica: writes still in flight to it are disowned (new generation) and will
        be refused by the backup anyway (their offsets no longer match what it stores)."""
        r.gen += 1
        r.in_flight = 0
        if from_zero:
            r.acked_idx = r.acked_bytes = 0
            r.close_acked = False
        r.sent_idx, r.sent_bytes = r.acked_idx, r.acked_bytes
        r.close_sent = r.close_acked
        r.retry_at = retry_at

    def _drop_replica(self, vs: VirtualSegment, r: Replica, now: float) -> None:
        slot = next(i for i, x in enumerate(vs.replicas) if x is r)
        vs.replicas[slot] = None
        r.gen += 1
        vs.excluded[r.backup_id] = now + self.exclude_s
        self.placement_changed[vs.number] = vs
        if vs.finished:
            # Wholly replicated once: its remaining replicas count as load again until the
            # replacement has caught up.
            vs.finished = False
            insort(self.unfinished, (vs.number, vs), key=lambda e: e[0])
            for other in vs.replicas:
                if other is not None:
                    self.pool.assign(other.backup_id)
        else:
            self.pool.unassign(r.backup_id)

    def backups_lost(self, lost: set[int], now: float) -> int:
        """Replace every replica held by a backup that died, in every virtual segment this log
        still references (finished ones too: their redundancy is restored in the background).
        Returns how many replicas were dropped."""
        dropped = 0
        for vs in self.vsegs:
            for r in list(vs.replicas):
                if r is not None and r.backup_id in lost:
                    self._drop_replica(vs, r, now)
                    dropped += 1
        return dropped

    def _finish(self, vs: VirtualSegment) -> None:
        vs.finished = True
        self.unfinished = [e for e in self.unfinished if e[1] is not vs]
        for r in vs.replicas:
            self.pool.unassign(r.backup_id)

    def _advance(self) -> dict:
        """Walk references that every replica now holds, in log order."""
        updates: dict = {}
        vsegs = self.vsegs
        while self.walk_seg < len(vsegs):
            vs = vsegs[self.walk_seg]
            limit = vs.durable_idx()
            i = self.walk_idx
            if limit > i:
                segs, idxs = vs.segs, vs.idxs
                lag = 0
                for k in range(i, limit):
                    seg = segs[k]
                    ci = idxs[k]
                    updates[seg.group] = seg.bases[ci] + seg.counts[ci]
                    lag += seg.sizes[ci]
                self.lag_bytes -= lag
                self.walk_idx = limit
            if vs.closed and self.walk_idx == len(vs.idxs):
                self.walk_seg += 1
                self.walk_idx = 0
                continue
            break
        assert self.lag_bytes >= 0, "durable walk passed the appended references"
        return updates

    # ------------------------------------------------------------------ views
    def describe(self) -> dict:
        return {"id": self.id, "copies": self.copies, "durability": self.durability,
                "vsegs": len(self.vsegs), "unfinished": len(self.unfinished),
                "lag_bytes": self.lag_bytes, "active_groups": self.active_groups,
                "walk": [self.walk_seg, self.walk_idx]}
