"""The kera data source for Spark's Python Data Source API (pyspark >= 4.0).

    kera.spark.register(spark)
    spark.read.format("kera").option("bootstrap", "127.0.0.1:7000").option("stream", "clicks").load()

Schema (as Spark's Kafka source): key binary, value binary, stream string, streamlet int,
group int, offset long, timestamp timestamp, headers, and number long (the record number,
dense within the record's slot of its streamlet; null for data written before record numbers).

Planning (offsets, partitions) runs on the driver and talks to the coordinator and brokers;
`read` runs in executors and opens its own connections: nothing holding a socket is pickled.
One input partition per group with records in range (kera.spark.fetch.GroupRange), optionally
split further by `minPartitions`.
"""

from __future__ import annotations

import logging

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader

from kera.codec.name_pattern import NamePattern
from kera.errors import UnknownStream
from kera.spark import offsets as ko
from kera.spark.columns import SCHEMA_DDL
from kera.spark.fetch import GroupRange, read_group
from kera.spark.metadata import Metadata, StreamInfo
from kera.spark.options import Options

try:  # pyspark >= 4.2: admission control and Trigger.AvailableNow
    from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxRows,
                                                  SupportsTriggerAvailableNow)
except ImportError:  # pragma: no cover - older pyspark: maxOffsetsPerTrigger applied here
    ReadAllAvailable = ReadMaxRows = None

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass

log = logging.getLogger(__name__)


class KeraDataSource(DataSource):
    """Format "kera": batch and streaming source and sink. Options: see kera/spark/README.md."""

    @classmethod
    def name(cls) -> str:
        return "kera"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema) -> "KeraBatchReader":
        return KeraBatchReader(Options.parse(self.options))

    def streamReader(self, schema) -> "KeraStreamReader":
        return KeraStreamReader(Options.parse(self.options))

    def writer(self, schema, overwrite: bool):
        from kera.spark.sink import KeraBatchWriter
        if overwrite:
            raise ValueError("a kera stream is append-only: use mode('append')")
        return KeraBatchWriter(Options.parse(self.options), schema)

    def streamWriter(self, schema, overwrite: bool):
        # overwrite is Spark's "complete" output mode: as Spark's Kafka sink does, append the
        # whole result table at every trigger (Spark offers Python sinks no "update" mode).
        from kera.spark.sink import KeraStreamWriter
        return KeraStreamWriter(Options.parse(self.options), schema)


# --------------------------------------------------------------------------- planning helpers

class _Planner:
    """Driver-side view of the cluster for one query: descriptors and group offsets."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.meta = Metadata(opts.bootstrap, opts.timeout_s, opts.key_file)

    def snapshot(self, stream: str) -> tuple[StreamInfo, dict[int, list[ko.GroupInfo]]]:
        info = self.meta.describe(stream)
        groups = {}
        for sl in range(info.streamlets):
            info, groups[sl] = self.meta.groups(info, sl)
        return info, groups

    def cursor(self, boundary, info: StreamInfo, sl: int, infos: list[ko.GroupInfo]) -> ko.Cursor:
        """Where streamlet `sl` starts (or ends) under a parsed boundary; a time is resolved by
        the streamlet's broker."""
        spec = ko.spec_of(boundary, sl)
        if isinstance(spec, ko.AtTime):
            return self.meta.cursor_at_time(info, sl, spec.timestamp_us)
        return ko.resolve(boundary, sl, infos)

    def data_loss(self, problems: list[str]) -> None:
        if not problems:
            return
        message = "; ".join(problems)
        if self.opts.fail_on_data_loss:
            raise ko.DataLoss(message + " (set failOnDataLoss=false to skip lost records)")
        log.warning("skipping lost records: %s", message)

    def partitions(self, stream: str, info: StreamInfo, sl: int, start: ko.Cursor, end: ko.Cursor,
                   infos: list[ko.GroupInfo] | None) -> list[GroupRange]:
        o = self.opts
        return [GroupRange(o.bootstrap, stream, info.id, sl, g, s, e, info.owner(sl),
                           o.fetch_max_bytes, o.timeout_s, o.fail_on_data_loss, o.key_file)
                for g, s, e in ko.plan(start, end, infos)]

    def close(self) -> None:
        self.meta.close()


def resolve_streams(opts: Options) -> tuple[str, ...]:
    """The streams to read: option 'stream', or those whose whole name matches option
    'subscribePattern' when the query starts (Kafka's matches(); a stream created later is not
    picked up until the query is restarted)."""
    if opts.pattern is None:
        return opts.need_streams()
    from kera.client.admin import Admin
    admin = Admin(opts.bootstrap, timeout_s=opts.timeout_s, key_file=opts.key_file)
    try:
        names = sorted(s["name"] for s in admin.list_streams())
    finally:
        admin.close()
    matched = tuple(NamePattern(opts.pattern).select(names))
    if not matched:
        raise UnknownStream(f"no stream on {opts.bootstrap} matches subscribePattern "
                            f"{opts.pattern!r} (streams: {', '.join(names) or 'none'})")
    return matched


def starting_boundary(opts: Options, streams: tuple[str, ...], default: int) -> dict:
    """startingOffsets (or the mode's `default`) with startingTimestamp or
    startingOffsetsByTimestamp laid over it: a streamlet given no time starts as
    startingOffsets says."""
    spec = opts.starting or ("earliest" if default == ko.EARLIEST else "latest")
    return _with_times(ko.parse_boundary(spec, list(streams), default), streams, "starting",
                       opts.starting_timestamp_us, opts.starting_by_timestamp)


def ending_boundary(opts: Options, streams: tuple[str, ...]) -> dict:
    """endingOffsets (default latest) with endingTimestamp or endingOffsetsByTimestamp laid
    over it: a streamlet given a time ends before its first record at or after it."""
    boundary = ko.parse_boundary(opts.ending or "latest", list(streams), ko.LATEST)
    return _with_times(boundary, streams, "ending", opts.ending_timestamp_us,
                       opts.ending_by_timestamp)


def _with_times(boundary: dict, streams: tuple[str, ...], which: str, every_us: int | None,
                times: dict | None) -> dict:
    if every_us is not None:
        return ko.with_times(boundary, {s: {"*": every_us} for s in streams})
    times = times or {}
    unknown = sorted(set(times) - set(streams))
    if unknown:
        raise ValueError(f"option '{which}OffsetsByTimestamp' names streams {unknown} that this "
                         f"query does not read ({', '.join(streams)})")
    return ko.with_times(boundary, times)


def split(parts: list[GroupRange], min_partitions: int | None) -> list[GroupRange]:
    """Cut the largest ranges until there are at least `min_partitions` (for parallelism when
    a stream has fewer groups than Spark has cores). Deterministic."""
    if not min_partitions or len(parts) >= min_partitions:
        return parts
    total = sum(len(p) for p in parts)
    if total == 0:
        return parts
    out = []
    for p in parts:
        pieces = max(1, min(len(p), round(min_partitions * len(p) / total)))
        bounds = [p.start + (len(p) * i) // pieces for i in range(pieces + 1)]
        for a, b in zip(bounds, bounds[1:]):
            out.append(GroupRange(p.bootstrap, p.stream, p.stream_id, p.streamlet, p.group, a, b,
                                  p.address, p.fetch_max_bytes, p.timeout_s, p.fail_on_data_loss,
                                  p.key_file))
    return out


# --------------------------------------------------------------------------- batch

class KeraBatchReader(DataSourceReader):
    def __init__(self, opts: Options):
        self.opts = opts
        self.streams = resolve_streams(opts)
        if opts.max_offsets_per_trigger is not None:
            log.warning("maxOffsetsPerTrigger applies to streaming queries only; ignored")
        if opts.group is not None:
            log.warning("option 'group' applies to streaming queries only; ignored")
        self.starting = starting_boundary(opts, self.streams, ko.EARLIEST)
        self.ending = ending_boundary(opts, self.streams)

    def partitions(self):
        planner = _Planner(self.opts)
        try:
            parts = []
            for stream in self.streams:
                info, groups = planner.snapshot(stream)
                for sl, infos in groups.items():
                    start = planner.cursor(self.starting[stream], info, sl, infos)
                    cap = planner.cursor(self.ending[stream], info, sl, infos)
                    planner.data_loss(ko.check_loss(start, infos, f"{stream}/{sl}"))
                    end = ko.advance(start, infos, cap=cap)
                    parts += planner.partitions(stream, info, sl, start, end, infos)
            return split(parts, self.opts.min_partitions)
        finally:
            planner.close()

    def read(self, partition):
        return read_group(partition)


# --------------------------------------------------------------------------- streaming

class KeraStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch source. Offsets: kera.spark.offsets (exact, resumable from the checkpoint)."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.streams = resolve_streams(opts)
        if opts.ending is not None or opts.ending_timestamp_us is not None \
                or opts.ending_by_timestamp is not None:
            raise ValueError("endingOffsets, endingTimestamp and endingOffsetsByTimestamp apply "
                             "to batch queries only")
        self.starting = starting_boundary(opts, self.streams, ko.LATEST)
        self._planner: _Planner | None = None
        self._target: dict | None = None  # Trigger.AvailableNow: {stream: {sl: Cursor}}
        self._last: dict | None = None    # for pyspark < 4.2, which calls latestOffset()
        self._progress = None             # option `group`: kera.spark.progress
        if opts.group is not None:
            from kera.spark.progress import ProgressCommits
            self._progress = ProgressCommits(opts.bootstrap, opts.group, opts.timeout_s,
                                             opts.key_file)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_planner"] = None  # sockets stay where they were opened
        return state

    @property
    def planner(self) -> _Planner:
        if self._planner is None:
            self._planner = _Planner(self.opts)
        return self._planner

    def initialOffset(self) -> dict:
        out = {}
        for stream in self.streams:
            info, groups = self.planner.snapshot(stream)
            out[stream] = ko.StreamOffset(info.id, {
                sl: self.planner.cursor(self.starting[stream], info, sl, infos)
                for sl, infos in groups.items()})
        self._last = ko.to_json(out)
        return self._last

    def getDefaultReadLimit(self):
        if self.opts.max_offsets_per_trigger is not None:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {}
        for stream in self.streams:
            _, groups = self.planner.snapshot(stream)
            self._target[stream] = {sl: ko.latest(infos) for sl, infos in groups.items()}

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        if start is None:  # pyspark < 4.2 calls latestOffset() without arguments
            start = self._last if self._last is not None else {}  # {}: every record from 0
            max_records = self.opts.max_offsets_per_trigger if self._last is not None else None
        else:
            max_records = getattr(limit, "max_rows", None)
            if self._progress is not None:   # `start`: the end of Spark's last committed batch
                self._progress.commit(start, self.planner.snapshot)
        begin = ko.from_json(start)
        plans = {}
        for stream in self.streams:
            info, groups = self.planner.snapshot(stream)
            cursors = self._start_cursors(stream, info, begin.get(stream), groups)
            target = (self._target or {}).get(stream, {})
            plans[stream] = (info, cursors, groups, target)
        budgets = self._budgets(plans, max_records)
        out = {}
        for stream, (info, cursors, groups, target) in plans.items():
            out[stream] = ko.StreamOffset(info.id, {
                sl: ko.advance(cursors[sl], groups[sl], cap=target.get(sl),
                               max_records=budgets.get((stream, sl)))
                for sl in groups})
        self._last = ko.to_json(out)
        return self._last

    def _start_cursors(self, stream: str, info: StreamInfo, begin: ko.StreamOffset | None,
                       groups: dict[int, list[ko.GroupInfo]]) -> dict[int, ko.Cursor]:
        if begin is None:  # a stream added to the query: read it from the start
            return {sl: ko.Cursor() for sl in groups}
        if begin.stream_id is not None and begin.stream_id != info.id:
            self.planner.data_loss([f"stream {stream!r} was recreated (id {begin.stream_id} -> {info.id})"])
            return {sl: ko.Cursor() for sl in groups}
        cursors = {}
        for sl, infos in groups.items():
            cursor = begin.cursors.get(sl, ko.Cursor())
            lost = ko.epoch_lost(cursor, infos)
            if lost is not None:   # failOnDataLoss=false: restart from its earliest record
                self.planner.data_loss([f"{stream}/{sl}: {lost}"])
                cursor = ko.earliest(infos)
            self.planner.data_loss(ko.check_loss(cursor, infos, f"{stream}/{sl}"))
            cursors[sl] = cursor
        return cursors

    def _budgets(self, plans: dict, max_records: int | None) -> dict:
        """Share a micro-batch's record budget among streamlets in proportion to their backlog."""
        if max_records is None:
            return {}
        avail = {}
        for stream, (info, cursors, groups, target) in plans.items():
            for sl, infos in groups.items():
                end = ko.advance(cursors[sl], infos, cap=target.get(sl))
                avail[(stream, sl)] = ko.size(cursors[sl], end, infos)
        return ko.share(avail, max_records)

    def partitions(self, start: dict, end: dict):
        begin, finish = ko.from_json(start), ko.from_json(end)
        parts = []
        for stream, stop in finish.items():
            first = begin.get(stream)
            if first is not None and None not in (first.stream_id, stop.stream_id) \
                    and first.stream_id != stop.stream_id:
                first = None  # recreated stream (failOnDataLoss=false): read the new one from 0
            info = None
            for sl, e in stop.cursors.items():
                s = first.cursors.get(sl, ko.Cursor()) if first is not None else ko.Cursor()
                if None not in (s.epoch, e.epoch) and s.epoch != e.epoch:
                    s = ko.Cursor()   # a new history (failOnDataLoss=false): read it from 0
                if not ko.plan(s, e):
                    continue
                if info is None:
                    info = self.planner.meta.describe(stream)
                parts += self.planner.partitions(stream, info, sl, s, e, None)
        return split(parts, self.opts.min_partitions)

    def read(self, partition):
        return read_group(partition)

    def commit(self, end: dict) -> None:
        # The checkpoint holds the positions; a `group` also gets them, for tools and lag.
        if self._progress is not None:
            self._progress.commit(end, self.planner.snapshot)

    def stop(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
