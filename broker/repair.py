"""Repair of damaged tiered chunks: a chunk of a broker segment file that fails its checksum
when read (kera.broker.tier) is read back from a backup replica of its virtual segment.

Sans-IO: `start(seg, index)` finds where the chunk sits in its virtual log (virtual segment,
byte offset) and queues a `read_replica` of exactly that chunk; the shell sends what
`take_requests` returns and hands the outcome to `done`. A verified copy whose stamps match
(group, segment, record offset) is kept in memory beside the segment (`TierFile.repaired`) and
served from then on; the damaged file is left as it is for an operator to look at. While a
read is out, fetches of that chunk are answered `not_ready` (retriable); once no replica could
give it (R=1, a segment reloaded from disk whose replicas belong to an earlier incarnation, or
every replica failed), `corrupt_chunk` (not retriable) naming the file.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from kera.errors import CorruptChunk, KeraError

log = logging.getLogger(__name__)

REPAIR_READ_TIMEOUT_S = 5.0   # one read_replica of one chunk; then the next replica is tried


class RepairRead(NamedTuple):
    """A `read_replica` request to send: one chunk of one replica."""
    address: str
    fields: dict
    seg: object
    index: int
    candidates: tuple       # the other replicas' (backup id, address), tried after this one


def locate(seg, index: int):
    """(virtual log, virtual segment, byte offset, replicas holding it) of chunk `index` of
    `seg`, or None. A scan of the group's virtual log, newest first: a rare path (a damaged
    chunk), bounded by the log's retained references."""
    vlog = seg.group.vlog
    if vlog is None:
        return None
    for vs in reversed(vlog.vsegs):
        segs, idxs = vs.segs, vs.idxs
        for k in range(len(segs)):
            if segs[k] is seg and idxs[k] == index:
                offset = sum(segs[j].sizes[idxs[j]] for j in range(k))
                holders = tuple((r.backup_id, r.address) for r in vs.replicas
                                if r is not None and r.acked_idx > k)
                return vlog, vs, offset, holders
    return None


class Repairs:
    def __init__(self, core):
        self.core = core
        self._requests: list[RepairRead] = []

    def start(self, seg, index: int) -> bool:
        """Queue a read of a damaged chunk from a replica; False when no replica holds it."""
        found = locate(seg, index)
        if found is None or not found[3] or self.core.broker_id is None:
            return False
        vlog, vs, offset, holders = found
        fields = {"broker_id": self.core.broker_id, "vlog": vlog.id,
                  "vseg": vlog.vseg_base + vs.number, "offset": offset,
                  "max_bytes": seg.sizes[index]}
        self._queue(fields, seg, index, holders)
        return True

    def _queue(self, fields: dict, seg, index: int, holders: tuple) -> None:
        (_, address), rest = holders[0], holders[1:]
        self._requests.append(RepairRead(address, fields, seg, index, rest))

    def take_requests(self) -> list[RepairRead]:
        """`read_replica` requests to send for damaged tiered chunks."""
        out, self._requests = self._requests, []
        return out

    def done(self, req: RepairRead, header, frames, error: KeraError | None) -> None:
        """The outcome of a repair read: keep the verified copy, or try the next replica."""
        from kera.broker.recovery import parse_read_reply   # one parser of read_replica replies
        tf = req.seg.tier
        if tf is None:
            return                  # deleted meanwhile (retention, stream deleted)
        if error is None:
            try:
                _, chunks = parse_read_reply(header, frames, req.fields["offset"])
                error = self._accept(req, chunks)
            except CorruptChunk as err:
                error = err
            if error is None:
                return
        log.warning("repair of %s chunk %d from %s failed: %s: %s", tf.path, req.index,
                    req.address, error.code, error.message)
        if req.candidates:
            self._queue(req.fields, req.seg, req.index, req.candidates)
        else:
            tf.store.repair_failed(req.seg, req.index)

    def _accept(self, req: RepairRead, chunks) -> KeraError | None:
        seg, index = req.seg, req.index
        if not chunks:
            return CorruptChunk("the replica returned no chunk")
        view, h = chunks[0]
        if (h.group, h.segment, h.base_offset) != (seg.group.id, seg.number, seg.bases[index]) \
                or len(view) != seg.sizes[index]:
            return CorruptChunk(f"the replica's chunk is group {h.group} segment {h.segment} "
                                f"offset {h.base_offset}, not the damaged one")
        seg.tier.store.repaired(seg, index, bytes(view))
        return None
