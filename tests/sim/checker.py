"""The guarantees of DESIGN.md, checked while the simulation runs and once it has healed.

Where each is checked, at the moment it could first break:

1. *An acknowledged chunk is on R copies.* A backup's `replicate` reply is checked against its
   store when it is sent (the replica really holds that many bytes; fsynced ones for "disk"),
   and the chunks it covers are recorded as held by that backup. When a broker answers
   `produce`, every chunk it acknowledges must be in its own segments (at the position it
   names, with the producer's identity) and recorded as held by R-1 distinct backups.
2. *Consumers see only durable data.* Every chunk a broker's `fetch` returns lies below its
   group's durable head and is held by R-1 distinct backups.
3. *One producer's records of a streamlet are read in send order.* Each record names its
   producer, streamlet and number; per consumer each (producer, streamlet) must strictly grow.
4. *A retried chunk is stored once.* A broker must answer every attempt of (producer id,
   stream, streamlet, sequence) with one position; after the run, no two stored chunks share
   that identity.

Record numbers (issue 16): a broker's produce reply names the chunk's first record number,
which must be what the stored chunk carries and the same on every answer for that chunk
(across failovers); after healing, each slot of each streamlet is numbered densely, chunk
after chunk, from 0 (or from wherever retention left its first group).
6. *Bad input never crashes a daemon.* The shell fails the run on anything but a KeraError.

After healing: every record a producer saw acknowledged is read by every consumer exactly once
(3 makes "at most once"; this adds "at least once"), each broker holds every chunk it
acknowledged, and every such chunk is back on R-1 live backups' stores (redundancy restored
after backup crashes). Corrupt bytes a backup serves, or a corruption it reports where none
was injected, fail the run too (the read-back checksum).
"""

from __future__ import annotations

from collections import defaultdict

from kera.codec import chunk
from kera.backup.frames import split_chunks

from tests.sim.shell import SimFailure


class InvariantBroken(SimFailure):
    pass


class DataLost(InvariantBroken):
    """Acknowledged data is gone (stream `stream_id`, R `replication` if known): a bug, unless
    more data-losing failures overlapped than R-1 copies cover (tests/sim/cluster.py)."""

    def __init__(self, stream_id: int, replication: int | None, message: str):
        super().__init__(message)
        self.stream_id = stream_id
        self.replication = replication


def chunk_id(h: chunk.ChunkHeader) -> tuple:
    """A stored chunk's identity: where it sits and whose it is."""
    return (h.stream_id, h.streamlet, h.group, h.base_offset, h.producer_id, h.sequence, h.body_crc)


def record_value(client: int, sid: int, sl: int, n: int, pad: int) -> bytes:
    return b"%d/%d/%d/%d|" % (client, sid, sl, n) + b"x" * pad


def parse_value(value: bytes) -> tuple[int, int, int, int]:
    client, sid, sl, n = value.split(b"|", 1)[0].split(b"/")
    return int(client), int(sid), int(sl), int(n)


class _Written:
    """Chunks a backup incarnation accepted for one replica: (end offset, id), in order."""
    __slots__ = ("entries", "by_end", "marked", "last_end")

    def __init__(self):
        self.entries: list = []
        self.by_end: dict[int, tuple] = {}
        self.marked = 0
        self.last_end = 0


class Checker:
    def __init__(self):
        self.held: dict[tuple, dict[int, int]] = {}     # chunk id -> {backup id: incarnation}
        self._written: dict[tuple, _Written] = {}
        # chunk id -> (broker address, broker incarnation, R) of the first acknowledgement
        self.acked_chunks: dict[tuple, tuple] = {}
        # (producer id, stream, streamlet, sequence) -> (g, base): where brokers said it went.
        # Global: a new owner that recovered a streamlet must answer with the same positions.
        self._positions: dict[tuple, tuple] = {}
        # ... -> the record number brokers said its first record has.
        self._numbers: dict[tuple, int | None] = {}
        self.produced: dict[tuple, set] = defaultdict(set)    # (client, sid, sl) -> acked n
        self.failed: dict[tuple, set] = defaultdict(set)      # ... reported failed
        self.read: dict[str, dict] = defaultdict(lambda: defaultdict(set))
        self._last_read: dict[str, dict] = defaultdict(dict)
        self.counts: dict[str, int] = defaultdict(int)
        # (sid, sl) that may lose data by design (R=1 on a broker that failed over): their
        # positions may be reused, and they leave the end checks.
        self.lossy: set = set()
        # Stream ids whose acknowledged chunks move by design (compacted: a pass replaces them):
        # the chunk-level end checks leave them to tests/sim/compaction.Ledger's key checks.
        self.moving: set = set()

    def fail(self, message: str) -> None:
        raise InvariantBroken(message)

    # ------------------------------------------------------------------ backups
    def backup_accepted(self, bid: int, inc: int, key: tuple, offset: int, frames) -> None:
        """The store took a replicate write (answered now or once flushed)."""
        w = self._written.get((bid, inc, key))
        if w is None:
            w = self._written[(bid, inc, key)] = _Written()
        end = offset
        for c in split_chunks(frames):
            end += len(c)
            cid = chunk_id(chunk.read_header(c))
            if end > w.last_end:
                w.entries.append((end, cid))
                w.by_end[end] = cid
                w.last_end = end
            elif w.by_end.get(end, cid) != cid:
                self.fail(f"backup {bid} accepted chunk {cid} at byte {end - len(c)} of replica "
                          f"{key}, where it had accepted {w.by_end[end]}")

    def backup_reset(self, bid: int, inc: int, key: tuple) -> None:
        """A `replicate` write with `reset`: the backup discards what it holds of the replica
        and takes the write as its new content, which need not repeat the old (chunks deleted
        since shift offsets). What it acknowledged before stays in `held`, as at a crash."""
        self._written.pop((bid, inc, key), None)

    def backup_replied(self, bid: int, inc: int, key: tuple, length: int, durability: str,
                       store, disk) -> None:
        """A backup acknowledges `length` bytes of a replica: check its store holds them (an
        empty write to a replica it does not hold creates nothing: kera.backup.store)."""
        r = store.replicas.get(key)
        if length and (r is None or r.length < length):
            self.fail(f"backup {bid} acknowledged {length} bytes of replica {key} but holds "
                      f"{None if r is None else r.length}")
        if durability == "disk" and length:
            meta = disk.metas.get(key)
            if r.flushed_length < length or meta is None or meta.length < length:
                self.fail(f"backup {bid} acknowledged {length} bytes of replica {key} with "
                          f"durability disk, but {r.flushed_length} are flushed and its record "
                          f"names {None if meta is None else meta.length}")
        w = self._written.get((bid, inc, key))
        if w is None:
            return
        entries = w.entries
        while w.marked < len(entries) and entries[w.marked][0] <= length:
            self.held.setdefault(entries[w.marked][1], {})[bid] = inc
            w.marked += 1
        self.counts["backup_acks"] += 1

    # ------------------------------------------------------------------ brokers
    def produce_answered(self, broker, headers: list, results) -> None:
        """A broker sends a produce reply: every chunk it acknowledges is stored and on R copies."""
        core = broker.core
        for h, r in zip(headers, results):
            if h is not None and r == []:
                self._check_unplaced(broker, h)
                continue
            if h is None or not (isinstance(r, list) and len(r) in (3, 4) and isinstance(r[0], int)):
                continue
            g, segno, base = r[:3]
            stored, group, stream = self._stored_chunk(core, h.stream_id, h.streamlet, g, base)
            if h.stream_id in self.moving and self._compacted_at(group, base):
                # A retry of a chunk stored before a pass replaced it: the broker names where
                # it went (tests/sim/compaction.py checks its records by key).
                self.counts["chunks_acked_compacted"] += 1
                continue
            where = (f"broker {broker.address} acknowledged chunk (producer {h.producer_id}, seq "
                     f"{h.sequence}, stream {h.stream_id}/{h.streamlet}) at group {g} offset {base}")
            if stored is None:
                self.fail(f"{where}, where it holds no chunk")
            if (stored.producer_id, stored.sequence, stored.body_crc) != (h.producer_id, h.sequence, h.body_crc):
                self.fail(f"{where}, where it holds producer {stored.producer_id} seq {stored.sequence}")
            if stored.segment != segno:
                self.fail(f"{where} in segment {segno}, but it is in segment {stored.segment}")
            if group.durable < base + stored.record_count:
                self.fail(f"{where} beyond the durable head {group.durable}")
            cid = chunk_id(stored)
            replication = stream.info.replication
            holders = self.held.get(cid, {})
            if len(holders) < replication - 1:
                self.fail(f"{where} with R={replication} while only backups {sorted(holders)} "
                          f"acknowledged holding it (guarantee 1)")
            ident = (h.producer_id, h.stream_id, h.streamlet, h.sequence)
            before = self._positions.setdefault(ident, (g, base))
            if before != (g, base) and (h.stream_id, h.streamlet) not in self.lossy:
                self.fail(f"{where}, but acknowledged the same chunk at group {before[0]} offset "
                          f"{before[1]} before: stored twice or answered with another position "
                          f"(guarantee 4)")
            self._check_number(where, ident, r, stored)
            self.acked_chunks.setdefault(cid, (broker.address, broker.incarnation, replication))
            self.counts["chunks_acked_by_brokers"] += 1

    def _check_unplaced(self, broker, h) -> None:
        """An acknowledgement without a position (a retry of an older chunk than the broker's
        duplicate scan): the chunk is stored in the streamlet, durable, and on R-1 backups."""
        core = broker.core
        stream = core.streams.get(h.stream_id)
        streamlet = stream.streamlets.get(h.streamlet) if stream is not None else None
        found = None if streamlet is None else streamlet.find_chunk(h.producer_id, h.sequence, 1 << 30)
        where = (f"broker {broker.address} acknowledged chunk (producer {h.producer_id}, seq "
                 f"{h.sequence}, stream {h.stream_id}/{h.streamlet}) without a position")
        if found is None and h.stream_id in self.moving:
            self.counts["chunks_acked_unplaced_compacted"] += 1   # stored, then a pass replaced it
            return
        if found is None:
            self.fail(f"{where}, but holds no such chunk")
        group, seg, i, _ = found
        stored = chunk.read_header(seg.view(i))
        if stored.body_crc != h.body_crc:
            self.fail(f"{where}, but holds other bytes under that sequence")
        if group.durable < seg.bases[i] + stored.record_count:
            self.fail(f"{where} beyond the durable head {group.durable}")
        holders = self.held.get(chunk_id(stored), {})
        if len(holders) < stream.info.replication - 1:
            self.fail(f"{where} with R={stream.info.replication} while only backups "
                      f"{sorted(holders)} acknowledged holding it (guarantee 1)")
        self.counts["chunks_acked_unplaced"] += 1

    def _check_number(self, where: str, ident: tuple, r: list, stored) -> None:
        number = r[3] if len(r) == 4 else None
        if number != stored.number:
            self.fail(f"{where} with record number {number}, but the stored chunk carries "
                      f"{stored.number}")
        before = self._numbers.setdefault(ident, number)
        if before != number and (ident[1], ident[2]) not in self.lossy:
            self.fail(f"{where} with record number {number}, but answered {before} for the "
                      f"same chunk before: numbers must survive failover")
        self.counts["numbers_acked"] += number is not None

    @staticmethod
    def _compacted_at(group, base: int) -> bool:
        """Whether offset `base` of `group` lies in a chunk a compaction pass wrote."""
        loc = group.locate(base) if group is not None else None
        if loc is None:
            return False
        view = group.segments[loc[0]].view(loc[1])
        return view is not None and chunk.compacted(chunk.read_header(view)) is not None

    @staticmethod
    def _stored_chunk(core, sid: int, sl: int, g: int, base: int):
        stream = core.streams.get(sid)
        streamlet = stream.streamlets.get(sl) if stream is not None else None
        group = streamlet.group(g) if streamlet is not None else None
        loc = group.locate(base) if group is not None else None
        if loc is None:
            return None, group, stream
        seg = group.segments[loc[0]]
        if seg.bases[loc[1]] != base:
            return None, group, stream
        view = seg.view(loc[1])
        return (chunk.read_header(view) if view is not None else None), group, stream

    def fetch_served(self, broker, frames) -> None:
        """A broker sends a fetch reply: nothing beyond the durable head, nothing on fewer
        than R copies (guarantee 2)."""
        core = broker.core
        for frame in frames:
            buf = memoryview(frame)
            at = 0
            while at < len(buf):
                h = chunk.read_header(buf[at:])
                at += h.size
                stream = core.streams[h.stream_id]
                group = stream.streamlets[h.streamlet].group(h.group)
                if h.base_offset + h.record_count > group.durable:
                    self.fail(f"broker {broker.address} served records {h.base_offset}.."
                              f"{h.base_offset + h.record_count} of group {h.group} (stream "
                              f"{h.stream_id}/{h.streamlet}) beyond its durable head {group.durable}")
                replication = stream.info.replication
                holders = self.held.get(self._served_id(core, h), {})
                if len(holders) < replication - 1:
                    self.fail(f"broker {broker.address} served chunk group {h.group} offset "
                              f"{h.base_offset} (stream {h.stream_id}/{h.streamlet}, R="
                              f"{replication}) held by backups {sorted(holders)} only (guarantee 2)")
                self.counts["chunks_fetched"] += 1

    def _served_id(self, core, h) -> tuple:
        """The stored chunk a served one stands for: itself, but for the empty gap a
        read_committed fetch serves in place of a transaction's marker or aborted chunk
        (kera.broker.txn_writes), which stands for the stored chunk at its position."""
        if h.record_count or chunk.compacted(h) is None or chunk_id(h) in self.held:
            return chunk_id(h)
        stored, _, _ = self._stored_chunk(core, h.stream_id, h.streamlet, h.group, h.base_offset)
        return chunk_id(h) if stored is None else chunk_id(stored)

    # ------------------------------------------------------------------ clients
    def producer_outcome(self, client: int, sid: int, sl: int, first: int, end: int, acked: bool) -> None:
        (self.produced if acked else self.failed)[(client, sid, sl)].update(range(first, end))
        self.counts["records_acked" if acked else "records_failed"] += end - first

    def consumed(self, consumer: str, sid: int, sl: int, values) -> None:
        last = self._last_read[consumer]
        read = self.read[consumer]
        for v in values:
            client, vsid, vsl, n = parse_value(v)
            if (vsid, vsl) != (sid, sl):
                self.fail(f"{consumer} read record {client}/{vsid}/{vsl}/{n} from stream {sid} "
                          f"streamlet {sl}")
            key = (client, sid, sl)
            if n <= last.get(key, -1):
                self.fail(f"{consumer} read record {n} of producer {client} (stream {sid} "
                          f"streamlet {sl}) after record {last[key]}: out of order or twice "
                          f"(guarantee 3)")
            last[key] = n
            read[key].add(n)
        self.counts["records_read"] += len(values)

    # ------------------------------------------------------------------ after healing
    def unread(self, consumer: str, stream_id: int, lost_streamlets: set) -> int:
        """Records of the stream acknowledged to producers that `consumer` has not read yet."""
        read = self.read[consumer]
        return sum(len(ns - read[key]) for key, ns in self.produced.items()
                   if key[1] == stream_id and (key[1], key[2]) not in lost_streamlets)

    def check_read_all(self, consumers: list[tuple[str, int]], lost_streamlets: set) -> None:
        """Every consumer (name, stream id) read every acknowledged record of its stream."""
        for consumer, stream_id in consumers:
            read = self.read[consumer]
            for key, ns in sorted(self.produced.items()):
                if key[1] != stream_id or (key[1], key[2]) in lost_streamlets:
                    continue
                missing = ns - read[key]
                if missing:
                    raise DataLost(key[1], None, f"{consumer} never read {len(missing)} acknowledged records of "
                              f"producer {key[0]} stream {key[1]} streamlet {key[2]} (first "
                              f"{min(missing)}) after the cluster healed")

    def check_brokers_hold(self, owners: dict) -> None:
        """Every acknowledged chunk is held by its streamlet's owner: `owners` maps
        (stream id, streamlet) to the live broker owning it (streamlets absent are skipped)."""
        for cid in self.acked_chunks:
            b = owners.get(cid[:2])
            if b is None or cid[0] in self.moving:
                continue
            stored, _, _ = self._stored_chunk(b.core, *cid[:4])
            if stored is None or chunk_id(stored) != cid:
                raise DataLost(cid[0], self.acked_chunks[cid][2], f"broker {b.address}, owner of stream {cid[0]} streamlet {cid[1]}, does "
                          f"not hold acknowledged chunk {cid} (group {cid[2]} offset {cid[3]})")

    def check_stored_once(self, brokers) -> None:
        for b in brokers:
            if not b.up:
                continue
            seen: dict = {}
            for sid, stream in b.core.streams.items():
                for sl, streamlet in stream.streamlets.items():
                    for group in streamlet.groups:
                        for seg in group.segments:
                            for i in range(len(seg)):
                                h = chunk.read_header(seg.view(i))
                                if chunk.compacted(h) is not None or h.producer_id == chunk.MARKER_PRODUCER_ID:
                                    continue   # a pass's piece, a transaction's marker: no sequence
                                ident = (h.producer_id, sid, sl, h.sequence)
                                if ident in seen:
                                    self.fail(f"broker {b.address} stores chunk {ident} twice: "
                                              f"group {seen[ident]} and {group.id} (guarantee 4)")
                                seen[ident] = group.id
                    self.check_numbers_dense(b.address, sid, sl, streamlet)

    def check_numbers_dense(self, address: str, sid: int, sl: int, streamlet) -> None:
        """Each slot's stored chunks carry numbers that follow on, chunk after chunk, from 0
        when the streamlet still holds its first group."""
        nxt: dict[int, int] = {}
        for group in streamlet.groups:
            for seg in group.segments:
                for i in range(len(seg)):
                    h = chunk.read_header(seg.view(i))
                    expect = nxt.get(group.slot, 0 if streamlet.first_group == 0 else h.number)
                    if h.number != expect:
                        self.fail(f"broker {address} stream {sid} streamlet {sl} group "
                                  f"{group.id} offset {h.base_offset}: record number {h.number}, "
                                  f"expected {expect} (slot {group.slot} numbered densely)")
                    nxt[group.slot] = h.number + chunk.offsets_covered(h)   # a pass's gaps too
