"""The broker's sans-IO core: streams, appends and replication, driven by the caller (its read
side is kera.broker.reads, its group placement kera.broker.placement).

Feed it decoded requests and the clock; it returns what to send. `produce` answers at once or
defers (the answer appears in `take_replies()` once every chunk is durable, or fails after
`produce_timeout_s`); `sync` returns the replication writes to send; `write_done` takes their
outcome; `tick` expires what waited too long. No sockets, no threads, no clock reads.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from kera import config
from kera.broker import history_epoch
from kera.broker.backups import BackupPool
from kera.broker.fetch_waits import FetchWaits
from kera.broker.group import Group
from kera.broker.locks import check_condition
from kera.broker.placement import Placement
from kera.broker.producers import APPEND, DUPLICATE, GAP, Entry, ProducerTable
from kera.broker.reads import (U32_MAX, U64_MAX, Reads, check_named, check_uint,
                               streamlet_unknown)
from kera.broker.repair import Repairs
from kera.broker.retention import Retention
from kera.broker.segment_pool import SEGMENT_POOL_BYTES, SegmentPool
from kera.broker.streamlet import Streamlet, growth
from kera.broker.streams import StreamInfo
from kera.broker.tier import TierConfig, TierStore
from kera.broker.txn_writes import TxnWrites
from kera.broker.virtual_log import ReplicationWrite
from kera.codec import kafka_batch, txn
from kera.codec.chunk import (FLAG_CONDITION, FLAG_KAFKA, FLAG_SPARSE, RESERVED_PRODUCER_IDS,
                              Chunk, check_columns, frame_chunks, verify)
from kera.daemon.metrics import Counters
from kera.daemon.stream_traffic import StreamTraffic
from kera.errors import (BadRequest, CorruptChunk, InvalidTxnState, KeraError, KeylessRecord,
                         NotOwner, NotReady, ProducerFenced, RecordTooLarge, ReplicationFailed,
                         SequenceGap, StorageError, Throttled, Timeout, UnknownStream)

log = logging.getLogger(__name__)



NO_BROKER = -1   # placement of a streamlet on no broker this one knows (a disowned stream)
TOMBSTONES_MAX = 1 << 20   # entries accepted in a `deleted` list (the coordinator sends <= 4096)
# Markers in one `txn_markers` request: the coordinator sends at most MARKERS_PER_TURN_MAX
# (kera.coordinator.transactions) in a turn, split per broker.
MARKERS_PER_REQUEST_MAX = 10_000


def _tombstones(deleted: list) -> dict[int, int]:
    """`[[stream id, version], ...]` -> {stream id: version}; malformed entries are refused."""
    if len(deleted) > TOMBSTONES_MAX:
        raise BadRequest(f"{len(deleted)} deleted streams exceed {TOMBSTONES_MAX}")
    out = {}
    for entry in deleted:
        if not isinstance(entry, list) or len(entry) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64 for x in entry):
            raise BadRequest("'deleted' entries are [stream_id, version]")
        out[entry[0]] = entry[1]
    return out


@dataclass(slots=True)
class BrokerConfig:
    virtual_logs: int = config.DEFAULT_VIRTUAL_LOGS
    virtual_segment_bytes: int = config.DEFAULT_VIRTUAL_SEGMENT_BYTES
    replication_timeout_s: float = config.REPLICATION_TIMEOUT_S
    replication_in_flight_max: int = config.REPLICATION_IN_FLIGHT_MAX
    # A produce request not durable after this long fails with a retriable replication_failed
    # (its chunks stay and become durable later; the retry is then a duplicate). Shorter than a
    # client's request timeout (config.DEFAULT_REQUEST_TIMEOUT_S), so the client hears why.
    produce_timeout_s: float = 3 * config.REPLICATION_TIMEOUT_S
    # A backup that failed a write is not given that virtual segment again, and is the last
    # choice for new ones, for this long.
    backup_exclude_s: float = 5 * config.REPLICATION_TIMEOUT_S
    producer_table_max: int = config.PRODUCER_TABLE_MAX
    producer_retained_max: int = config.PRODUCER_RETAINED_MAX
    # Produce requests waiting for durability; beyond this new ones are throttled.
    pending_produce_max: int = 20_000
    groups_per_streamlet_max: int = config.GROUPS_PER_STREAMLET_MAX
    # Chunk headers scanned to place a retry of a chunk older than its producer's last: a
    # constant bound (the retried chunk is among the slot's latest), so a duplicate costs O(1).
    duplicate_scan_chunks_max: int = 256
    # Memory budget and tiering to the broker's data dir (kera.broker.tier); defaults: no
    # directory (nothing tiered), no limit.
    tier: TierConfig | None = None
    # Memory of segments that left memory, kept for new ones (kera.broker.segment_pool).
    segment_pool_bytes: int = SEGMENT_POOL_BYTES


class Pending:
    """A produce request waiting for its chunks to be durable."""
    __slots__ = ("token", "results", "remaining", "deadline", "done")

    def __init__(self, token, results: list, deadline: float):
        self.token = token
        self.results = results
        self.remaining = 0
        self.deadline = deadline
        self.done = False


class Stream:
    __slots__ = ("info", "streamlets", "turn", "traffic")

    def __init__(self, info: StreamInfo):
        self.info = info
        self.streamlets: dict[int, Streamlet] = {}
        self.turn = 0   # rotates the virtual-log choice among equally loaded logs
        self.traffic = StreamTraffic()


class Broker:
    def __init__(self, node: str = "", cfg: BrokerConfig | None = None, broker_id: int | None = None):
        self.cfg = cfg or BrokerConfig()
        assert self.cfg.virtual_logs >= 1 and self.cfg.virtual_segment_bytes >= 1
        self.node = node
        self.broker_id = broker_id
        self.metadata_version = 0
        self.streams: dict[int, Stream] = {}
        self.producers = ProducerTable(self.cfg.producer_table_max, self.cfg.producer_retained_max)
        self.pool = BackupPool(node)
        self.segment_pool = SegmentPool(self.cfg.segment_pool_bytes)
        self.counters = Counters()
        self._replies: list = []
        self._pending: deque[Pending] = deque()
        self._pending_count = 0
        self._writes: deque[ReplicationWrite] = deque()           # in flight, in send order
        # Hot counters as attributes (cheaper than a dict update per chunk).
        self.chunks_appended = 0
        self.bytes_appended = 0
        self.duplicates = 0
        # The retention clock in ms (kera.broker.retention.RetentionClock), read by the caller
        # (set_wall_clock): group stamps and ages for retention.
        self.wall_ms = 0
        self.tier = TierStore(self.cfg.tier, self.counters)
        # The streamlets' group listener: each new group of a replicated stream gets its
        # virtual log there (kera.broker.placement).
        self.placement = Placement(self.cfg, self.pool, self.streams, self.tier, self.counters,
                                   lambda: self.wall_ms, lambda: self.epoch)
        self.tier.close_group = self.placement.close_group
        self.vlogs = self.placement.vlogs           # (index, R, durability) -> log
        self.vlog_list = self.placement.vlog_list   # by wire id
        self.retention = Retention(self)
        self.repairs = Repairs(self)
        self.tier.repairer = self.repairs.start
        self.reloaded = None     # kera.broker.reload.Loaded, until the first metadata claims it
        # The data dir was left by an orderly stop: what was reloaded is every durable chunk.
        self.clean_restart = False

        # This incarnation's epoch (the coordinator's, see kera.broker.recovery): virtual
        # segment numbers on the wire carry it in their high 32 bits. None until known.
        self.epoch: int | None = None
        # (stream id, streamlet) -> recovery job: owned here, being rebuilt from the replicas
        # of a dead broker; answered not_ready until installed (kera.broker.recovery).
        self.recovering: dict[tuple[int, int], object] = {}
        # (stream id, streamlet, epoch) of histories begun since the shell last took them: it
        # records their epochs in the data dir before answering (kera.broker.history_epoch).
        self.new_histories: list[tuple[int, int, int]] = []
        # Fetches that found nothing, held until their streamlets have new durable records
        # (kera.broker.fetch_waits); woken where durable heads move.
        self.fetch_waits = FetchWaits()
        # Transaction indexes and chunks awaiting the coordinator's verification
        # (kera.broker.txn_writes).
        self.txn = TxnWrites()
        self.reads = Reads(self.streams, lambda: self.broker_id, self.counters,
                           self.fetch_waits, self.recovering, self.retention, self.txn)

    # ================================================================== metadata
    def set_identity(self, broker_id: int) -> None:
        self.broker_id = broker_id

    def set_epoch(self, epoch: int) -> None:
        """This incarnation's epoch; virtual logs opened from now on name their segments with
        it (`epoch << 32 | n`)."""
        self.epoch = epoch

    def apply_metadata(self, descriptors, version: int | None = None, deleted=None) -> int:
        """The full list of streams with a streamlet here: add new ones, update placement.
        Drop exactly the streams of `deleted` (the coordinator's tombstones, `[[stream id,
        version], ...]`), never one merely missing from the list: that one is kept, data and
        all, but served by no streamlet here (it is not this broker's any more, or the
        coordinator forgot it). Returns the highest stream id named (kera.daemon.identity)."""
        deleted = [] if deleted is None else deleted
        if not isinstance(descriptors, list) or not isinstance(deleted, list):
            raise BadRequest("stream list or deleted list is not a list")
        tombstones = _tombstones(deleted)
        seen: set[int] = set()
        for d in descriptors:
            try:
                info = StreamInfo.from_descriptor(d)
            except BadRequest as err:
                log.warning("ignoring a bad stream descriptor: %s", err)
                continue
            seen.add(info.id)
            stream = self.streams.get(info.id)
            if stream is None:
                stream = self.streams[info.id] = Stream(info)
                log.info("stream %s (id %d): %d streamlets, R=%d", info.name, info.id,
                         info.streamlets, info.replication)
                if self.reloaded is not None:
                    from kera.broker import reload
                    reload.install(self, stream, self.reloaded)
            else:
                old = stream.info
                if (old.replication, old.durability) != (info.replication, info.durability) \
                        or info.streamlets < old.streamlets:
                    log.warning("stream %s: layout change ignored", info.name)
                    continue
                if info.streamlets > old.streamlets:
                    log.info("stream %s (id %d): streamlets raised %d -> %d", info.name, info.id,
                             old.streamlets, info.streamlets)
                stream.info = info
        for sid in [sid for sid in self.streams if sid not in seen]:
            if sid in tombstones:
                self.drop_stream(sid)
            else:
                self._disown_stream(sid)
        self._delete_reloaded(tombstones)
        if version is not None:
            self.metadata_version = version
        if self.reloaded is not None:
            left = sorted(set(self.reloaded.segments) | set(self.reloaded.first_groups))
            if left:
                log.warning("segment files of %d streamlets (stream ids %s) are not this "
                            "broker's by the coordinator's metadata: kept on disk, not loaded",
                            len(left), sorted({k[0] for k in left}))
            self.reloaded = None
        return max([*seen, *tombstones, 0])

    def _disown_stream(self, sid: int) -> None:
        """A stream no longer listed for this broker but not deleted: keep its data, serve it
        from no streamlet here (produce and fetch answer not_owner)."""
        stream = self.streams[sid]
        if any(b != NO_BROKER for b in stream.info.placement):
            log.warning("stream %s (id %d) is no longer listed for this broker, and was not "
                        "deleted: its data is kept, not served", stream.info.name, sid)
            stream.info.placement = [NO_BROKER] * stream.info.streamlets

    def _delete_reloaded(self, tombstones: dict[int, int]) -> None:
        """Segment files of deleted streams found at startup (deleted while this broker was
        down) go too."""
        if self.reloaded is None:
            return
        for sid in sorted({k[0] for k in [*self.reloaded.segments, *self.reloaded.first_groups]}
                          & set(tombstones)):
            log.info("stream id %d was deleted (version %d): deleting its files", sid,
                     tombstones[sid])
            for table in (self.reloaded.segments, self.reloaded.first_groups):
                for key in [k for k in table if k[0] == sid]:
                    del table[key]
            self.tier.delete_stream(sid)

    def drop_stream(self, sid: int) -> None:
        """Forget stream `sid` here (its data, producers and transactions); produce requests
        waiting on it fail unknown_stream."""
        stream = self.streams.pop(sid)
        log.info("stream %s (id %d) deleted", stream.info.name, sid)
        err = UnknownStream(f"stream {stream.info.name!r} was deleted", retriable=False)
        self.tier.stream_deleted(stream.streamlets.values())
        self.tier.delete_stream(sid)
        self.retention.stream_deleted(sid)
        for streamlet in stream.streamlets.values():
            for waiter in streamlet.release():
                self.fail_waiter(waiter, err)
        self.producers.drop_stream(sid)
        self.txn.drop_stream(sid)

    # ================================================================== produce
    def produce(self, token, frames, now: float, acks: bool = True, check=None) -> list | None:
        """Append each chunk frame (buffer-like). Returns the `results` list when the reply can
        go now, or None when it is deferred until durable (see take_replies). `check(name)`,
        if given, raises NotAuthorized for a stream the caller may not write (that chunk's
        result; the others are stored)."""
        if self.broker_id is None:
            raise NotReady("broker is not registered yet")
        if self._pending_count >= self.cfg.pending_produce_max:
            raise Throttled(f"{self._pending_count} produce requests await replication")
        self.counters.add("produce_requests")
        results: list = []
        waits: list = []
        held: list = []
        throttled = None
        for buf in _cut(frames):
            try:
                if isinstance(buf, CorruptChunk):
                    raise buf
                results.append(self._append(buf, waits, check))
            except _Held as h:   # answered by txn_verified
                held.append(self.txn.queue(h.key, h.stream, buf, len(results), h.add))
                results.append(None)
            except KeraError as err:
                self.counters.add(f"refused_{err.code}")
                results.append([err.code, err.message, err.retriable])
                if isinstance(err, Throttled):
                    throttled = err
        if throttled is not None and all(r[0] == Throttled.code for r in results):
            raise throttled   # nothing of the request was stored: refuse it whole
        if not held and (not waits or not acks):
            return results
        p = Pending(token, results, now + self.cfg.produce_timeout_s)
        for group, end in waits:
            if group.wait(end, p):
                p.remaining += 1
        for q in held:
            q.pending = p
            p.remaining += 1
        if p.remaining == 0:
            return results
        self._pending.append(p)
        self._pending_count += 1
        return None

    # ------------------------------------------------------------------ admission
    def _admit(self, stream: Stream, streamlet: Streamlet | None, sl: int, producer_id: int,
               size: int) -> None:
        """Refuse a chunk (before anything of it is stored) whose append would open a segment
        or a group past a bound: the memory budget (a segment counts its mapped capacity),
        segments in memory, groups per streamlet. Retriable `throttled` while something
        (tiering, retention) can make room, non-retriable when nothing ever will."""
        info = stream.info
        group = None if streamlet is None else streamlet.slots[producer_id % info.active_groups]
        if group is not None and group.segments and not group.closed:
            last = group.segments[-1]
            if last.used_bytes + size <= last.capacity_bytes:
                return   # most chunks: room in the open segment, nothing opens (growth's rule)
        segments, groups = growth(group, (size,), info.segment_size_bytes, info.group_segments)
        if groups:
            self._check_groups(stream, streamlet, sl, groups)
        if not segments:
            return
        tier = self.tier
        capacity = info.segment_size_bytes
        if tier.admit(segments, segments * capacity):
            return
        if tier.never_fits(capacity):
            raise StorageError(f"a {capacity}-byte segment is larger than the broker's whole "
                               f"memory limit ({tier.cfg.memory_limit_bytes} bytes): raise "
                               f"--memory-limit or use smaller segments", retriable=False)
        tier.wanted(capacity)
        self.counters.add("produce_throttled_memory")
        raise Throttled(f"broker memory is full ({tier.memory_bytes} of "
                        f"{tier.cfg.memory_limit_bytes} bytes mapped, {len(tier.resident)} of "
                        f"{tier.segments_max} segments in memory) and cannot go to disk fast "
                        f"enough")

    def _check_groups(self, stream: Stream, streamlet: Streamlet | None, sl: int,
                      more: int) -> None:
        held = len(streamlet.groups) if streamlet is not None else 0
        bound = self.cfg.groups_per_streamlet_max
        if held + more <= bound:
            return
        info = stream.info
        self.counters.add("produce_throttled_groups")
        msg = f"streamlet {sl} of {info.name!r} holds {held} groups, at most {bound}"
        if info.retention_ms or info.retention_bytes or info.retain_until_consumed:
            raise Throttled(f"{msg}: retry once retention deleted old ones")
        raise StorageError(f"{msg}, and its stream has no retention to make room: write to "
                           f"another stream, or create streams with larger groups",
                           retriable=False)

    def _append(self, buf, waits: list, check=None, verified: int | None = None) -> list:
        """Store one produced chunk (its result); `verified`: the transaction number the
        coordinator's txn_verify answered for this transactional chunk (None: not asked yet)."""
        h = _checked(buf)
        size = len(buf)
        stream = self.streams.get(h.stream_id)
        if stream is None:
            raise UnknownStream(f"unknown stream id {h.stream_id}", retriable=True)
        info = stream.info
        if check is not None:
            check_named(check, info.name, h.stream_id)
        sl = h.streamlet
        if sl >= info.streamlets:
            raise streamlet_unknown(info, sl)
        if info.placement[sl] != self.broker_id:
            raise NotOwner(f"streamlet {sl} of {info.name!r} is on broker {info.placement[sl]}")
        if self.recovering and (info.id, sl) in self.recovering:
            raise NotReady(f"streamlet {sl} of {info.name!r} is being recovered")
        if size > info.segment_size_bytes:
            raise RecordTooLarge(f"chunk of {size} bytes exceeds the {info.segment_size_bytes}-byte "
                                 f"segment of stream {info.name!r}: send smaller records, or "
                                 f"create the stream with a larger --segment-size-bytes")
        if info.compacted:
            _check_keyed(buf, h, info.name)
        streamlet = stream.streamlets.get(sl)
        if streamlet is None:
            streamlet = stream.streamlets[sl] = Streamlet(
                info.id, sl, info.active_groups, info.group_segments, info.segment_size_bytes,
                self.placement, self.segment_pool)
            streamlet.adopt_floor(info.floors.get(sl))   # after what retention deleted
            streamlet.epoch = history_epoch.epoch_for_new_history(info.replication, self.epoch)
            self.new_histories.append((info.id, sl, streamlet.epoch))
        pid, raw_seq = h.producer_id, h.sequence
        if pid in RESERVED_PRODUCER_IDS:
            raise BadRequest(f"producer id {pid} is reserved for chunks a broker writes")
        transactional = _transactional(h, buf)
        seq = raw_seq if h.flags & FLAG_KAFKA else txn.plain_sequence(raw_seq)
        if transactional and verified is None and (pid, info.id, sl) in self.txn.verifying:
            raise _Held((pid, info.id, sl), info.name)   # behind its producer's first chunk
        key, entry, verdict = self.producers.verdict(h, info.id, sl)
        if verdict == DUPLICATE:
            return self._duplicate(streamlet, key, entry, seq, waits, raw_seq)
        if verdict == GAP:
            last = "none" if entry is None else entry.sequence
            raise SequenceGap(f"producer {pid}: sequence {seq} after {last}")
        assert verdict == APPEND
        idx = None
        if transactional:
            idx = self._txn_admit(h, info, sl, verified)
        elif h.flags & FLAG_KAFKA:
            self._outside_txn(h, info, sl)
        locks = None
        if h.flags & FLAG_CONDITION:
            locks = check_condition(info, streamlet, buf, self.counters)
        self._admit(stream, streamlet, sl, pid, size)
        slot = pid % info.active_groups
        number = streamlet.next_number(slot)
        group, seg, base = self._store(stream, streamlet, buf, size, h.record_count, pid, waits)
        if locks is not None:
            streamlet.lock_table().record(locks, group.number_base + group.head - 1)
        if key is not None:
            self.producers.put(key, Entry(seq, group.id, seg.number, base, group.head))
        if idx is not None:
            idx.on_data(slot, pid, number, group.id, base, verified)
        return _stored(group, seg.number, base)

    def _store(self, stream: Stream, streamlet: Streamlet, buf, size: int, count: int,
               pid: int, waits: list) -> tuple:
        """Append a checked chunk to `pid`'s slot and hand it to replication; (group, segment,
        base offset)."""
        info = stream.info
        group, seg, i = streamlet.append(buf, size, count, pid)
        if i == 0:
            self.tier.opened(seg)
        group.last_ms = self.wall_ms
        base = group.head - count
        self.chunks_appended += 1
        self.bytes_appended += size
        stream.traffic.appended(count, size)
        vlog = group.vlog
        if vlog is None:
            group.durable = group.head    # R=1: the broker's copy is the only one asked for
            self.tier.live_appended(seg)  # ... in its file before the ack, with a data dir
            if self.fetch_waits.watched:
                self.fetch_waits.wake(info.id, streamlet.index)
        else:
            vlog.add(seg, i, size)
            waits.append((group, group.head))
        return group, seg, base

    # ------------------------------------------------------------------ transactions
    def _txn_admit(self, h, info: StreamInfo, sl: int, verified: int | None):
        """The streamlet's transaction index, once the transactional chunk `h` may be appended:
        ProducerFenced for a fenced epoch; _Held while its transaction was not verified in this
        slot: kera's chunks join the part to the transaction (`add`), a Kafka client's batch
        must find it added already (AddPartitionsToTxn), Kafka's TV1 verification."""
        idx = self.txn.index(info.id, sl, info.active_groups)
        pid, epoch = txn.split_producer_id(h.producer_id)
        if idx.fenced(pid, epoch):
            raise ProducerFenced(f"producer {pid} epoch {epoch} was fenced by epoch "
                                 f"{idx.fence(pid).epoch}: init_transactions again")
        if verified is not None:
            fence = idx.fence(pid)
            if fence is not None and fence.txn >= verified:
                raise InvalidTxnState(f"transaction {verified} of producer {pid} already ended "
                                      f"on streamlet {sl} of {info.name!r}")
            return idx
        opened = idx.slots[h.producer_id % info.active_groups].open.get(pid)
        if opened is not None and opened.epoch == epoch:
            return idx
        if not self.txn.can_queue():
            self.counters.add("txn_verify_throttled")
            raise Throttled(f"{self.txn.queued_count} transactional chunks await the "
                            f"coordinator's verification")
        raise _Held((h.producer_id, info.id, sl), info.name, add=not (h.flags & FLAG_KAFKA))

    def _outside_txn(self, h, info: StreamInfo, sl: int) -> None:
        """Kafka's rule: a producer whose transaction is open in the slot writes only
        transactional batches there (InvalidTxnState otherwise)."""
        idx = self.txn.indexes.get((info.id, sl))
        if idx is None or txn.is_anonymous_kafka(h.producer_id):
            return
        pid, _ = txn.split_producer_id(h.producer_id)
        if pid in idx.slots[h.producer_id % info.active_groups].open:
            raise InvalidTxnState(f"producer {pid} has a transaction open on streamlet {sl} of "
                                  f"{info.name!r}: its batches there must be transactional")

    def take_txn_verifies(self) -> list:
        """`txn_verify` requests to send to the coordinator: (key, fields) each; report each
        answer with txn_verified."""
        return self.txn.take_requests()

    def txn_verified(self, key, reply: dict | None, error: KeraError | None) -> None:
        """The coordinator's answer to `key`'s txn_verify: append the chunks that waited for it
        (in order), or answer them the refusal."""
        number = None if reply is None else reply.get("txn")
        if error is None and not (type(number) is int and 0 <= number <= txn.TXN_NUMBER_MAX):
            error = BadRequest(f"txn_verify answered transaction number {number!r}")
        self.counters.add("txn_verifies")
        for q in self.txn.answered(key):
            p = q.pending
            if p is None or p.done:
                continue   # answered already (timed out): the producer retries the chunk
            try:
                if error is not None:
                    raise error
                waits: list = []
                p.results[q.index] = self._append(q.buf, waits, None, number)
                for group, end in waits:
                    if group.wait(end, p):
                        p.remaining += 1
            except KeraError as err:
                self.counters.add(f"refused_{err.code}")
                p.results[q.index] = [err.code, err.message, err.retriable]
            self._settle(p)

    def txn_markers(self, token, markers, now: float) -> dict | None:
        """The coordinator's `txn_markers`: for each marker (Marker.to_wire order) append its
        control chunk where its producer's transaction is open, idempotently
        (docs/TRANSACTIONS.md). Returns the reply, or None when it waits for durability (it then
        comes from take_replies: (token, reply))."""
        if self.broker_id is None:
            raise NotReady("broker is not registered yet")
        if not isinstance(markers, list) or len(markers) > MARKERS_PER_REQUEST_MAX:
            raise BadRequest(f"'markers' must be a list of at most {MARKERS_PER_REQUEST_MAX}")
        names = {s.info.name: s for s in self.streams.values()}
        reply: dict = {"written": [], "not_owner": []}
        waits: list = []
        for m in markers:
            marker, stream_name, sl = _parse_marker(m)
            stream = names.get(stream_name)
            if stream is None or sl >= stream.info.streamlets \
                    or stream.info.placement[sl] != self.broker_id:
                reply["not_owner"].append([stream_name, sl])
                continue
            if self.recovering and (stream.info.id, sl) in self.recovering:
                continue   # not answered: the coordinator sends it again
            try:
                self._write_marker(stream, sl, marker, waits)
            except Throttled:
                continue
            reply["written"].append([stream_name, sl, marker.producer_id, marker.txn])
        self.counters.add("txn_markers", len(reply["written"]))
        p = Pending(token, reply, now + self.cfg.produce_timeout_s)
        for group, end in waits:
            if group.wait(end, p):
                p.remaining += 1
        if p.remaining == 0:
            return reply
        self._pending.append(p)
        self._pending_count += 1
        return None

    def _write_marker(self, stream: Stream, sl: int, m: txn.Marker, waits: list) -> None:
        """Append `m`'s control chunk in the slot of its open transaction, or only wait for an
        earlier copy's durability (a retry), or nothing (no transaction here, a late
        duplicate): the table of docs/TRANSACTIONS.md."""
        info = stream.info
        idx = self.txn.index(info.id, sl, info.active_groups)
        streamlet = stream.streamlets.get(sl)
        slot = idx.open_slot(m.producer_id)
        fence = idx.fence(m.producer_id)
        if slot is None or streamlet is None:
            if fence is not None and fence.txn >= m.txn and streamlet is not None:
                group = streamlet.group(fence.group)
                if group is not None and group.durable < fence.end:
                    waits.append((group, fence.end))   # a retry: once the first is durable
            return
        opened = idx.slots[slot].open[m.producer_id]
        number = opened.txn
        if number is None:   # rebuilt: its number is the one after the last marker's
            number = m.txn if fence is None or fence.txn < m.txn else fence.txn
        if number != m.txn or m.epoch < opened.epoch:
            return   # a late duplicate of an earlier transaction's marker
        buf = txn.build_marker(m, info.id, sl, self.wall_ms, slot)
        self._admit(stream, streamlet, sl, slot, len(buf))
        at = streamlet.next_number(slot)
        group, _seg, base = self._store(stream, streamlet, buf, len(buf), 1, slot, waits)
        if idx.on_marker(slot, m, at, group.id, base + 1) and self.fetch_waits.watched:
            self.fetch_waits.wake(info.id, sl)

    def take_txn_resolves(self, now: float) -> list:
        """`txn_resolve` requests for transactions held open past the longest timeout: (key,
        fields) each; report each answer with txn_resolved."""
        out = []
        for key, epoch in self.txn.stale_opens(now):
            stream = self.streams.get(key[0])
            if stream is None:
                self.txn.resolved(key, now)
                continue
            out.append((key, {"producer_id": key[2], "epoch": epoch,
                              "part": [stream.info.name, key[1]]}))
        self.counters.add("txn_resolves", len(out))
        return out

    def txn_resolved(self, key, reply: dict | None, error: KeraError | None, now: float) -> None:
        """The coordinator's answer about a stale open transaction: its number ("open"), or the
        marker to write here now ("commit", "abort"; number -1: one it does not hold open)."""
        self.txn.resolved(key, now)
        stream = self.streams.get(key[0])
        idx = self.txn.indexes.get(key[:2])
        decision = None if reply is None else reply.get("decision")
        number = None if reply is None else reply.get("txn")
        if error is not None or stream is None or idx is None or type(number) is not int:
            return
        sid, sl, pid = key
        slot = idx.open_slot(pid)
        if slot is None:
            return
        opened = idx.slots[slot].open[pid]
        if decision == "open":
            idx.set_number(slot, pid, number)
        elif decision in ("commit", "abort"):
            if number < 0:   # unknown to the coordinator: abort it under the number it has
                fence = idx.fence(pid)
                number = opened.txn if opened.txn is not None else (
                    0 if fence is None else fence.txn + 1)
            m = txn.Marker(pid, opened.epoch, number, decision == "commit")
            try:
                self._write_marker(stream, sl, m, [])
            except Throttled:
                pass   # asked again after RESOLVE_AFTER_S

    def _settle(self, p: "Pending") -> None:
        """One of the things `p` waited for happened: answer it once none is left."""
        p.remaining -= 1
        if p.remaining == 0 and not p.done:
            p.done = True
            self._pending_count -= 1
            self._replies.append((p.token, p.results))

    def _duplicate(self, streamlet: Streamlet, key, entry: Entry, seq: int, waits: list,
                   raw_seq: int) -> list:
        self.duplicates += 1
        g, segno, base, end = entry.group, entry.segment, entry.base_offset, entry.end_offset
        placed = True
        if seq != entry.sequence:
            # A retry of an older chunk: it is usually among the last few of its slot (the
            # producer's requests in flight), so a short scan finds it. If not (a retry that
            # the network held back behind hundreds of the slot's chunks: simulation seed
            # 2002), the answer is "stored, position unknown" (UNPLACED), given once the newest
            # chunk is durable: then every earlier one of the producer is (one slot's groups
            # become durable in order, kera.broker.placement._slot_vlog). Naming the newest chunk's
            # place instead told the producer a position that holds another chunk.
            found = streamlet.find_chunk(key[0], raw_seq, self.cfg.duplicate_scan_chunks_max)
            if found is not None:
                group, seg, i, _ = found
                g, segno, base, end = group.id, seg.number, seg.bases[i], seg.end_offset(i)
            else:
                placed = False
                self.counters.add("duplicates_unplaced")
        group = streamlet.group(g)
        # Acknowledge a duplicate only once the original is durable: the first attempt may
        # have been answered replication_failed while its chunk was still being replicated.
        if group is not None and group.durable < end:
            waits.append((group, end))
        if not placed:
            return list(UNPLACED)
        return _stored(group, segno, base) if group is not None else [g, segno, base]

    # ------------------------------------------------------------------ durability
    def _durable(self, updates: dict) -> None:
        waits = self.fetch_waits
        for group, end in updates.items():
            if waits.watched:
                waits.wake(group.stream_id, group.streamlet)
            for waiter in group.set_durable(end):
                if not waiter.done:
                    waiter.remaining -= 1
                    if waiter.remaining == 0:
                        waiter.done = True
                        self._pending_count -= 1
                        self._replies.append((waiter.token, waiter.results))

    def fail_waiter(self, waiter: Pending, err: KeraError) -> None:
        """Answer a produce request still waiting for durability with `err`."""
        if not waiter.done:
            waiter.done = True
            self._pending_count -= 1
            self._replies.append((waiter.token, err))

    def fail_in_flight(self, err: KeraError) -> None:
        """Fail every produce request still waiting and forget the replication writes in
        flight (the incarnation that sent them is gone, kera.broker.recovery)."""
        for p in list(self._pending):
            self.fail_waiter(p, err)
        self._writes.clear()

    def take_replies(self) -> list:
        """Deferred produce answers ready to send: (token, results list | KeraError)."""
        replies, self._replies = self._replies, []
        return replies

    # ================================================================== replication
    def sync(self, now: float) -> list[ReplicationWrite]:
        """Replication writes to send now (see VirtualLog.sync)."""
        if self.broker_id is None:
            return []
        writes: list[ReplicationWrite] = []
        for vlog in self.vlog_list:
            if vlog.has_work:
                writes.extend(vlog.sync(now, self.broker_id))
        self._writes.extend(writes)
        return writes

    def write_done(self, write: ReplicationWrite, header: dict | None, error: KeraError | None,
                   now: float) -> None:
        """The reply (or error, or timeout) of a replication write."""
        updates = write.vlog.write_done(write, header, error, now)
        if updates:
            self._durable(updates)

    def tick(self, now: float) -> None:
        """Expire replication writes and produce requests that waited too long."""
        writes = self._writes
        timeout = self.cfg.replication_timeout_s
        while writes and (writes[0].done or writes[0].sent_at + timeout <= now):
            w = writes.popleft()
            if not w.done:
                self.write_done(w, None, Timeout(f"backup {w.backup_id} ({w.address}) did not "
                                                  f"answer within {timeout} s"), now)
        pending = self._pending
        while pending and (pending[0].done or pending[0].deadline <= now):
            p = pending.popleft()
            if not p.done:
                self.counters.add("produce_replication_failed")
                self.fail_waiter(p, ReplicationFailed(
                    f"not replicated to enough backups within {self.cfg.produce_timeout_s} s "
                    f"({self.pool.live_count()} live backups)"))

    # ================================================================== reads
    def take_new_histories(self) -> list[tuple[int, int, int]]:
        out, self.new_histories = self.new_histories, []
        return out

    # ================================================================== tiering, retention
    def set_wall_clock(self, wall_ms: int, mono_ms: int | None = None) -> None:
        """The broker's wall clock (ms since the epoch) and monotonic clock (ms): group ages
        for retention (kera.broker.retention.RetentionClock; no monotonic reading: the wall
        clock is trusted, as tests do)."""
        self.wall_ms = self.retention.clock.update(wall_ms, mono_ms)

    def enforce_retention(self, wall_ms: int | None = None, mono_ms: int | None = None) -> int:
        """Delete expired groups (see kera.broker.retention); returns how many."""
        if wall_ms is not None:
            self.set_wall_clock(wall_ms, mono_ms)
        self.counters.add("retention_passes")
        return self.retention.enforce(self.wall_ms)

    # ================================================================== stats
    def stats(self) -> dict:
        c = self.counters
        s = dict(c)
        writes = c.get("replication_writes", 0)
        s.update(
            chunks_appended=self.chunks_appended,
            bytes_appended=self.bytes_appended,
            duplicates=self.duplicates,
            replication_writes=writes,
            replication_bytes=c.get("replication_bytes", 0),
            chunks_per_replication_write=(c.get("replication_chunks", 0) / writes) if writes else 0.0,
            durable_lag_bytes=sum(v.lag_bytes for v in self.vlog_list),
            pending_produce=self._pending_count,
            writes_in_flight=sum(1 for w in self._writes if not w.done),
            streams=len(self.streams),
            virtual_logs=len(self.vlog_list),
            virtual_segments=sum(len(v.vsegs) for v in self.vlog_list),
            live_backups=self.pool.live_count(),
            producer_entries=len(self.producers),
            producer_entries_retained=self.producers.retained_count,
            producer_entries_forgotten=self.producers.forgotten,
            metadata_version=self.metadata_version,
            txn_verify_queued=self.txn.queued_count,
            txn_verifies_in_flight=len(self.txn.verifying),
            txn_streamlets=len(self.txn.indexes),
        )
        s.update(self.tier.stats())
        s.update(self.fetch_waits.stats())
        s.update({f"segment_pool_{k}": v for k, v in self.segment_pool.stats().items()})
        return s




def _cut(frames: list) -> list:
    """The chunks of a produce's frames, each frame one or more whole chunks back to back
    (kera.codec.frame_pack); a frame that does not cut into whole chunks stands as one CorruptChunk
    (one refused chunk, as when a frame held one: the producer counts results per chunk and
    retries a request whose count is off)."""
    out: list = []
    for frame in frames:
        try:
            out.extend(list(frame_chunks(frame)))
        except CorruptChunk as err:
            out.append(err)
    return out



# The produce result of a chunk stored earlier whose position this broker did not look up
# (kera.codec.schema.produce_result): a retry of a chunk older than `duplicate_scan_chunks_max`.
UNPLACED: tuple = ()


def _checked(buf):
    """The header of a chunk a producer sent, once every check of a chunk to store passed."""
    h = verify(buf)
    size = len(buf)
    if h.size != size:
        raise CorruptChunk(f"frame of {size} bytes holds a {h.size}-byte chunk")
    if h.record_count == 0:
        raise CorruptChunk("chunk holds no records")
    if h.flags & FLAG_SPARSE:
        raise BadRequest("a chunk with gaps in its record numbers (FLAG_SPARSE) is written "
                         "by a broker's compactor only: producers send dense chunks")
    check_columns(buf, h)
    return h


def _check_keyed(buf, h, stream: str) -> None:
    """KeylessRecord unless every record of the chunk has a key: a compacted stream keeps the
    last record of each key (docs/COMPACTION.md). Reads the key columns (decompressing or
    decoding a Kafka batch first), which only chunks of compacted streams pay. A conditional
    append is refused too: compaction forgets the records that carry its locks."""
    if h.flags & FLAG_CONDITION:
        raise BadRequest(f"stream {stream!r} is compacted: compaction forgets superseded "
                         f"records, so it cannot keep conditional appends' locks; write them "
                         f"to a stream whose cleanup policy is delete")
    c = Chunk(buf, check=False)
    nulls = c.key_nulls
    keyless = len(c) if nulls is None else int(nulls.sum())
    if keyless:
        raise KeylessRecord(f"{keyless} of the {len(c)} records have no key, and stream "
                            f"{stream!r} is compacted (cleanup policy compact): give every "
                            f"record a key, or write to a stream whose cleanup policy is delete")


def _stored(group: Group, segment: int, base: int) -> list:
    """A stored chunk's produce result: where it is and, when known, its first record number."""
    if group.number_base is None:
        return [group.id, segment, base]
    return [group.id, segment, base, group.number_base + base]


def _parse_marker(m) -> tuple:
    """(kera.codec.txn.Marker, stream name, streamlet) of a wire marker: [transactional_id,
    producer_id, epoch, txn, commit, stream, streamlet]."""
    if not (isinstance(m, list) and len(m) == 7 and isinstance(m[5], str)
            and isinstance(m[4], bool)):
        raise BadRequest("a marker is [transactional_id, producer_id, epoch, txn, commit, "
                         "stream, streamlet]")
    _, pid, epoch, number, commit, stream, sl = m
    check_uint(pid, "marker producer_id", U64_MAX >> txn.EPOCH_BITS)
    check_uint(epoch, "marker epoch", txn.EPOCH_MASK)
    check_uint(number, "marker txn", txn.TXN_NUMBER_MAX)
    check_uint(sl, "marker streamlet", U32_MAX)
    return txn.Marker(pid, epoch, number, commit), stream, sl


class _Held(Exception):
    """A transactional chunk that waits for its producer's verification (txn_verify)."""

    def __init__(self, key: tuple, stream: str, add: bool = True):
        super().__init__(key)
        self.key = key
        self.stream = stream
        self.add = add          # join the part to the transaction (kera's producers)


def _transactional(h, buf) -> bool:
    """A chunk of an open transaction: kera's (TXN_SEQUENCE_BIT) or a Kafka client's batch."""
    if h.flags & FLAG_KAFKA:
        return kafka_batch.read_header(buf, h.header_size).transactional
    return txn.is_transactional(h.sequence)
