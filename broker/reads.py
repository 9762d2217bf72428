"""The broker's read side: fetches, held fetches and the lookups readers make (offsets,
positions by time and by record number, spans, lag), over the streams the broker owns.

`Reads` takes what reading needs from the broker core (its streams, owner id, recoveries in
progress, retention, transaction indexes, held fetches and counters), nothing of the write path.
Sans-IO like the core: the shell hands it decoded requests and sends what it returns.
"""

from __future__ import annotations

from typing import Callable

from kera import config
from kera.broker.fetch_waits import FetchWaits
from kera.broker.retention import Retention
from kera.broker.streamlet import Streamlet
from kera.broker.streams import StreamInfo
from kera.broker.time_index import record_at_or_after, streamlet_cursor_at
from kera.broker.txn_writes import ISOLATIONS, READ_COMMITTED, TxnWrites, filter_views
from kera.codec import wire
from kera.codec.frame_pack import pack
from kera.daemon.metrics import Counters
from kera.errors import (BadRequest, KeraError, NotAuthorized, NotOwner, NotReady,
                         OffsetOutOfRange, PositionLost, UnknownStream)

FETCH_GROUPS_MAX = 64                    # groups described per fetch read (protocol)
FETCH_READS_MAX = 4096                   # reads in one fetch request
FETCH_READ_MAX_BYTES = 64 * config.MiB   # one read's budget is clamped to this
FETCH_REPLY_MAX_BYTES = 64 * config.MiB  # chunk bytes in one fetch reply, all reads together
FETCH_CURSOR_GROUPS_MAX = 4096           # entries in one cursor's `offsets`


class Reads:
    """Serves reads of the streamlets this broker owns."""

    def __init__(self, streams: dict, owner_id: Callable[[], int | None], counters: Counters,
                 fetch_waits: FetchWaits, recovering: dict, retention: Retention,
                 txn: TxnWrites):
        """`streams`: the core's {stream id: Stream}, shared (the core adds and drops them);
        `owner_id()`: this broker's id, None until registered; `recovering`: the core's
        {(stream id, streamlet): job} of streamlets being rebuilt, shared."""
        self.streams = streams
        self.owner_id = owner_id
        self.counters = counters
        self.fetch_waits = fetch_waits
        self.recovering = recovering
        self.retention = retention
        self.txn = txn

    def streamlet(self, sid: int, sl: int) -> Streamlet | None:
        if self.owner_id() is None:
            raise NotReady("broker is not registered yet")
        stream = self.streams.get(sid)
        if stream is None:
            raise UnknownStream(f"unknown stream id {sid}", retriable=True)
        info = stream.info
        if sl >= info.streamlets:
            raise streamlet_unknown(info, sl)
        if info.placement[sl] != self.owner_id():
            raise NotOwner(f"streamlet {sl} of {info.name!r} is on broker {info.placement[sl]}")
        if self.recovering and (sid, sl) in self.recovering:
            raise NotReady(f"streamlet {sl} of {info.name!r} is being recovered")
        return stream.streamlets.get(sl)

    def offsets(self, sid: int, sl: int, isolation: str | None = None) -> list:
        """The streamlet's groups as `[g, slot, start, durable_end, closed]`; read_committed:
        each durable end at its stable bound (a group with an open transaction's records ends
        before them and is not closed yet), what such a reader can read now."""
        streamlet = self.streamlet(sid, sl)
        if streamlet is None:
            return []
        if isolation is not None and isolation not in ISOLATIONS:
            raise BadRequest(f"'isolation' must be one of {', '.join(ISOLATIONS)}")
        idx = self.txn.indexes.get((sid, sl)) if isolation == READ_COMMITTED else None
        if idx is None:
            return streamlet.describe_groups()
        return [_stable_entry(g, idx) for g in streamlet.groups]

    def cursor_at_time(self, sid: int, sl: int, timestamp_us: int) -> tuple[int, dict[int, int]]:
        """(low, offsets): a reader's cursor at the first record whose timestamp is at or after
        `timestamp_us` in every retained group (kera.broker.time_index)."""
        streamlet = self.streamlet(sid, sl)
        self.counters.add("offsets_for_time_requests")
        if streamlet is None:
            return 0, {}
        return streamlet_cursor_at(streamlet, timestamp_us)

    def number_at_time(self, sid: int, sl: int, timestamp_us: int) -> tuple[int, int] | None:
        """(record number, its timestamp in µs) of the first durable record at or after
        `timestamp_us` in a one-slot streamlet (Kafka's ListOffsets by timestamp); None when
        there is none."""
        low, offsets = self.cursor_at_time(sid, sl, timestamp_us)
        streamlet = self.streams[sid].streamlets.get(sl)
        for g in streamlet.groups if streamlet is not None else ():
            off = offsets.get(g.id, 0)
            if g.id >= low and g.number_base is not None and off < g.durable:
                found = record_at_or_after(g, off)   # past a compacted range's gaps
                if found is not None:
                    return g.number_base + found[0], found[1]
        return None

    def cursor_at_number(self, sid: int, sl: int, number: int) -> tuple[int, dict[int, int]]:
        """(low, offsets): a reader's cursor at the record numbered `number` (or the first
        retained one, when retention deleted it; or the end, when it is not written yet).
        Numbers are per slot: streams with one active group per streamlet only."""
        streamlet = self.streamlet(sid, sl)
        self.counters.add("offsets_for_number_requests")
        if streamlet is None:
            return 0, {}
        if streamlet.active_groups != 1:
            raise BadRequest(f"seeking by record number needs one active group per streamlet; "
                             f"this stream has {streamlet.active_groups}")
        return streamlet.cursor_at_number(number)

    def number_span(self, sid: int, sl: int) -> tuple[int, int]:
        """(first retained, durable end) record numbers of a one-slot streamlet (Kafka's log
        start offset and high watermark)."""
        streamlet = self.streamlet(sid, sl)
        if streamlet is None:
            floor = self.streams[sid].info.floors.get(sl)
            number = floor[1][0] if floor else 0
            return number, number
        return streamlet.number_span()

    def bytes_behind(self, sid: int, sl: int, low: int, offsets: dict[int, int]) -> int:
        """Durable chunk bytes past a reader's cursor (`low`, `offsets` as in a fetch read):
        its lag in bytes over the retained groups."""
        streamlet = self.streamlet(sid, sl)
        if streamlet is None:
            return 0
        return sum(g.durable_bytes_from(offsets.get(g.id, 0))
                   for g in streamlet.groups if g.id >= low)

    def history_epoch(self, sid: int, sl: int) -> int | None:
        """The epoch of the streamlet's current history; None while it has none (no data yet:
        any position is of its first history)."""
        streamlet = self.streamlet(sid, sl)
        return None if streamlet is None else streamlet.epoch

    def first_group(self, sid: int, sl: int) -> int:
        """The streamlet's first retained group: every group below it was deleted (retention)."""
        streamlet = self.streamlet(sid, sl)
        return 0 if streamlet is None else streamlet.first_group

    def fetch(self, reads, epochs: list | None = None, check=None,
              again: bool = False, isolation: str | None = None) -> tuple[list, list]:
        """(results, frames) for a `fetch` request's `reads` (see docs/PROTOCOL.md); `epochs`,
        if given, gets each read's streamlet history epoch (None for a failed read or a
        streamlet with no data yet), the reply's `epochs`. `check(name)`, if given, refuses
        (that read's error) a stream the caller may not read. `again`: the same request,
        held (park_fetch) and read once more (counted once in `fetch_requests`). `isolation`:
        read_committed stops at the stable bound and skips aborted transactions; control
        chunks are skipped in both (kera.broker.txn_writes); None serves every durable chunk as
        stored, control chunks included (the Kafka listener's: its clients skip them)."""
        if not isinstance(reads, list) or len(reads) > FETCH_READS_MAX:
            raise BadRequest(f"'reads' must be a list of at most {FETCH_READS_MAX} reads")
        if isolation is not None and isolation not in ISOLATIONS:
            raise BadRequest(f"'isolation' must be one of {', '.join(ISOLATIONS)}")
        if not again:
            self.counters.add("fetch_requests")
        results: list = []
        frames: list = []
        budget = [FETCH_REPLY_MAX_BYTES, 0]     # bytes left, chunks taken
        for read in reads:
            before, bytes_before, chunks_before = len(frames), budget[0], budget[1]
            try:
                sid, sl, low, offsets, max_bytes, earliest, epoch = _parse_read(read)
                if check is not None:
                    self.check_stream(sid, check)
                # Looked up once per read: the epoch check, the read and the reply's epoch.
                streamlet = self.streamlet(sid, sl)
                current = None if streamlet is None else streamlet.epoch
                self._check_epoch(sid, sl, epoch, current)
                groups = self._read(streamlet, sl, low, offsets, max_bytes, frames, budget,
                                    earliest, isolation)
                if len(frames) - before > 1:
                    frames[before:] = pack(frames[before:])
            except KeraError as err:
                del frames[before:]
                results.append([[err.code, err.message, err.retriable], 0, []])
                if epochs is not None:
                    epochs.append(None)
                continue
            results.append([None, len(frames) - before, groups])
            if budget[1] != chunks_before:
                self._count_fetched(sid, budget[1] - chunks_before, bytes_before - budget[0])
            if epochs is not None:
                epochs.append(current)
        self.counters.add("fetch_chunks", budget[1])
        self.counters.add("fetch_bytes", FETCH_REPLY_MAX_BYTES - budget[0])
        return results, frames

    def park_fetch(self, token, reads: list, deadline: float) -> bool:
        """Hold a fetch whose `reads` (as `fetch` took them, every one answered without an
        error or a chunk) found nothing, until one of their streamlets has new durable records
        or `deadline`; False when it cannot be held (answer it now)."""
        return self.fetch_waits.park(token, frozenset((r[0], r[1]) for r in reads), deadline)

    def take_ready_fetches(self, now: float) -> list:
        """The tokens of held fetches to fetch again and answer now (the shell asks after
        every loop turn: nothing is made while none is held)."""
        if self.fetch_waits.idle:
            return []
        self.fetch_waits.expire(now)
        return self.fetch_waits.take_ready()

    def _count_fetched(self, sid: int, chunks: int, nbytes: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None and chunks:
            stream.traffic.fetched(chunks, nbytes)

    def stream_traffic(self) -> dict[str, dict]:
        """{stream name: its traffic counters on this broker} (kera.daemon.stream_traffic)."""
        return {s.info.name: s.traffic.as_dict() for s in self.streams.values()}

    def check_stream(self, sid: int, check) -> None:
        """Apply an access check to stream `sid`'s name (an unknown id is left to the read)."""
        stream = self.streams.get(sid)
        if stream is not None:
            check_named(check, stream.info.name, sid)

    def _check_epoch(self, sid: int, sl: int, epoch: int | None, current: int | None) -> None:
        """A cursor of another history than the streamlet's `current` one is refused: its
        group numbers and offsets name records that no longer exist
        (kera.broker.history_epoch)."""
        if epoch is None or epoch == current:
            return
        if current is None and self.streams[sid].info.replication > 1:
            return   # replicated: no data here yet is the same, first history
        self.counters.add("fetch_position_lost")
        name = self.streams[sid].info.name
        raise PositionLost(
            f"position of stream {name!r} streamlet {sl} is of history epoch {epoch}, the "
            f"streamlet's current history is epoch {current if current is not None else 'none (empty)'}:"
            " its data was lost; start again from 'earliest' or 'latest'")

    def _read(self, streamlet: Streamlet | None, sl, low, offsets, max_bytes, frames, budget,
              earliest=False, isolation: str | None = None) -> list:
        if streamlet is None:
            _check_cursor_end(sl, 0, low, offsets)
            return []
        first = streamlet.first_group
        _check_cursor_end(sl, first + len(streamlet.groups), low, offsets)
        if low < first:
            if not earliest and self.retention.gone(streamlet.stream_id, streamlet, low, offsets):
                self.counters.add("fetch_out_of_range")
                raise OffsetOutOfRange(
                    f"position no longer available: group {low} of streamlet {sl} was deleted "
                    f"by retention (the oldest group kept is {first})")
            low = first
        groups = streamlet.groups[low - first:low - first + FETCH_GROUPS_MAX]
        # For each slot, only its lowest unfinished group is served: one producer's records
        # (one slot) are then read in order.
        candidates = []
        slots_seen: set[int] = set()
        for g in groups:
            if g.slot in slots_seen:
                continue
            off = offsets.get(g.id, 0)
            if off > g.head:
                raise OffsetOutOfRange(f"offset {off} is past the end {g.head} of group {g.id}")
            if g.finished and off >= g.head:
                continue
            slots_seen.add(g.slot)
            candidates.append((g, off))
            if len(slots_seen) == streamlet.active_groups:
                break
        idx = None if isolation is None else self.txn.indexes.get((streamlet.stream_id,
                                                                   streamlet.index))
        committed = isolation == READ_COMMITTED
        left = min(max_bytes, budget[0])
        k = len(candidates)
        taken = 0
        for i, (g, off) in enumerate(candidates):
            if len(frames) >= wire.MAX_FRAMES:
                break
            share = left // (k - i)   # fair share of what is left, so no slot starves
            views, nbytes, chunks = g.read(off, share, (taken == 0 and budget[0] > 0),
                                           wire.MAX_FRAMES - len(frames))
            if idx is not None and views:   # transactions were written here
                limit = idx.stable_end(g.slot, g.id, g.durable) if committed else g.durable
                views, nbytes, chunks = filter_views(views, idx, g.slot, limit, committed)
            frames.extend(views)
            taken += chunks
            left -= nbytes
            budget[0] -= nbytes
            budget[1] += chunks
        return [g.describe() for g in groups]


def _check_cursor_end(sl: int, end_group: int, low: int, offsets: dict) -> None:
    """A cursor past the streamlet's last group saw data that is gone (lost beyond what the
    replicas held): readers must hear of it (failOnDataLoss), not skip what comes next."""
    if low > end_group or any(g >= end_group and off > 0 for g, off in offsets.items()):
        raise OffsetOutOfRange(f"position past the end of streamlet {sl} (it has groups below "
                               f"{end_group}): the data it read was lost")


U32_MAX = 2**32 - 1   # wire fields that are u32 (streamlet, group numbers) or u64
U64_MAX = 2**64 - 1


def _parse_read(read) -> tuple[int, int, int, dict, int, bool, int | None]:
    if not isinstance(read, list) or len(read) != 4:
        raise BadRequest("a read is [sid, sl, cursor, max_bytes]")
    sid, sl, cursor, max_bytes = read
    # One test for the usual well-formed read (a fetch carries one read per streamlet, each
    # checked field by field was a tenth of a fetch); the precise error otherwise.
    if not (type(sid) is int and type(sl) is int and type(max_bytes) is int
            and 0 <= sid <= U64_MAX and 0 <= sl <= U32_MAX and 0 <= max_bytes <= U64_MAX):
        check_uint(sid, "sid", U64_MAX)
        check_uint(sl, "sl", U32_MAX)
        check_uint(max_bytes, "max_bytes", U64_MAX)
    low, offsets, earliest, epoch = parse_cursor(cursor)
    return sid, sl, low, offsets, min(max(max_bytes, 1), FETCH_READ_MAX_BYTES), earliest, epoch


def parse_cursor(cursor) -> tuple[int, dict, bool, int | None]:
    """(low, offsets, earliest, epoch) of a reader's cursor map (a fetch read's, or the `at`
    of an `offsets` request)."""
    if not isinstance(cursor, dict):
        raise BadRequest("cursor must be a map")
    low = cursor.get("low", 0)
    check_uint(low, "low", U32_MAX)
    raw = cursor.get("offsets", {})
    if not isinstance(raw, dict) or len(raw) > FETCH_CURSOR_GROUPS_MAX:
        raise BadRequest(f"cursor offsets must be a map of at most {FETCH_CURSOR_GROUPS_MAX} groups")
    offsets: dict[int, int] = {}
    for g, off in raw.items():
        if not (type(g) is int and type(off) is int and 0 <= g <= U32_MAX
                and 0 <= off <= U64_MAX):
            g = _cursor_group(g)
            check_uint(off, "cursor offset", U64_MAX)
        offsets[g] = off
    earliest = cursor.get("earliest", False)
    if not isinstance(earliest, bool):
        raise BadRequest("cursor 'earliest' must be a boolean")
    epoch = cursor.get("epoch")
    if epoch is not None:
        check_uint(epoch, "cursor epoch", U64_MAX)
    return low, offsets, earliest, epoch


def _cursor_group(g) -> int:
    if isinstance(g, str) and g.isdigit() and len(g) <= 10:
        g = int(g)   # tolerate string keys (a JSON-minded client)
    check_uint(g, "cursor group", U32_MAX)
    return g


def check_uint(value, name: str, hi: int) -> None:
    if type(value) is int and 0 <= value <= hi:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [0, {hi}]")


def _stable_entry(group, idx) -> list:
    """A group's `describe()` entry as a read_committed reader sees it (TxnIndex idx)."""
    entry = group.describe()
    end = idx.stable_end(group.slot, group.id, group.durable)
    if end < entry[3]:
        entry[3], entry[4] = end, False
    return entry


def check_named(check, name: str, sid: int) -> None:
    """`check(name)` for stream `sid`; a stream whose name the caller may not even describe is
    refused exactly as an unknown id, so stream ids cannot be probed for which exist and what
    they are called (a check without `may_describe` refuses as it is)."""
    try:
        check(name)
    except NotAuthorized:
        may_describe = getattr(check, "may_describe", None)
        if may_describe is not None and not may_describe(name):
            raise UnknownStream(f"unknown stream id {sid}", retriable=True) from None
        raise


def streamlet_unknown(info: StreamInfo, sl: int) -> NotReady:
    # Retriable: a client may know of a raised streamlet count before this broker applied it.
    return NotReady(f"stream {info.name!r} has {info.streamlets} streamlets at metadata version "
                    f"{info.version} here, no streamlet {sl}: the count may have been raised "
                    f"since; ask the coordinator")
