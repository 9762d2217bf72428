"""The connector's options, parsed and checked once on the driver (names as in Spark's Kafka
source where one exists)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import json
import logging

from kera import config
from kera.codec.name_pattern import NamePattern
from kera.codec.partitioner import key_hash
from kera.errors import BadRequest
from kera.codec.timestamps import ms_to_us
from kera.coordinator.groups import GROUP_NAME_CHARS_MAX

log = logging.getLogger(__name__)
# The sink's smallest chunk: the producer needs room for a chunk header (64 bytes) and some
# records; smaller chunks would hold one row each anyway.
CHUNK_SIZE_BYTES_MIN = 256
SPARK_OPTIONS = {"path", "checkpointlocation", "queryname"}

OPTION_NAMES = (
    "bootstrap", "stream", "startingOffsets", "endingOffsets", "maxOffsetsPerTrigger",
    "failOnDataLoss", "minPartitions", "fetchMaxBytes", "timeoutMs", "chunkSizeBytes",
    "requestSizeBytes", "inFlightPerBroker", "bufferBytes", "writeId", "subscribePattern",
    "keyFile", "group", "startingTimestamp", "startingOffsetsByTimestamp", "endingTimestamp",
    "endingOffsetsByTimestamp", "partitioner")


@dataclass(frozen=True)
class Options:
    bootstrap: str
    streams: tuple[str, ...]
    starting: str | None = None           # None: the mode's default (batch earliest, streaming latest)
    ending: str | None = None             # batch only; None: latest
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    min_partitions: int | None = None
    fetch_max_bytes: int = config.DEFAULT_FETCH_MAX_BYTES
    timeout_s: float = 30.0               # per request, and for a reader waiting on no progress
    chunk_size_bytes: int = config.DEFAULT_CHUNK_SIZE_BYTES
    request_size_bytes: int = config.DEFAULT_REQUEST_SIZE_BYTES
    in_flight_per_broker: int = config.DEFAULT_IN_FLIGHT_PER_BROKER
    buffer_bytes: int = 32 * config.MiB   # chunks a write task holds unacknowledged
    write_id: str | None = None           # batch sink: pin the producer identity across job runs
    pattern: str | None = None            # source: read every stream whose whole name matches
    key_file: str | None = None           # CURVE key (kera.net.keys) on driver and executors
    group: str | None = None              # streaming source: commit progress to this group
    partitioner: str | None = None   # sink: key placement (kera.codec.partitioner); None: the stream's
    # Source: start at the first record at or after a time (µs; given in ms like Kafka's), for
    # every streamlet, or per stream and streamlet ({stream: {sl: µs}}); over startingOffsets.
    starting_timestamp_us: int | None = None
    starting_by_timestamp: dict | None = None
    # Batch source: end before the first record at or after a time, the same two ways; over
    # endingOffsets.
    ending_timestamp_us: int | None = None
    ending_by_timestamp: dict | None = None

    @staticmethod
    def parse(options: Mapping[str, str]) -> "Options":
        opts = {k.lower(): v for k, v in options.items()}
        # Spark hands sources and sinks some of its own options (checkpointLocation, path):
        # an unknown name is most likely a typo, worth a warning but not a failure.
        unknown = sorted(set(opts) - {n.lower() for n in OPTION_NAMES} - SPARK_OPTIONS)
        if unknown:
            log.warning("ignoring unknown kera option(s) %s; known: %s", unknown, ", ".join(OPTION_NAMES))
        bootstrap = opts.get("bootstrap", "").strip()
        if not bootstrap:
            raise ValueError("option 'bootstrap' (the coordinator's host:port) is required")
        streams = tuple(s.strip() for s in opts.get("stream", opts.get("path", "")).split(",") if s.strip())
        return _check_sink_sizes(Options(
            bootstrap=bootstrap,
            streams=streams,
            starting=opts.get("startingoffsets"),
            ending=opts.get("endingoffsets"),
            max_offsets_per_trigger=_int(opts, "maxOffsetsPerTrigger", None, lo=1),
            fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
            min_partitions=_int(opts, "minPartitions", None, lo=1),
            fetch_max_bytes=_int(opts, "fetchMaxBytes", config.DEFAULT_FETCH_MAX_BYTES, lo=1),
            timeout_s=_int(opts, "timeoutMs", 30_000, lo=1) / 1000.0,
            chunk_size_bytes=_int(opts, "chunkSizeBytes", config.DEFAULT_CHUNK_SIZE_BYTES, lo=CHUNK_SIZE_BYTES_MIN,
                                  hi=config.DEFAULT_MAX_RECORD_BYTES * 4),
            request_size_bytes=_int(opts, "requestSizeBytes", config.DEFAULT_REQUEST_SIZE_BYTES, lo=1),
            in_flight_per_broker=_int(opts, "inFlightPerBroker", config.DEFAULT_IN_FLIGHT_PER_BROKER, lo=1, hi=64),
            buffer_bytes=_int(opts, "bufferBytes", 32 * config.MiB, lo=1),
            write_id=opts.get("writeid"),
            pattern=_pattern(opts, streams),
            key_file=opts.get("keyfile"),
            group=_group(opts),
            partitioner=_partitioner(opts),
            **_times(opts, "starting"),
            **_times(opts, "ending"),
        ))

    def need_streams(self) -> tuple[str, ...]:
        if not self.streams:
            raise ValueError("option 'stream' is required (one stream name, or several separated by commas)")
        return self.streams


def _check_sink_sizes(opts: Options) -> Options:
    """A write task holds at least one whole chunk unacknowledged."""
    if opts.chunk_size_bytes > opts.buffer_bytes:
        raise ValueError(f"option 'chunkSizeBytes'={opts.chunk_size_bytes} exceeds option "
                         f"'bufferBytes'={opts.buffer_bytes}: lower the first or raise the second")
    return opts


def _partitioner(opts: Mapping[str, str]) -> str | None:
    name = opts.get("partitioner")
    if name is None:
        return None   # each stream's own (its descriptor's `partitioner`)
    try:
        key_hash(name)
    except BadRequest as bad:
        raise ValueError(f"option 'partitioner': {bad}") from None
    return name


def _pattern(opts: Mapping[str, str], streams: tuple[str, ...]) -> str | None:
    raw = opts.get("subscribepattern")
    if raw is None:
        return None
    if streams:
        raise ValueError("give option 'stream' or 'subscribePattern', not both")
    try:
        NamePattern(raw)
    except BadRequest as bad:
        raise ValueError(f"option 'subscribePattern': {bad}") from None
    return raw


def _times(opts: Mapping[str, str], which: str) -> dict:
    """{which}Timestamp (ms) / {which}OffsetsByTimestamp (JSON {"stream": {"0": ms}}), in µs,
    `which` being "starting" or "ending"."""
    one_name, per_name = f"{which}Timestamp", f"{which}OffsetsByTimestamp"
    one, per = opts.get(one_name.lower()), opts.get(per_name.lower())
    if one is not None and per is not None:
        raise ValueError(f"give option '{one_name}' or '{per_name}', not both")
    if one is not None:
        return {f"{which}_timestamp_us": _ms_option(one_name, one)}
    if per is None:
        return {}
    try:
        obj = json.loads(per)
    except json.JSONDecodeError as bad:
        raise ValueError(f"option '{per_name}' is not JSON: {bad}") from None
    shape = 'like {"clicks": {"0": 1767225600000, "1": 1767225600000}}'
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise ValueError(f"option '{per_name}' maps stream names to "
                         f"{{streamlet: timestamp_ms}}, {shape}")
    out = {}
    for stream, per_sl in obj.items():
        if not all(isinstance(sl, str) and sl.isdigit() for sl in per_sl):
            raise ValueError(f"option '{per_name}': stream {stream!r} has a "
                             f"streamlet key that is not a number, {shape}")
        out[stream] = {int(sl): _ms_option(per_name, ms) for sl, ms in per_sl.items()}
    return {f"{which}_by_timestamp": out}


def _ms_option(name: str, raw) -> int:
    """µs of a millisecond timestamp option (the range kera.codec.timestamps accepts)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, str)) or not str(raw).strip().isdigit():
        raise ValueError(f"option '{name}' takes milliseconds since the epoch, not {raw!r}")
    try:
        return ms_to_us(int(str(raw).strip()))
    except BadRequest as bad:
        raise ValueError(f"option '{name}': {bad.message}") from None


def _group(opts: Mapping[str, str]) -> str | None:
    raw = opts.get("group")
    if raw is None:
        return None
    if not 0 < len(raw.strip()) <= GROUP_NAME_CHARS_MAX:
        raise ValueError(f"option 'group' must be a group name of 1 to {GROUP_NAME_CHARS_MAX} "
                         f"characters, not {raw!r}")
    return raw.strip()


def _int(opts: Mapping[str, str], name: str, default, lo: int | None = None, hi: int | None = None):
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"option '{name}' must be an integer, not {raw!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"option '{name}'={value} is outside [{lo}, {hi}]")
    return value


def _bool(opts: Mapping[str, str], name: str, default: bool) -> bool:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    value = str(raw).strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"option '{name}' must be true or false, not {raw!r}")
    return value == "true"
