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

The Consumer is the public face; the work is its collaborators':
* kera.consumer.reading.Reading — the state shared with the request thread (fetch cursors,
  tasks, the cache) and moving parts in it (seek, assign, unassign);
* kera.consumer.cache.Cache — what was fetched, handed out by poll / poll_batch, and the exact
  positions of what was handed out;
* kera.consumer.fetcher.Fetcher — the request thread;
* kera.consumer.lookup.Lookup — questions to a part's broker (ends, times, numbers, lag);
* kera.consumer.group.GroupSide — commits, group metadata, leaving (with a group).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from kera import config
from kera.client.env import ClientEnv
from kera.client.kafka_config import CONSUMER_PROPERTIES, kera_arguments
from kera.client.metadata import Metadata
from kera.codec.name_pattern import NamePattern
from kera.codec.position import Position, Record
from kera.consumer import lag as lagmath
from kera.consumer.batch import Batch
from kera.consumer.cache import Cache
from kera.consumer.cursor import ConsumedCursor, ErrorItem, cursors_with_epochs
from kera.consumer.fetcher import Fetcher
from kera.consumer.fetching import FetchState
from kera.consumer.group import GroupSide, needs_group, position_after
from kera.consumer.lookup import EARLIEST_CURSOR, Lookup
from kera.consumer.membership import GroupMetadata, Membership, subscription
from kera.consumer.reading import Reading
from kera.consumer.tasks import TaskRunner
from kera.errors import BadRequest, ClientClosed

log = logging.getLogger(__name__)
# What a consumer does with a position into a history its streamlet no longer has (its data
# was lost: an R=1 broker restarted without it), like Kafka's auto.offset.reset: "raise" raises
# PositionLost from poll; "earliest" restarts the streamlet at its first record, "latest" at its
# end (both log a warning). Raising is the default, unlike Kafka's "latest": kera promises not
# to lose acknowledged records, so a loss is an event the application must hear of and decide
# on, never something a reader skips past. The position is never reinterpreted in the new
# history (that would silently skip the records produced after the loss).
LOST_POSITION_POLICIES = ("raise", "earliest", "latest")

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

    _membership = None   # the group membership (kera.consumer.membership), None without a group
    _group: GroupSide | None = None   # its caller side (kera.consumer.group), None without a group

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
            self._lookup = Lookup(self._meta, self._infos, request_timeout_s=request_timeout_s,
                                  key_file=key_file)
            parts = [] if group is not None else [
                (name, sl) for name, info in self._infos.items()
                for sl in _assigned(info.streamlets, streamlets, member, members)]
            starts = _start_cursors(start, parts, self.streams, self._lookup)
        except BaseException:
            self._meta.close()
            raise
        self._open_reading(fetch_max_bytes, fetch_wait_ms, fetch_max_wait_ms, on_lost_position)
        self._reading.restart(starts)
        self._fetcher = Fetcher(self.stream or "streams", self._reading, self._meta, self._waker,
                                request_timeout_s=request_timeout_s, key_file=key_file,
                                env=self._env, on_grow=self._grow)
        self._fetcher.start_engine()
        if group is not None:
            self._join(group, group_instance_id, session_timeout_ms, auto_commit_interval_ms,
                       pattern)

    def _open_metadata(self, bootstrap: str, env: ClientEnv | None, max_age_ms: int) -> None:
        self._env = env or ClientEnv()   # clock, connections, wake-ups, thread (kera.client.env)
        self._meta = Metadata(bootstrap, timeout_s=self.request_timeout_s, key_file=self.key_file,
                              max_age_s=max_age_ms / 1000)
        if self._env.prime is not None:
            self._env.prime(self._meta)

    def _open_reading(self, fetch_max_bytes: int, fetch_wait_ms: float, fetch_max_wait_ms: int,
                      on_lost_position: str) -> None:
        """The state shared with the request thread (kera.consumer.reading)."""
        self._waker = self._env.waker()
        fetch = FetchState({name: info.id for name, info in self._infos.items()}, {},
                           fetch_max_bytes=fetch_max_bytes,
                           request_timeout_s=self.request_timeout_s,
                           idle_wait_s=fetch_wait_ms / 1000, on_lost_position=on_lost_position,
                           max_wait_ms=int(fetch_max_wait_ms))
        self._cache = Cache(self.cache_chunks_max, self._wake)
        self._reading = Reading(fetch, TaskRunner(self.request_timeout_s), self._cache,
                                self.isolation_level)
        self._fetch = fetch   # the fetch bookkeeping, as the simulation (tests/sim) inspects it

    # ------------------------------------------------------------------ single-stream view
    @property
    def info(self):
        """The stream descriptor of a single-stream consumer (its first stream's otherwise)."""
        return self._infos[self.streams[0]]

    @property
    def streamlets(self) -> list[int]:
        """The streamlets read of a single-stream consumer's stream (its first stream's)."""
        return [sl for st, sl in self._cache.parts() if st == self.streams[0]]

    # ------------------------------------------------------------------ reading
    def poll(self, timeout_s: float | None = None) -> Record | None:
        """The next record, waiting up to `timeout_s` (None: forever); None on timeout."""
        return self._cache.poll(None if timeout_s is None else time.monotonic() + timeout_s)

    def poll_batch(self, timeout_s: float | None = 0.0, max_chunks: int | None = None) -> list[Batch]:
        """Whole chunks as columnar Batches (at least one unless `timeout_s` passes first)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self._cache.poll_batch(deadline, self.cache_chunks_max if max_chunks is None
                                      else max(1, max_chunks))

    def __iter__(self):
        while not self._cache.closed:
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
        return self._cache.positions(parts)

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
            starts = self._lookup.named([(stream, streamlet)], position)
        else:
            given = [position] if isinstance(position, Position) else list(position)
            targets = _cursors_by_part(given, {stream})
            if set(targets) - {(stream, streamlet)}:
                raise BadRequest(f"positions {given} are not all of stream '{stream}' "
                                 f"streamlet {streamlet}")
            starts = {part: (*c, False) for part, c in targets.items()}
        self._reading.check_assigned(starts)
        self._restart(starts)

    def seek_to_beginning(self, parts=None) -> None:
        """Read each of `parts` (default: every assigned part) from its first retained record."""
        self._seek_named(parts, "earliest")

    def seek_to_end(self, parts=None) -> None:
        """Read each of `parts` (default: every assigned part) from its durable end: only
        records produced from now on (asks each part's broker, as start="latest" does)."""
        self._seek_named(parts, "latest")

    def _seek_named(self, parts, where: str) -> None:
        parts = self.assignment() if parts is None else [tuple(p) for p in parts]
        starts = self._lookup.named(parts, where)
        self._reading.check_assigned(starts)
        self._restart(starts)

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
            times = {(stream, sl): timestamp_ms
                     for sl in range(self._lookup.info(stream).streamlets)}
        targets = _time_targets(times)
        for name, sl in targets:
            if sl >= self._lookup.info(name).streamlets:
                raise BadRequest(f"stream '{name}' has streamlets 0..{self._infos[name].streamlets - 1}, "
                                 f"not {sl}")
        return _positions_of(self._lookup.at_times(targets))

    def seek_to_time(self, timestamp_ms: int, parts=None) -> None:
        """Read each of `parts` (default: every assigned part, a group member's included) from
        its first record whose timestamp is at or after `timestamp_ms` (see offsets_for_times)."""
        parts = self.assignment() if parts is None else [tuple(p) for p in parts]
        self._reading.check_assigned(parts)
        self._restart(self._lookup.at_times({part: timestamp_ms for part in parts}))

    def offsets_for_number(self, stream: str, streamlet: int, number: int) -> list[Position]:
        """Positions of the record numbered `number` in `streamlet` (record numbers are dense
        per streamlet in a stream with one active group per streamlet): reading from them gets
        that record and the ones after it. A Waltz-style service that applied everything up to
        its high-water mark N reads on from number N + 1. A number retention deleted gives the
        first retained record; one not written yet gives the end. Any stream may be asked."""
        if not 0 <= streamlet < self._lookup.info(stream).streamlets:
            raise BadRequest(f"stream '{stream}' has streamlets 0..{self._infos[stream].streamlets - 1}, "
                             f"not {streamlet}")
        part = (stream, streamlet)
        return _positions_of({part: self._lookup.at_number(part, number)})

    def seek_to_number(self, stream: str, streamlet: int, number: int) -> None:
        """Read `streamlet` of `stream` (assigned to this consumer) from the record numbered
        `number` on (see offsets_for_number); takes effect on the next poll."""
        part = (stream, streamlet)
        self._reading.check_assigned([part])
        self._restart({part: self._lookup.at_number(part, number)})

    def number_span(self, stream: str, streamlet: int) -> tuple[int, int]:
        """(first retained, durable end) record numbers of a streamlet with one active group
        per streamlet (a Kafka partition's log start offset and high watermark)."""
        self._lookup.info(stream)
        return self._lookup.number_span((stream, streamlet))

    def _restart(self, starts: dict) -> None:
        """Read each part from its start on, from the next poll (kera.consumer.reading)."""
        self._reading.restart(starts)
        self._wake()

    # ------------------------------------------------------------------ spans and lag
    def watermarks(self, stream: str, streamlet: int) -> tuple[int, int]:
        """(low, high) in records of a streamlet, counted over its retained groups (records
        deleted by retention are not counted: low is 0); asks its broker (`offsets`)."""
        self._lookup.info(stream)
        groups, _first, _epoch = self._lookup.groups((stream, streamlet))
        return lagmath.watermarks(groups)

    def lag(self) -> dict[tuple[str, int], int]:
        """{(stream, streamlet): durable records not yet handed to the application}, for every
        assigned part (one `offsets` request per part to its broker)."""
        return {part: lag.records for part, lag in self.lag_detail().items()}

    def lag_detail(self) -> dict[tuple[str, int], lagmath.Lag]:
        """{(stream, streamlet): Lag(records, bytes)} not yet handed to the application, for
        every assigned part: `lag()` with the bytes too, at the same cost."""
        return self._lookup.lag(self._cache.consumed_at())

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
        return self._lookup.lag(at)

    # ------------------------------------------------------------------ assignment (issue 11)
    def assignment(self) -> list[tuple[str, int]]:
        """The (stream, streamlet) parts this consumer reads, sorted."""
        return self._cache.parts()

    def assign(self, parts, positions=None) -> None:
        """Start reading `parts` ((stream, streamlet) pairs, of any stream), each from its
        position in `positions` (e.g. a group's committed ones) else from this consumer's
        `start` ("earliest" unless "latest" was given). Parts already read are repositioned
        only when `positions` names them. Then calls `on_assigned(parts)`."""
        parts = [(str(st), int(sl)) for st, sl in parts]
        for stream in dict.fromkeys(st for st, _ in parts):
            self._add_stream(stream)
        for stream, sl in parts:
            self._lookup.check_streamlet(stream, sl)
        given = _cursors_by_part(list(positions or []), {st for st, _ in parts})
        missing = set(self._cache.missing(parts))
        fresh = [p for p in parts if p in missing and p not in given]
        starts = self._lookup.named(fresh, self._default_start)
        starts.update({p: (*c, False) for p, c in given.items() if p in set(parts)})
        self._restart(starts)
        if self.on_assigned is not None:
            self.on_assigned(parts)

    def unassign(self, parts) -> list[Position]:
        """Stop reading `parts`; returns their exact positions (what was handed out of them).
        Calls `on_revoked(parts)` first. Their records fetched and not handed out are dropped."""
        parts = [(str(st), int(sl)) for st, sl in parts]
        if self.on_revoked is not None:
            self.on_revoked(parts)
        return self._reading.remove(parts)

    def subscribe(self, streams) -> None:
        """Read `streams` from now on instead (confluent-kafka's subscribe: a name or a list;
        with a group, entries starting with "^" are patterns). A group member asks its group
        for them and the group rebalances (kera.consumer.membership); without a group, parts
        of streams no longer named are dropped and each new stream is read whole (or this
        `member`'s share), from `start`."""
        names, pattern = subscription(streams)
        if self._membership is not None:
            with self._reading.lock:
                self.streams = list(names)
                self._membership.subscribe(names, pattern, self._env.clock())
            self._wake()
            return
        if pattern is not None:
            raise needs_group("a pattern subscription")
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
            with self._reading.lock:
                self._membership.unsubscribe(self._env.clock())
                self.streams = []
            self._wake()
            return
        self.unassign(self.assignment())
        self.streams = []

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
        self._reading.restart({part: EARLIEST_CURSOR for part in new})

    def _add_stream(self, stream: str) -> None:
        info = self._infos.get(stream) or self._meta.stream(stream)
        with self._reading.lock:
            self._infos[stream] = info
            self._fetch.stream_ids[stream] = info.id
            if stream not in self.streams:
                self.streams.append(stream)

    # ------------------------------------------------------------------ groups (issue 11)
    def _join(self, group, instance_id, session_timeout_ms, auto_commit_interval_ms,
              pattern) -> None:
        self._membership = Membership(
            self, self._meta.coordinators, group, list(self.streams), time.monotonic(),
            instance_id=instance_id, pattern=pattern, session_timeout_ms=session_timeout_ms,
            auto_commit_interval_ms=auto_commit_interval_ms,
            on_fatal=lambda err: self._cache.push([ErrorItem(err)]))
        self._group = GroupSide(group, self._membership, self._reading, self._meta, self._wake,
                                self.request_timeout_s)
        self._cache.on_chunk = self._group.note_polled
        self.add_task(self._membership)

    def commit(self, positions=None, timeout_s: float | None = None, *,
               message: Record | None = None, asynchronous: bool = False) -> None:
        """Save positions in the group: `positions` (a list of Position), or the position just
        after `message` in its streamlet (confluent-kafka's commit(message=)), or those of
        everything handed to the application so far. Waits for the answer, raising
        StaleMemberEpoch for parts this consumer no longer holds and UnknownMember once the
        group dropped it; `asynchronous=True` returns at once (a failed commit is logged, and
        the next commit carries the positions again)."""
        if self._group is None:
            raise needs_group("commit()")
        if message is not None and positions is not None:
            raise BadRequest("commit() takes positions or message, not both")
        if message is not None:
            if self._lookup.info(message.stream).active_groups != 1:
                raise BadRequest(f"commit(message=) needs one active group per streamlet; "
                                 f"'{message.stream}' has several: commit(positions) instead")
            held = position_after(message, self.positions([(message.stream, message.streamlet)]))
        else:
            held = self.positions() if positions is None else list(positions)
        self._group.commit(held, timeout_s, asynchronous)

    def group_metadata(self) -> GroupMetadata:
        """This member's group, member id and epoch, for a transactional producer's
        send_positions_to_transaction (the coordinator then refuses positions from a member
        a rebalance has fenced), as of the last chunk handed out (kera.consumer.group)."""
        if self._group is None:
            raise needs_group("group_metadata()")
        return self._group.metadata()

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
        if self._group is None:
            raise needs_group("committed()")
        return self._group.committed(parts)

    def add_task(self, task) -> None:
        """Have the request thread drive `task` (kera.consumer.tasks: next_request / on_reply /
        on_error / next_wake) on the consumer's connections: the hook for group membership.
        Call `wakeup()` when something outside makes the task want to send sooner."""
        self._reading.add_task(task)
        self._wake()

    def wakeup(self) -> None:
        """Have the request thread look at its fetches and tasks again now."""
        self._wake()

    def _wake(self) -> None:
        waker = getattr(self, "_waker", None)
        if waker is not None:
            waker.wake()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._cache.closed:
            return
        self._cache.close()
        self._wake()
        self._fetcher.join(self.request_timeout_s + 5)
        if self._group is not None:
            self._group.leave()
        self._meta.close()
        with self._cache.lock:
            self._waker.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stats(self) -> dict:
        return self._cache.stats()

    @property
    def records_consumed(self) -> int:
        """Records handed to the application so far."""
        return self._cache.records_consumed


def _start_cursors(start, parts: list[tuple], streams: list[str], lookup: Lookup) -> dict[tuple, tuple]:
    """{part: (low, offsets, epoch, earliest)} where each part starts."""
    if isinstance(start, str):
        if start not in NAMED_STARTS:
            raise BadRequest(f"start must be 'earliest', 'latest' or a list of positions, "
                             f"not {start!r}")
        return lookup.named(parts, start)
    given = _cursors_by_part(list(start), set(streams))
    unknown = sorted(part for part, (low, offsets, epoch) in given.items()
                     if epoch is None and (low, offsets) != (0, {0: 0}))
    if unknown:
        log.warning("positions of %s carry no epoch (saved by an older kera): resumed "
                    "unchecked, a loss of their data since cannot be detected; save "
                    "positions() again to get checked ones", unknown)
    # Parts without a saved position start at the beginning.
    return {part: (*given[part], False) if part in given else EARLIEST_CURSOR for part in parts}


def _positions_of(cursors: dict[tuple, tuple]) -> list[Position]:
    """The positions of {part: (low, offsets, epoch, earliest)}, in part order."""
    return [p for part, (low, offsets, epoch, _) in sorted(cursors.items())
            for p in ConsumedCursor(part[1], low, offsets, epoch).positions(part[0])]


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
