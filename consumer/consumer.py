"""The Consumer: a request thread fills a bounded cache of chunks; the caller walks records.

    with Consumer("127.0.0.1:7000", "clicks", start="earliest") as c:   # or ["clicks", "views"]
        for record in c:              # kera.codec.position.Record (record.stream names its stream)
            ...
        c.poll(timeout_s=1.0)         # one Record or None
        c.poll_batch(timeout_s=1.0)   # list of Batch (columnar: to_arrow(), values, ...)
        c.positions()                 # exact resumable positions of what was consumed
        c.seek("clicks", 0, "earliest"); c.lag()   # {(stream, streamlet): records behind}
        c.seek_to_time(timestamp_ms)  # or c.offsets_for_times({("clicks", 0): timestamp_ms})

One consumer reads any number of streams with one request thread and one connection per
broker: what it reads are *parts*, (stream, streamlet) pairs. Records of one group come in
offset order and groups of one slot in order (the broker's fetch rules), so one producer's
records to a streamlet are read in the order they were sent.

Thread use: poll/poll_batch/iteration from one thread; seek, assign, unassign, positions and
lag may be called from any thread (a group-membership task calls assign/unassign from the
request thread): they take effect atomically between two records.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Mapping

from kera import config

from kera.net import rpc

from kera.codec import schema
from kera.consumer import lag as lagmath
from kera.consumer.batch import Batch
from kera.codec.name_pattern import NamePattern
from kera.consumer.cursor import (ChunkItem, ConsumedCursor, ErrorItem, FetchCursor, LowItem,
                                  ResetItem, cursors_with_epochs, parse_groups)
from kera.consumer.fetching import FetchState
from kera.consumer.membership import (GroupMetadata, Membership, positions_from_wire,
                                     positions_to_wire, subscription)
from kera.consumer.tasks import TaskRunner
from kera.errors import BadRequest, ClientClosed, KeraError, Timeout
from kera.client.metadata import Metadata
from kera.client.env import ClientEnv
from kera.client.kafka_config import CONSUMER_PROPERTIES, kera_arguments
from kera.codec.position import Position, Record
from kera.codec.timestamps import ms_to_us

log = logging.getLogger(__name__)
# What a consumer does with a position into a history its streamlet no longer has (its data
# was lost: an R=1 broker restarted without it), like Kafka's auto.offset.reset: "raise" raises
# PositionLost from poll; "earliest" restarts the streamlet at its first record, "latest" at its
# end (both log a warning). Raising is the default, unlike Kafka's "latest": kera promises not
# to lose acknowledged records, so a loss is an event the application must hear of and decide
# on, never something a reader skips past. The position is never reinterpreted in the new
# history (that would silently skip the records produced after the loss).
LOST_POSITION_POLICIES = ("raise", "earliest", "latest")

LATEST_RETRY_S = 0.05
# start / seek targets that are not positions.
NAMED_STARTS = ("earliest", "latest")
# What a consumer reads of transactional data (docs/TRANSACTIONS.md), Kafka's isolation.level:
# "read_committed" (the default) only committed transactions' records, up to the oldest open
# one; "read_uncommitted" everything durable, aborted records too. Control chunks (markers)
# are never delivered.
ISOLATION_LEVELS = ("read_committed", "read_uncommitted")


class Consumer:
    """A reader of one or more streams (Consumer(bootstrap, stream, ...)).

    `stream`: one stream name or a list of them, all read by this one consumer.
    `streamlets` / `member`+`members` choose streamlets of each stream (`streamlets=[]`:
    none until `assign()`, for a group-membership layer). `start`: "earliest", "latest" or
    positions (of any of the streams; parts without one start at the earliest).

    `on_assigned(parts)` / `on_revoked(parts)`: called by `assign` (after) and `unassign`
    (before: positions() still covers the parts, so the application can flush and save
    them), in the thread that calls those, with the (stream, streamlet) parts.

    `on_lost_position`: "raise" (default), "earliest" or "latest" (LOST_POSITION_POLICIES).

    `fetch_max_wait_ms` (Kafka's fetch.max.wait.ms): how long a broker may hold a fetch
    that finds nothing new, answering it as soon as records arrive (0 to
    config.FETCH_WAIT_MAX_MS; 0: never held, the consumer asks again every
    `fetch_wait_ms`). It is also how late a seek or an assignment of an idle consumer can
    take effect.

    `group`: join that consumer group (kera.consumer.membership): the coordinator assigns
    this consumer its share of the streams' streamlets, each from the group's committed
    position (else from `start`); `commit()` / auto-commit every `auto_commit_interval_ms`
    (None: off) save what was handed out. `group_instance_id`: static membership, a restart
    within `session_timeout_ms` gets the same streamlets back without a rebalance.
    `pattern` (with `group`): also every stream whose whole name matches this regular
    expression ("clicks-.*"), later ones included (Kafka's subscribe(pattern)); `stream` may
    be []. `bootstrap` may be a confluent-kafka configuration dict instead
    (kera.client.kafka_config): Consumer({"bootstrap.servers": ..., "group.id": ...}, "clicks").
    `subscribe(streams)` / `unsubscribe()` change what it reads later, as confluent-kafka's do.

    Streamlets added to a stream later (`kera stream alter --streamlets`) are read from
    their beginning once this consumer's descriptor is refreshed (at least every
    `metadata_max_age_ms`) when it reads all streamlets or a `member`'s share; a group
    assigns them on its own; an explicit `streamlets` list stays as given.

    `isolation_level` (ISOLATION_LEVELS, Kafka's isolation.level): "read_committed" (default)
    reads transactional producers' records once their transaction commits, never aborted ones;
    "read_uncommitted" reads everything durable."""

    _membership = None     # the group membership (kera.consumer.membership), None without a group
    _polled_as: GroupMetadata | None = None   # group_metadata() as of the last chunk handed out

    def __init__(self, bootstrap: str, stream: str | list[str] = (), *, start="earliest",
                 streamlets=None, member: int | None = None, members: int | None = None,
                 cache_chunks_max: int = config.DEFAULT_CACHE_CHUNKS_MAX,
                 fetch_max_bytes: int = config.DEFAULT_FETCH_MAX_BYTES,
                 request_timeout_s: float = config.DEFAULT_REQUEST_TIMEOUT_S,
                 fetch_wait_ms: float = config.DEFAULT_FETCH_WAIT_MS,
                 fetch_max_wait_ms: int = config.DEFAULT_FETCH_MAX_WAIT_MS,
                 on_lost_position: str = "raise", on_assigned=None, on_revoked=None,
                 group: str | None = None, group_instance_id: str | None = None,
                 pattern: str | None = None, key_file: str | None = None,
                 session_timeout_ms: int = 10_000, auto_commit_interval_ms: int | None = 5_000,
                 env: ClientEnv | None = None,
                 metadata_max_age_ms: int = config.DEFAULT_METADATA_MAX_AGE_MS,
                 isolation_level: str = "read_committed"):
        if isinstance(bootstrap, Mapping):   # a confluent-kafka configuration dict
            given = {k: v for k, v in locals().items() if k not in ("self", "bootstrap", "stream")}
            self.__init__(stream=stream, **kera_arguments(bootstrap, CONSUMER_PROPERTIES,
                                                          Consumer.__init__, given))
            return
        _check_options(group is not None and (streamlets is not None or member is not None),
                       cache_chunks_max, fetch_max_bytes, on_lost_position, fetch_max_wait_ms)
        if isolation_level not in ISOLATION_LEVELS:
            raise BadRequest(f"isolation_level={isolation_level!r}: use one of {ISOLATION_LEVELS}")
        self.isolation_level = isolation_level
        self.streams = [stream] if isinstance(stream, str) else list(dict.fromkeys(stream))
        if not self.streams and group is None:
            raise BadRequest("give at least one stream to read (a group member may give none "
                             "and subscribe() later)")
        # The one stream of a single-stream consumer (None when it reads several).
        self.stream = self.streams[0] if isinstance(stream, str) else None
        self.cache_chunks_max = cache_chunks_max
        self.request_timeout_s = request_timeout_s
        self.on_assigned, self.on_revoked, self.group = on_assigned, on_revoked, group
        self._default_start = start if isinstance(start, str) else "earliest"
        self.key_file = key_file   # CURVE key (kera.net.keys): None is $KERA_KEY_FILE or plaintext
        # How new streamlets are taken up: (member, members) to share them, None: not at all.
        self._follow = None if group is not None or streamlets is not None else (member, members)
        self._open_metadata(bootstrap, env, metadata_max_age_ms)
        try:
            if pattern is not None:
                _note_pattern(NamePattern(pattern), self._meta)
            self._infos = {name: self._meta.stream(name) for name in self.streams}
            parts = [] if group is not None else [
                (name, sl) for name, info in self._infos.items()
                for sl in _assigned(info.streamlets, streamlets, member, members)]
            starts = self._start_cursors(start, parts)
        except BaseException:
            self._meta.close()
            raise
        self._init_fetching(fetch_max_bytes, fetch_wait_ms, fetch_max_wait_ms, on_lost_position)
        self._init_cache()
        self._set_cursors(starts)
        self._waker = self._env.waker()
        from kera.consumer.fetcher import Fetcher
        self._fetcher = Fetcher(self)
        self._fetcher.start_engine()
        self._membership = None
        if group is not None:
            self._join(group, group_instance_id, session_timeout_ms, auto_commit_interval_ms,
                       pattern)

    def _init_fetching(self, fetch_max_bytes: int, fetch_wait_ms: float, fetch_max_wait_ms: int,
                       on_lost_position: str) -> None:
        self._consumed = {}
        self._fetch = FetchState({name: info.id for name, info in self._infos.items()}, {},
                                 fetch_max_bytes=fetch_max_bytes,
                                 request_timeout_s=self.request_timeout_s,
                                 idle_wait_s=fetch_wait_ms / 1000, on_lost_position=on_lost_position,
                                 max_wait_ms=int(fetch_max_wait_ms))
        self._tasks = TaskRunner(self.request_timeout_s)
        # Guards _fetch and _tasks; taken before _lock when both are (the request thread's order).
        # Re-entrant: a task's on_reply runs under it and may call assign/unassign/seek.
        self._state_lock = threading.RLock()

    def _open_metadata(self, bootstrap: str, env: ClientEnv | None, max_age_ms: int) -> None:
        self._env = env or ClientEnv()   # clock, connections, wake-ups, thread (kera.client.env)
        self._meta = Metadata(bootstrap, timeout_s=self.request_timeout_s, key_file=self.key_file,
                              max_age_s=max_age_ms / 1000)
        if self._env.prime is not None:
            self._env.prime(self._meta)

    def _init_cache(self) -> None:
        """The caller's side: the cache the request thread fills and what is being walked."""
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._items: collections.deque = collections.deque()
        self._cached_chunks = 0
        self._fetcher_waiting = False
        self._stopping = False
        self._closed = False
        self._error: KeraError | None = None
        # The item being walked record by record: the ChunkItem, its columns as lists (keys,
        # values, timestamps, headers, offsets, numbers: `_walk`) and the next record's index.
        self._cur: ChunkItem | None = None
        self._cur_lists = None
        self._cur_idx = 0
        self.records_consumed = 0

    # ------------------------------------------------------------------ single-stream view
    @property
    def info(self):
        """The stream descriptor of a single-stream consumer (its first stream's otherwise)."""
        return self._infos[self.streams[0]]

    @property
    def streamlets(self) -> list[int]:
        """The streamlets read of a single-stream consumer's stream (its first stream's)."""
        return sorted(sl for st, sl in self._consumed if st == self.streams[0])

    # ------------------------------------------------------------------ start positions
    def _start_cursors(self, start, parts: list[tuple]) -> dict[tuple, tuple]:
        """{part: (low, offsets, epoch, earliest)} where each part starts."""
        if isinstance(start, str):
            if start not in NAMED_STARTS:
                raise BadRequest(f"start must be 'earliest', 'latest' or a list of positions, "
                                 f"not {start!r}")
            return self._named_cursors(parts, start)
        given = _cursors_by_part(list(start), set(self.streams))
        unknown = sorted(part for part, (low, offsets, epoch) in given.items()
                         if epoch is None and (low, offsets) != (0, {0: 0}))
        if unknown:
            log.warning("positions of %s carry no epoch (saved by an older kera): resumed "
                        "unchecked, a loss of their data since cannot be detected; save "
                        "positions() again to get checked ones", unknown)
        # Parts without a saved position start at the beginning.
        return {part: (*given[part], False) if part in given else (0, {}, None, True)
                for part in parts}

    def _named_cursor(self, part: tuple, where: str, conns: dict | None = None) -> tuple:
        # A part starting from its beginning starts from its first retained group.
        return (0, {}, None, True) if where == "earliest" else (*self._latest(part, conns), False)

    def _named_cursors(self, parts, where: str) -> dict[tuple, tuple]:
        """_named_cursor of each part, on one connection per broker."""
        conns: dict = {}
        try:
            return {part: self._named_cursor(part, where, conns) for part in parts}
        finally:
            for conn in conns.values():
                conn.close()

    def _set_cursors(self, starts: dict) -> None:
        """Read each part from its start on; anything fetched before for it is dropped."""
        with self._state_lock, self._lock:
            for part, (low, offsets, epoch, earliest) in starts.items():
                self._fetch.set_cursor(part, FetchCursor(part[1], low, offsets, earliest=earliest,
                                                         epoch=epoch))
                self._consumed[part] = ConsumedCursor(part[1], low, offsets, epoch)
                self._purge(part)

    def _offsets(self, part: tuple, conns: dict | None = None) -> tuple[list, int, int | None]:
        """(groups, first_group, epoch) of a part, from its owning broker's `offsets`; `conns`
        (address -> rpc.Connection, the caller closes them): connections to reuse across
        parts (else one per call)."""
        header, address = self._offsets_reply(part, conns)
        return _parse_offsets(header, address)

    def _offsets_reply(self, part: tuple, conns: dict | None = None,
                       at: dict | None = None) -> tuple[dict, str]:
        """(reply, broker address) of `offsets` for a part; `at`: a reader's cursor, whose lag
        in bytes the reply then holds."""
        return self._part_call(part, "offsets", {} if at is None else {"at": at}, conns)

    def _part_call(self, part: tuple, op: str, extra: dict,
                   conns: dict | None = None) -> tuple[dict, str]:
        """(reply, broker address) of `op` (fields `sid`, `sl` and `extra`) on the broker owning
        a part, retried through metadata refreshes until the request timeout."""
        stream, sl = part
        deadline = time.monotonic() + self.request_timeout_s
        for _attempt in range(int(self.request_timeout_s / LATEST_RETRY_S) + 1):
            address = self._infos[stream].address_of(sl)
            err: KeraError
            if address is None:
                err = KeraError(f"streamlet {sl} of '{stream}' has no live broker", retriable=True)
            else:
                try:
                    fields = {"sid": self._infos[stream].id, "sl": sl, **extra}
                    left_s = max(0.1, deadline - time.monotonic())
                    if conns is None:
                        header, _ = rpc.call(address, op, fields, timeout_s=left_s,
                                             key_file=self.key_file)
                    else:
                        conn = conns.get(address) or conns.setdefault(
                            address, rpc.Connection(address, timeout_s=self.request_timeout_s,
                                                    key_file=self.key_file))
                        header, _ = conn.call(op, fields, timeout_s=left_s)
                    return header, address
                except KeraError as e:
                    if not e.retriable:
                        raise
                    err = e
            if time.monotonic() + LATEST_RETRY_S >= deadline:
                break
            time.sleep(LATEST_RETRY_S)
            self._infos[stream] = self._meta.refresh(stream)
        raise Timeout(f"{op} of '{stream}' streamlet {sl}: {err.message}")

    def _latest(self, part: tuple, conns: dict | None = None) -> tuple[int, dict[int, int], int | None]:
        """Each group's durable end."""
        groups, first, epoch = self._offsets(part, conns)
        cursor = FetchCursor.at_end(part[1], groups, first)
        return cursor.low, cursor.offsets, epoch

    # ------------------------------------------------------------------ reading
    def poll(self, timeout_s: float | None = None) -> Record | None:
        """The next record, waiting up to `timeout_s` (None: forever); None on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                cur = self._cur
                if cur is not None:
                    i = self._cur_idx
                    keys, values, stamps, headers, offsets, numbers = self._cur_lists
                    if i < len(values):
                        self._cur_idx = i + 1
                        self.records_consumed += 1
                        if offsets is None:   # an ordinary chunk: dense, `numbers` the first
                            off, num = cur.first + i, None if numbers is None else numbers + i
                        else:                 # a compacted one: at its offset deltas
                            off, num = offsets[i], None if numbers is None else numbers[i]
                        return Record(keys[i], values[i], stamps[i], cur.stream, cur.streamlet,
                                      cur.group, off,
                                      tuple(headers[i]) if headers is not None else (), num)
                    self._finish_current()
                item = self._next_item(deadline)
                if item is None:
                    return None
                if type(item) is ChunkItem:
                    self._walk(item)
                    self._note_membership()
                else:
                    self._apply(item)

    def _walk(self, item: ChunkItem) -> None:
        """Make `item` the chunk `poll` hands out record by record: its columns as lists, and
        its offsets and numbers as lists for a compacted chunk only (an ordinary one's are
        `first + i`: indexing a range per record cost more than the addition)."""
        chunk, skip = item.chunk, item.skip
        if item.sparse:
            offsets, numbers = item.offsets(), item.numbers()
        else:
            first = chunk.first_number
            offsets, numbers = None, None if first is None else first + skip
        self._cur = item
        self._cur_idx = 0
        self._cur_lists = (chunk.keys()[skip:], chunk.values()[skip:],
                           chunk.timestamps[skip:].tolist(),
                           chunk.headers()[skip:] if chunk.has_headers else None,
                           offsets, numbers)

    def poll_batch(self, timeout_s: float | None = 0.0, max_chunks: int | None = None) -> list[Batch]:
        """Whole chunks as columnar Batches (at least one unless `timeout_s` passes first)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        limit = self.cache_chunks_max if max_chunks is None else max(1, max_chunks)
        out: list[Batch] = []
        with self._lock:
            cur = self._cur
            if cur is not None:
                i = self._cur_idx
                if i < len(self._cur_lists[1]):
                    out.append(Batch(cur.stream, cur.streamlet, cur.group, cur.offset_at(i),
                                     cur.chunk, cur.skip + i))
                    self.records_consumed += len(self._cur_lists[1]) - i
                self._finish_current()
            while len(out) < limit:
                item = self._next_item(None if out else deadline, block=not out)
                if item is None:
                    break
                if type(item) is ChunkItem:
                    self._note_membership()
                    if item.count:   # a compacted chunk may hold no record left to deliver
                        out.append(Batch(item.stream, item.streamlet, item.group, item.first,
                                         item.chunk, item.skip))
                    self._consumed[item.part].consumed(item.group, item.end, item.epoch)
                    self.records_consumed += item.count
                else:
                    try:
                        self._apply(item)
                    except KeraError:
                        if out:  # deliver what precedes the error; raise it on the next call
                            self._items.appendleft(item)
                            break
                        raise
        return out

    def __iter__(self):
        while not self._closed:
            try:
                record = self.poll(timeout_s=0.2)
            except ClientClosed:
                return
            if record is not None:
                yield record

    def positions(self, parts=None) -> list[Position]:
        """Where to resume to read exactly what follows what was consumed: for each assigned
        part (or each of `parts`), every group from its lowest unfinished one up. Positions
        name their stream: the list of every stream is one valid `start=`."""
        with self._lock:
            return self._positions(sorted(self._consumed) if parts is None else parts)

    def _positions(self, parts) -> list[Position]:
        cur = self._cur
        out: list[Position] = []
        for part in parts:
            partial = None
            if cur is not None and cur.part == part:
                partial = (cur.group, cur.offset_at(self._cur_idx))
                if cur.epoch is not None:
                    self._consumed[part].epoch = cur.epoch   # its history, as consumed() does
            out += self._consumed[part].positions(part[0], partial)
        return out

    # ------------------------------------------------------------------ seeking (issue 14)
    def seek(self, stream, streamlet: int | None = None, position=None) -> None:
        """Read `streamlet` of `stream` from `position` on: "earliest", "latest", a Position or
        the list of its positions (as positions() gives them); or `seek(positions)` with a list
        of positions of any assigned parts. As with Kafka, it takes effect on the next poll:
        records fetched before it and not yet handed out are dropped."""
        if streamlet is None and position is None:
            targets = _cursors_by_part(list(stream), set(self.streams))
            starts = {part: (*c, False) for part, c in targets.items()}
        elif isinstance(position, str):
            if position not in NAMED_STARTS:
                raise BadRequest(f"seek to 'earliest', 'latest' or positions, not {position!r}")
            starts = {(stream, streamlet): self._named_cursor((stream, streamlet), position)}
        else:
            given = [position] if isinstance(position, Position) else list(position)
            targets = _cursors_by_part(given, {stream})
            if set(targets) - {(stream, streamlet)}:
                raise BadRequest(f"positions {given} are not all of stream '{stream}' "
                                 f"streamlet {streamlet}")
            starts = {part: (*c, False) for part, c in targets.items()}
        self._check_assigned(starts)
        self._set_cursors(starts)
        self._wake()

    def seek_to_beginning(self, parts=None) -> None:
        """Read each of `parts` (default: every assigned part) from its first retained record."""
        self._seek_named(parts, "earliest")

    def seek_to_end(self, parts=None) -> None:
        """Read each of `parts` (default: every assigned part) from its durable end: only
        records produced from now on (asks each part's broker, as start="latest" does)."""
        self._seek_named(parts, "latest")

    def _seek_named(self, parts, where: str) -> None:
        parts = self.assignment() if parts is None else [tuple(p) for p in parts]
        starts = self._named_cursors(parts, where)
        self._check_assigned(starts)
        self._set_cursors(starts)
        self._wake()

    # ------------------------------------------------------------------ seeking by time
    def offsets_for_times(self, times: dict | None = None, *, stream: str | None = None,
                          timestamp_ms: int | None = None) -> list[Position]:
        """Positions of the first record whose timestamp is at or after a time (Kafka's
        offsets_for_times): `times` = {(stream, streamlet): timestamp_ms}, or `stream` +
        `timestamp_ms` for every streamlet of that stream. Per group, the earliest offset whose
        timestamp is >= the time (records of several producers are not time-ordered: a later
        one may carry an older time, as in Kafka). A part with no such record gets its durable
        end, not Kafka's null: reading from there gets what is produced later. The result is
        one valid `seek()` / `start=`; any stream may be asked, read by this consumer or not."""
        if (times is None) == (stream is None or timestamp_ms is None):
            raise BadRequest("offsets_for_times takes {(stream, streamlet): timestamp_ms} or "
                             "stream= and timestamp_ms=, one of the two")
        if times is None:
            times = {(stream, sl): timestamp_ms for sl in range(self._info_of(stream).streamlets)}
        targets = _time_targets(times)
        for name, sl in targets:
            if sl >= self._info_of(name).streamlets:
                raise BadRequest(f"stream '{name}' has streamlets 0..{self._infos[name].streamlets - 1}, "
                                 f"not {sl}")
        return [p for part, (low, offsets, epoch, _) in sorted(self._time_cursors(targets).items())
                for p in ConsumedCursor(part[1], low, offsets, epoch).positions(part[0])]

    def _info_of(self, stream: str):
        """The descriptor of `stream`, read by this consumer or not (fetched once)."""
        if stream not in self._infos:
            self._infos[stream] = self._meta.stream(stream)
        return self._infos[stream]

    def seek_to_time(self, timestamp_ms: int, parts=None) -> None:
        """Read each of `parts` (default: every assigned part, a group member's included) from
        its first record whose timestamp is at or after `timestamp_ms` (see offsets_for_times)."""
        parts = self.assignment() if parts is None else [tuple(p) for p in parts]
        self._check_assigned(parts)
        starts = self._time_cursors({part: timestamp_ms for part in parts})
        self._set_cursors(starts)
        self._wake()

    def _time_cursors(self, times: dict) -> dict[tuple, tuple]:
        """{part: (low, offsets, epoch, earliest)} at each part's time (`offsets_for_time` of
        its broker), on one connection per broker."""
        targets = {part: ms_to_us(ms) for part, ms in times.items()}   # refused before any call
        conns: dict = {}
        try:
            return {part: self._time_cursor(part, us, conns) for part, us in targets.items()}
        finally:
            for conn in conns.values():
                conn.close()

    def _time_cursor(self, part: tuple, timestamp_us: int, conns: dict) -> tuple:
        return self._cursor_reply(part, "offsets_for_time", {"timestamp_us": timestamp_us}, conns)

    def _cursor_reply(self, part: tuple, op: str, fields: dict, conns: dict) -> tuple:
        """(low, offsets, epoch, earliest): the cursor a broker's `op` answers for `part`."""
        header, address = self._part_call(part, op, fields, conns)
        try:
            c = schema.time_cursor(header)
        except BadRequest as err:
            raise KeraError(f"malformed {op} reply from {address}: {err.message}",
                            retriable=True) from None
        # From the first retained group on: read from the first retained group, even if
        # retention deletes that one before the first fetch.
        return c.low, c.offsets, c.epoch, c.low <= c.first_group

    # ------------------------------------------------------------------ seeking by number
    def offsets_for_number(self, stream: str, streamlet: int, number: int) -> list[Position]:
        """Positions of the record numbered `number` in `streamlet` (record numbers are dense
        per streamlet in a stream with one active group per streamlet): reading from them gets
        that record and the ones after it. A Waltz-style service that applied everything up to
        its high-water mark N reads on from number N + 1. A number retention deleted gives the
        first retained record; one not written yet gives the end. Any stream may be asked."""
        if not 0 <= streamlet < self._info_of(stream).streamlets:
            raise BadRequest(f"stream '{stream}' has streamlets 0..{self._infos[stream].streamlets - 1}, "
                             f"not {streamlet}")
        low, offsets, epoch, _ = self._number_cursor((stream, streamlet), number)
        return ConsumedCursor(streamlet, low, offsets, epoch).positions(stream)

    def seek_to_number(self, stream: str, streamlet: int, number: int) -> None:
        """Read `streamlet` of `stream` (assigned to this consumer) from the record numbered
        `number` on (see offsets_for_number); takes effect on the next poll."""
        part = (stream, streamlet)
        self._check_assigned([part])
        self._set_cursors({part: self._number_cursor(part, number)})
        self._wake()

    def number_span(self, stream: str, streamlet: int) -> tuple[int, int]:
        """(first retained, durable end) record numbers of a streamlet with one active group
        per streamlet (a Kafka partition's log start offset and high watermark)."""
        self._info_of(stream)
        conns: dict = {}
        try:
            header, address = self._part_call((stream, streamlet), "numbers", {}, conns)
        finally:
            for conn in conns.values():
                conn.close()
        start, end = header.get("start"), header.get("end")
        if not (type(start) is int and type(end) is int and 0 <= start <= end):
            raise KeraError(f"malformed numbers reply from {address}", retriable=True)
        return start, end

    def _number_cursor(self, part: tuple, number: int) -> tuple:
        if not 0 <= number <= schema.NUMBER_MAX:
            raise BadRequest(f"record number {number} is outside 0..{schema.NUMBER_MAX}")
        conns: dict = {}
        try:
            return self._cursor_reply(part, "offsets_for_number", {"number": number}, conns)
        finally:
            for conn in conns.values():
                conn.close()

    def _check_assigned(self, parts) -> None:
        with self._lock:
            missing = sorted(p for p in parts if p not in self._consumed)
        if missing:
            raise BadRequest(f"parts {missing} are not assigned to this consumer: assign() them first")

    def watermarks(self, stream: str, streamlet: int) -> tuple[int, int]:
        """(low, high) in records of a streamlet, counted over its retained groups (records
        deleted by retention are not counted: low is 0); asks its broker (`offsets`)."""
        self._info_of(stream)
        groups, _first, _epoch = self._offsets((stream, streamlet))
        return lagmath.watermarks(groups)

    def lag(self) -> dict[tuple[str, int], int]:
        """{(stream, streamlet): durable records not yet handed to the application}, for every
        assigned part (one `offsets` request per part to its broker)."""
        return {part: lag.records for part, lag in self.lag_detail().items()}

    def lag_detail(self) -> dict[tuple[str, int], lagmath.Lag]:
        """{(stream, streamlet): Lag(records, bytes)} not yet handed to the application, for
        every assigned part: `lag()` with the bytes too, at the same cost."""
        with self._lock:
            consumed = {part: self._consumed_at(part) for part in self._consumed}
        return self._lag_at(consumed)

    def lag_of(self, positions: list[Position]) -> dict[tuple[str, int], int]:
        """{(stream, streamlet): durable records past `positions`} (e.g. a group's committed
        ones, `kera group describe`), whether or not this consumer reads those parts."""
        return {part: lag.records for part, lag in self.lag_detail_of(positions).items()}

    def lag_detail_of(self, positions: list[Position]) -> dict[tuple[str, int], lagmath.Lag]:
        """`lag_of` with the bytes too: {(stream, streamlet): Lag(records, bytes)}."""
        for stream in dict.fromkeys(p.stream for p in positions):
            self._add_stream(stream)
        at: dict[tuple[str, int], tuple[int, dict[int, int]]] = {}
        for p in positions:
            low, offsets = at.get((p.stream, p.streamlet), (p.group, {}))
            offsets[p.group] = p.offset
            at[(p.stream, p.streamlet)] = (min(low, p.group), offsets)
        return self._lag_at(at)

    def _lag_at(self, consumed: dict) -> dict[tuple[str, int], lagmath.Lag]:
        out = {}
        conns: dict = {}
        try:
            for part, (low, offsets) in sorted(consumed.items()):
                at = {"low": low, "offsets": offsets}
                header, address = self._offsets_reply(part, conns, at)
                groups, _first, _epoch = _parse_offsets(header, address)
                out[part] = lagmath.Lag(lagmath.lag_records(groups, low, offsets),
                                        _behind_bytes(header, address))
        finally:
            for conn in conns.values():
                conn.close()
        return out

    def _consumed_at(self, part: tuple) -> tuple[int, dict[int, int]]:
        cc = self._consumed[part]
        offsets = dict(cc.offsets)
        cur = self._cur
        if cur is not None and cur.part == part and cur.group >= cc.low:
            offsets[cur.group] = cur.offset_at(self._cur_idx)
        return cc.low, offsets

    # ------------------------------------------------------------------ assignment (issue 11)
    def assignment(self) -> list[tuple[str, int]]:
        """The (stream, streamlet) parts this consumer reads, sorted."""
        with self._lock:
            return sorted(self._consumed)

    def assign(self, parts, positions=None) -> None:
        """Start reading `parts` ((stream, streamlet) pairs, of any stream), each from its
        position in `positions` (e.g. a group's committed ones) else from this consumer's
        `start` ("earliest" unless "latest" was given). Parts already read are repositioned
        only when `positions` names them. Then calls `on_assigned(parts)`."""
        parts = [(str(st), int(sl)) for st, sl in parts]
        for stream in dict.fromkeys(st for st, _ in parts):
            self._add_stream(stream)
        for stream, sl in parts:
            if sl >= self._infos[stream].streamlets:   # raised since we asked: ask again
                self._infos[stream] = self._meta.refresh(stream)
            if not 0 <= sl < self._infos[stream].streamlets:
                raise BadRequest(f"stream '{stream}' has {self._infos[stream].streamlets} "
                                 f"streamlets; no streamlet {sl}")
        given = _cursors_by_part(list(positions or []), {st for st, _ in parts})
        with self._lock:
            fresh = [p for p in parts if p not in self._consumed]
        starts = self._named_cursors([p for p in fresh if p not in given], self._default_start)
        starts.update({p: (*c, False) for p, c in given.items() if p in set(parts)})
        self._set_cursors(starts)
        self._wake()
        if self.on_assigned is not None:
            self.on_assigned(parts)

    def unassign(self, parts) -> list[Position]:
        """Stop reading `parts`; returns their exact positions (what was handed out of them).
        Calls `on_revoked(parts)` first. Their records fetched and not handed out are dropped."""
        parts = [(str(st), int(sl)) for st, sl in parts]
        if self.on_revoked is not None:
            self.on_revoked(parts)
        with self._state_lock, self._lock:
            gone = [p for p in parts if p in self._consumed]
            out = self._positions(gone)
            for part in gone:
                self._purge(part)
                self._fetch.remove(part)
                del self._consumed[part]
        return out

    def subscribe(self, streams) -> None:
        """Read `streams` from now on instead (confluent-kafka's subscribe: a name or a list;
        with a group, entries starting with "^" are patterns). A group member asks its group
        for them and the group rebalances (kera.consumer.membership); without a group, parts
        of streams no longer named are dropped and each new stream is read whole (or this
        `member`'s share), from `start`."""
        names, pattern = subscription(streams)
        if self._membership is not None:
            with self._state_lock:
                self.streams = list(names)
                self._membership.subscribe(names, pattern, self._env.clock())
            self._wake()
            return
        if pattern is not None:
            raise BadRequest("a pattern subscription needs a consumer group: "
                             "Consumer(..., group='name')")
        for name in names:
            self._add_stream(name)   # an unknown name raises before anything changes
        self.unassign([part for part in self.assignment() if part[0] not in names])
        read = {st for st, _ in self.assignment()}
        self.assign([(name, sl) for name in names if name not in read
                     for sl in _assigned(self._infos[name].streamlets, None,
                                         *(self._follow or (None, None)))])
        self.streams = list(names)

    def unsubscribe(self) -> None:
        """Read nothing until subscribe() (confluent-kafka's unsubscribe): a group member
        commits what it was handed and leaves the group, but stays open."""
        if self._membership is not None:
            with self._state_lock:
                self._membership.unsubscribe(self._env.clock())
                self.streams = []
            self._wake()
            return
        self.unassign(self.assignment())
        self.streams = []

    # ------------------------------------------------------------------ groups (issue 11)
    def _join(self, group, instance_id, session_timeout_ms, auto_commit_interval_ms,
              pattern) -> None:
        self._membership = Membership(
            self, self._meta.coordinators, group, list(self.streams), time.monotonic(),
            instance_id=instance_id, pattern=pattern, session_timeout_ms=session_timeout_ms,
            auto_commit_interval_ms=auto_commit_interval_ms,
            on_fatal=lambda err: self._push([ErrorItem(err)]))
        self.add_task(self._membership)

    def commit(self, positions=None, timeout_s: float | None = None, *,
               message: Record | None = None, asynchronous: bool = False) -> None:
        """Save positions in the group: `positions` (a list of Position), or the position just
        after `message` in its streamlet (confluent-kafka's commit(message=)), or those of
        everything handed to the application so far. Waits for the answer, raising
        StaleMemberEpoch for parts this consumer no longer holds and UnknownMember once the
        group dropped it; `asynchronous=True` returns at once (a failed commit is logged, and
        the next commit carries the positions again)."""
        if self._membership is None:
            raise BadRequest("commit() needs a consumer group: Consumer(..., group='name')")
        if message is not None and positions is not None:
            raise BadRequest("commit() takes positions or message, not both")
        held = (self._position_after(message) if message is not None else
                self.positions() if positions is None else list(positions))
        with self._state_lock:
            future = self._membership.commit(held)
        self._wake()
        if asynchronous:
            future.add_done_callback(_log_commit_failure)
            return
        future.result(self.request_timeout_s if timeout_s is None else timeout_s)

    def _position_after(self, record: Record) -> list[Position]:
        if self._info_of(record.stream).active_groups != 1:
            raise BadRequest(f"commit(message=) needs one active group per streamlet; "
                             f"'{record.stream}' has several: commit(positions) instead")
        return position_after(record, self.positions([(record.stream, record.streamlet)]))

    def group_metadata(self) -> GroupMetadata:
        """This member's group, member id and epoch, for a transactional producer's
        send_positions_to_transaction (the coordinator then refuses positions from a member
        a rebalance has fenced)."""
        m = self._membership
        if m is None:
            raise BadRequest("group_metadata() needs a consumer group: Consumer(..., group='name')")
        if self._polled_as is not None:
            return self._polled_as
        return GroupMetadata(self.group, m.member_id, m.member_epoch)

    def _note_membership(self) -> None:
        """Remember who this member was when it handed out a chunk: group_metadata() answers
        that, not who it is now, so positions of records read before a rebalance or a
        coordinator restart (after which the request thread may already hold other parts,
        or none) are refused with them, as Kafka's metadata changes only at a poll."""
        m = self._membership
        if m is not None:
            self._polled_as = GroupMetadata(self.group, m.member_id, m.member_epoch)

    def group_held_until(self) -> float | None:
        """With a group: the time.monotonic() until which the parts assigned now are surely
        this consumer's alone (its self-fence deadline, kera.consumer.membership); work that
        must stop once another member may own them checks it. None: not a member now.
        Read without the state lock: on_revoked runs under it and may wait for work that
        calls this (each field read is written atomically by the request thread)."""
        if self._membership is None:
            return None
        return self._membership.held_until()

    def committed(self, parts=None) -> list[Position]:
        """The group's committed positions (of `parts`, default every part it has)."""
        if self.group is None:
            raise BadRequest("committed() needs a consumer group: Consumer(..., group='name')")
        header, _ = self._meta.call("group_offsets", {"group": self.group},
                                    timeout_s=self.request_timeout_s)
        out = positions_from_wire(header["positions"])
        wanted = None if parts is None else {tuple(p) for p in parts}
        return [p for p in out if wanted is None or (p.stream, p.streamlet) in wanted]

    def _leave_group(self) -> None:
        """On close: commit what was handed out (when auto-committing) and leave, so the
        group reassigns this consumer's streamlets at once instead of after its timeout."""
        m = self._membership
        if m is None or not m.member_id:
            return
        try:
            if m.auto_commit_s is not None and self.assignment():
                self._meta.call("group_commit", m.ids() | {
                    "positions": positions_to_wire(self.positions())},
                    timeout_s=self.request_timeout_s)
            op, fields = m.leave_request()
            self._meta.call(op, fields, timeout_s=self.request_timeout_s)
        except KeraError as err:
            log.warning("group '%s': leaving failed (%s): the coordinator drops this member "
                        "after its session timeout", self.group, err)

    def add_task(self, task) -> None:
        """Have the request thread drive `task` (kera.consumer.tasks: next_request / on_reply /
        on_error / next_wake) on the consumer's connections: the hook for group membership.
        Call `wakeup()` when something outside makes the task want to send sooner."""
        with self._state_lock:
            self._tasks.add(task)
        self._wake()

    def wakeup(self) -> None:
        """Have the request thread look at its fetches and tasks again now."""
        self._wake()

    def _grow(self, info) -> None:
        """A refreshed descriptor (request thread, under the state lock): a raised streamlet
        count; the new streamlets this consumer follows are read from their beginning."""
        known = self._infos.get(info.name)
        if known is None or known.id != info.id or info.streamlets <= known.streamlets:
            return
        self._infos[info.name] = info
        if self._follow is None:
            return
        new = [(info.name, sl) for sl in _assigned(info.streamlets, None, *self._follow)
               if sl >= known.streamlets]
        log.info("stream '%s' now has %d streamlets: reading %s from their beginning",
                 info.name, info.streamlets, [sl for _, sl in new])
        self._set_cursors({part: (0, {}, None, True) for part in new})

    def _add_stream(self, stream: str) -> None:
        info = self._infos.get(stream) or self._meta.stream(stream)
        with self._state_lock:
            self._infos[stream] = info
            self._fetch.stream_ids[stream] = info.id
            if stream not in self.streams:
                self.streams.append(stream)

    # ------------------------------------------------------------------ cache
    def _next_item(self, deadline: float | None, block: bool = True):
        """The next cache item (called with _lock held; waiting releases it)."""
        while not self._items:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise ClientClosed("consumer is closed")
            if not block:
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._ready.wait(left)
        item = self._items.popleft()
        if type(item) is ChunkItem:
            self._cached_chunks -= 1
            self._wake_fetcher_for_room()
        return item

    def _wake_fetcher_for_room(self) -> None:
        if self._fetcher_waiting:
            self._fetcher_waiting = False
            self._wake()

    def _purge(self, part: tuple) -> None:
        """Drop what was fetched of `part` and not handed out (with _lock held)."""
        kept = collections.deque(it for it in self._items
                                 if type(it) is ErrorItem or it.part != part)
        self._cached_chunks -= sum(1 for it in self._items
                                   if type(it) is ChunkItem and it.part == part)
        self._items = kept
        if self._cur is not None and self._cur.part == part:
            self._cur, self._cur_lists, self._cur_idx = None, None, 0
        self._wake_fetcher_for_room()

    def _push(self, items: list) -> None:
        """Called by the request thread."""
        with self._lock:
            self._items.extend(items)
            self._cached_chunks += sum(1 for it in items if type(it) is ChunkItem)
            self._ready.notify_all()

    def _apply(self, item) -> None:
        if type(item) is LowItem:
            self._consumed[item.part].finished_below(item.low)
        elif type(item) is ResetItem:
            self._consumed[item.part] = ConsumedCursor(item.part[1], item.low, item.offsets,
                                                       item.epoch)
        elif type(item) is ErrorItem:
            self._error = item.error
            raise item.error

    def _finish_current(self) -> None:
        cur = self._cur
        self._consumed[cur.part].consumed(cur.group, cur.end, cur.epoch)
        self._cur = None
        self._cur_lists = None
        self._cur_idx = 0

    def _wake(self) -> None:
        waker = getattr(self, "_waker", None)
        if waker is not None:
            waker.wake()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._stopping = True
            self._ready.notify_all()
        self._wake()
        self._fetcher.join(self.request_timeout_s + 5)
        self._leave_group()
        self._meta.close()
        with self._lock:
            self._waker.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stats(self) -> dict:
        with self._lock:
            return {"records_consumed": self.records_consumed, "cached_chunks": self._cached_chunks}


def _check_options(group_and_streamlets: bool, cache_chunks_max: int, fetch_max_bytes: int,
                   on_lost_position: str, fetch_max_wait_ms: int) -> None:
    if group_and_streamlets:
        raise BadRequest("a group member's streamlets are assigned by its group: give "
                         "`group` or `streamlets`/`member`, not both")
    if cache_chunks_max < 1 or fetch_max_bytes < 1:
        raise ValueError("cache_chunks_max and fetch_max_bytes must be positive")
    if on_lost_position not in LOST_POSITION_POLICIES:
        raise ValueError(f"on_lost_position must be one of {LOST_POSITION_POLICIES}, "
                         f"not {on_lost_position!r}")
    if not 0 <= fetch_max_wait_ms <= config.FETCH_WAIT_MAX_MS:
        raise ValueError(f"fetch_max_wait_ms must be in [0, {config.FETCH_WAIT_MAX_MS}], "
                         f"not {fetch_max_wait_ms}")


def _parse_offsets(header: dict, address: str) -> tuple[list, int, int | None]:
    first = header.get("first_group", 0)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise KeraError(f"bad first_group {first!r} from {address}", retriable=True)
    epoch = header.get("epoch")
    if epoch is not None and (not isinstance(epoch, int) or epoch < 0):
        raise KeraError(f"bad epoch {epoch!r} from {address}", retriable=True)
    return parse_groups(header.get("groups")), first, epoch


def _behind_bytes(header: dict, address: str) -> int | None:
    behind = header.get("behind_bytes")
    if behind is not None and (not isinstance(behind, int) or isinstance(behind, bool)
                               or behind < 0):
        raise KeraError(f"bad behind_bytes {behind!r} from {address}", retriable=True)
    return behind


def _cursors_by_part(positions: list, streams: set) -> dict[tuple, tuple]:
    """{(stream, streamlet): (low, offsets, epoch)} from positions of any of `streams`."""
    by_stream: dict[str, list] = {}
    for p in positions:
        p = Position(*p)
        if p.stream not in streams:
            raise BadRequest(f"position {p} is not in a stream this consumer reads "
                             f"({sorted(streams)})")
        by_stream.setdefault(p.stream, []).append(p)
    return {(stream, sl): c for stream, ps in by_stream.items()
            for sl, c in cursors_with_epochs(ps, stream).items()}


def _time_targets(times) -> dict[tuple, int]:
    """offsets_for_times' {(stream, streamlet): timestamp_ms}, checked."""
    if not isinstance(times, dict):
        raise BadRequest(f"offsets_for_times takes a dict {{(stream, streamlet): timestamp_ms}}, "
                         f"not {type(times).__name__}")
    out = {}
    for part, ms in times.items():
        if not (isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], str)
                and isinstance(part[1], int) and part[1] >= 0):
            raise BadRequest(f"offsets_for_times key {part!r} is not (stream, streamlet)")
        out[part] = ms
    return out


def _assigned(total: int, streamlets, member, members) -> list[int]:
    if streamlets is not None and (member is not None or members is not None):
        raise BadRequest("give either streamlets or member/members, not both")
    if streamlets is not None:
        chosen = sorted(set(int(s) for s in streamlets))
        bad = [s for s in chosen if not 0 <= s < total]
        if bad:
            raise BadRequest(f"stream has {total} streamlets; no streamlet {bad[0]}")
        return chosen
    if member is not None or members is not None:
        if member is None or members is None or members < 1 or not 0 <= member < members:
            raise BadRequest(f"member must be in [0, members): member={member}, members={members}")
        return [sl for sl in range(total) if sl % members == member]
    return list(range(total))


def _note_pattern(pattern: NamePattern, meta) -> None:
    """Log when `pattern` matches no stream now: a typo would otherwise read nothing, silently."""
    header = meta.call("list_streams", {})[0]
    if header.get("next") is not None:
        return   # more than one page of streams: a hint is not worth listing them all
    names = [s["name"] for s in header.get("streams", [])]
    if not pattern.select(names):
        log.warning("pattern %r matches none of the %d streams now (patterns are regular "
                    "expressions matching the whole name, as Kafka's: 'logs-.*', not 'logs-*'); "
                    "streams created later that match are read when they appear",
                    pattern.text, len(names))


def _log_commit_failure(future) -> None:
    """An asynchronous commit's outcome: a failure is logged (the caller did not wait)."""
    err = future.exception()
    if err is not None:
        log.warning("asynchronous commit failed: %s", err)


def position_after(record: Record, held: list[Position]) -> list[Position]:
    """The position just after `record` (its group, the next offset) in the streamlet history
    of `held`, the consumer's positions there. With one active group per streamlet the groups
    below are finished once one of its records was read."""
    return [Position(record.stream, record.streamlet, record.group, record.offset + 1,
                     held[0].epoch if held else None)]
