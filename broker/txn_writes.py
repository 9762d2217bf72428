"""The broker's side of transactions, beside its core: the transaction indexes of the streamlets
it owns, the chunks awaiting the coordinator's verification, and what a read_committed reader
is served. Sans-IO (docs/TRANSACTIONS.md, step 4).

- Verification (KIP-890 part 1): before the first transactional chunk of a (producer, streamlet
  slot) is appended, the coordinator is asked `txn_verify` with `add` (which joins the part to
  the producer's transaction). The chunk, and every later chunk of that producer to that
  streamlet, waits in a bounded queue until the answer: a refusal answers them all with its
  error (ProducerFenced...), an acceptance appends them in order with the transaction's number.
- Reads: a read_committed reader stops at the per-group stable bound (kera.broker.transactions)
  and, in both isolations, control chunks are skipped; read_committed skips aborted chunks too.
  A run of skipped chunks is served as one empty compacted chunk covering its records (the
  reader steps over its span as over a compaction's gap: kera.consumer.cursor).
"""

from __future__ import annotations

from kera.broker.transactions import StreamletTxns
from kera.codec import txn
from kera.codec.chunk import (COMPACTED_PRODUCER_ID, FLAG_KAFKA, encode_sparse, frame_chunks,
                              read_header, stamp)

# Chunks held while their producer's first transactional write to a streamlet is verified, all
# producers together: each is a chunk's bytes (at most a segment), so this bounds the memory
# they hold; past it a chunk is refused `throttled` (retriable) before anything is stored.
VERIFY_QUEUED_MAX = 4096
# Verifications in flight at once: one per (producer, streamlet), answered in a coordinator round
# trip; more queue in the coordinator's loop without going faster.
VERIFY_IN_FLIGHT_MAX = 1024
# The rewrite generation an empty gap chunk names (kera.codec.chunk.compacted_sequence wants one
# above 0): gap chunks are made for a reply, never stored, so no rewrite is theirs.
GAP_GENERATION = 1

# An open transaction held longer than the longest transaction timeout (kera.coordinator.
# transactions TIMEOUT_MS_MAX, 15 min) plus a coordinator failover's worth is asked about
# (`txn_resolve`): its coordinator forgot it or its marker is lost, and it holds every
# read_committed reader of its slot back. Open transactions are looked at every RESOLVE_SCAN_S
# (a scan of the open ones only).
RESOLVE_AFTER_S = 900.0 + 60.0
RESOLVE_SCAN_S = 10.0

READ_COMMITTED = "read_committed"
READ_UNCOMMITTED = "read_uncommitted"
ISOLATIONS = (READ_COMMITTED, READ_UNCOMMITTED)

VerifyKey = tuple[int, int, int]    # (kera producer id, stream id, streamlet)


class Queued:
    """A held chunk: its bytes and where its answer goes (result `index` of `pending`, a
    kera.broker.core.Pending, set once the produce request made one)."""
    __slots__ = ("buf", "pending", "index")

    def __init__(self, buf: bytes, index: int):
        self.buf, self.index = buf, index
        self.pending = None


class Verification:
    """One `txn_verify` asked: the chunks waiting for its answer, in arrival order."""
    __slots__ = ("key", "fields", "queued", "sent")

    def __init__(self, key: VerifyKey, fields: dict):
        self.key = key
        self.fields = fields
        self.queued: list[Queued] = []
        self.sent = False


class TxnWrites:
    """Per broker: indexes by (stream id, streamlet) and verifications by VerifyKey."""
    __slots__ = ("indexes", "verifying", "queued_count", "open_seen", "resolving", "next_scan")

    def __init__(self):
        self.indexes: dict[tuple[int, int], StreamletTxns] = {}
        self.verifying: dict[VerifyKey, Verification] = {}
        self.queued_count = 0
        # (sid, sl, producer id) -> when a scan first saw its transaction open (monotonic s)
        self.open_seen: dict[tuple[int, int, int], float] = {}
        self.resolving: set[tuple[int, int, int]] = set()
        self.next_scan = 0.0

    def index(self, sid: int, sl: int, slots: int) -> StreamletTxns:
        idx = self.indexes.get((sid, sl))
        if idx is None:
            idx = self.indexes[(sid, sl)] = StreamletTxns(slots)
        return idx

    def drop_stream(self, sid: int) -> None:
        for key in [k for k in self.indexes if k[0] == sid]:
            del self.indexes[key]

    # ------------------------------------------------------------------ verification
    def can_queue(self) -> bool:
        return self.queued_count < VERIFY_QUEUED_MAX and len(self.verifying) < VERIFY_IN_FLIGHT_MAX

    def queue(self, key: VerifyKey, stream: str, buf, index: int, add: bool = True) -> Queued:
        """Hold chunk `buf` (result `index` of its request) until `key`'s verification answers;
        asks it if none is in flight. `add`: the verification joins the part to the
        transaction (kera's producers); without it the part must have been added (a Kafka
        client's AddPartitionsToTxn)."""
        v = self.verifying.get(key)
        if v is None:
            pid, epoch = txn.split_producer_id(key[0])
            v = self.verifying[key] = Verification(key, {
                "producer_id": pid, "epoch": epoch, "part": [stream, key[2]], "add": add})
        q = Queued(bytes(buf), index)
        v.queued.append(q)
        self.queued_count += 1
        return q

    def take_requests(self) -> list[tuple[VerifyKey, dict]]:
        """`txn_verify` requests not yet sent: (key, fields) each; answer with `answered`."""
        out = []
        for v in self.verifying.values():
            if not v.sent:
                v.sent = True
                out.append((v.key, v.fields))
        return out

    def answered(self, key: VerifyKey) -> list[Queued]:
        """The chunks that waited for `key`'s verification, now to append or refuse."""
        v = self.verifying.pop(key, None)
        if v is None:
            return []
        self.queued_count -= len(v.queued)
        return v.queued


    # ------------------------------------------------------------------ resolution
    def stale_opens(self, now: float) -> list[tuple[tuple[int, int, int], int]]:
        """((sid, sl, producer id), epoch) of the open transactions held past RESOLVE_AFTER_S
        and not being asked about; at most one scan every RESOLVE_SCAN_S."""
        if now < self.next_scan:
            return []
        self.next_scan = now + RESOLVE_SCAN_S
        seen, out = {}, []
        for (sid, sl), idx in self.indexes.items():
            for s in idx.slots:
                for pid, o in s.open.items():
                    key = (sid, sl, pid)
                    seen[key] = since = self.open_seen.get(key, now)
                    if now - since >= RESOLVE_AFTER_S and key not in self.resolving:
                        self.resolving.add(key)
                        out.append((key, o.epoch))
        self.open_seen = seen
        return out

    def resolved(self, key: tuple[int, int, int], now: float) -> None:
        """`key`'s txn_resolve answered (or failed): asked again RESOLVE_AFTER_S from now
        if it stays open."""
        self.resolving.discard(key)
        if key in self.open_seen:
            self.open_seen[key] = now


# ---------------------------------------------------------------------- reads

def filter_views(views: list, idx: StreamletTxns, slot: int, limit: int,
                 committed: bool) -> tuple[list, int, int]:
    """(views, bytes, chunks) of the chunks in `views` (whole chunks back to back, one group's,
    as Group.read returns them) that a reader of this isolation is served: none at or past
    offset `limit`; control chunks, and with `committed` aborted chunks, replaced by one empty
    gap chunk per run of them."""
    out: list = []
    nbytes = chunks = 0
    run = None   # [header of the run's first chunk, records covered]
    for view in views:
        for c in frame_chunks(view):
            h = read_header(c)
            if h.base_offset >= limit:
                break
            if _skipped(idx, slot, h, c, committed):
                run = [h, 0] if run is None else run
                run[1] += h.record_count
                continue
            if run is not None:
                out.append(gap_chunk(*run))
                run = None
            out.append(c)
            nbytes += len(c)
            chunks += 1
    if run is not None:
        out.append(gap_chunk(*run))
    return out, nbytes, chunks


def _skipped(idx: StreamletTxns, slot: int, h, buf, committed: bool) -> bool:
    if h.producer_id == txn.MARKER_PRODUCER_ID:
        return True
    return committed and idx.skipped(slot, h, buf)


def gap_chunk(first, span: int) -> bytes:
    """An empty compacted chunk covering `span` records from the stamped chunk header
    `first`: what a reader is served in place of chunks it must not see."""
    buf = bytearray(encode_sparse(first.stream_id, first.streamlet, (GAP_GENERATION, 0, False),
                                  [], [], [], None, [], span, None))
    stamp(buf, first.group, first.segment, first.base_offset, first.number)
    return bytes(buf)


# ---------------------------------------------------------------------- rebuild

def rebuild_index(writes: TxnWrites, info, streamlet) -> None:
    """The transaction index of a reloaded or recovered `streamlet` (stream `info`), from its
    chunks in append order (each slot's groups in id order): replaces whatever it had."""
    writes.indexes.pop((info.id, streamlet.index), None)
    idx = None
    for group in streamlet.groups:
        for seg in group.segments:
            for i in range(len(seg)):
                view = seg.view(i)
                if view is None:
                    continue   # unreadable: a damaged chunk of a file, repaired when read
                h = read_header(view)
                if not _indexed(h):
                    continue
                if idx is None:
                    idx = writes.index(info.id, streamlet.index, info.active_groups)
                idx.observe(group.slot, h, view)


def _indexed(h) -> bool:
    """A chunk the index looks at: a marker, or a data chunk that may be transactional."""
    if h.producer_id == txn.MARKER_PRODUCER_ID:
        return True
    return bool(h.flags & FLAG_KAFKA) or txn.is_transactional(h.sequence) and \
        h.producer_id != COMPACTED_PRODUCER_ID
