"""The consumer's questions to a part's owning broker, asked from the caller's thread: where a
part starts or ends, where a time or a record number is, how far a reader lags behind.

Each answer comes from one request (`offsets`, `offsets_for_time`, `offsets_for_number`,
`numbers`) to the broker owning the part, retried through metadata refreshes until the request
timeout. Questions about many parts share one connection per broker (`_connections`). Cursors
are `(low, offsets, epoch, earliest)` tuples, as kera.consumer.reading.Reading.restart takes.
The stream descriptors (`infos`) are the consumer's own dict, shared.
"""

from __future__ import annotations

import contextlib
import time

from kera.codec import schema
from kera.codec.timestamps import ms_to_us
from kera.consumer import lag as lagmath
from kera.consumer.cursor import FetchCursor, parse_groups
from kera.errors import BadRequest, KeraError, Timeout
from kera.net import rpc

# The pause between attempts of one question while its part has no live owner or the owner
# refuses it retriably (a failover takes a few): short, the request timeout bounds the total.
RETRY_PAUSE_S = 0.05
# A part "from its beginning": from its first retained group.
EARLIEST_CURSOR = (0, {}, None, True)


class Lookup:
    def __init__(self, meta, infos: dict, *, request_timeout_s: float, key_file: str | None):
        self.meta = meta             # kera.client.metadata.Metadata
        self.infos = infos           # stream name -> StreamInfo, shared with the consumer
        self.request_timeout_s = request_timeout_s
        self.key_file = key_file

    def info(self, stream: str):
        """The descriptor of `stream`, read by this consumer or not (fetched once)."""
        if stream not in self.infos:
            self.infos[stream] = self.meta.stream(stream)
        return self.infos[stream]

    def check_streamlet(self, stream: str, sl: int) -> None:
        """Refuse a streamlet `stream` does not have (asking again first if it may have grown)."""
        if sl >= self.info(stream).streamlets:   # raised since we asked: ask again
            self.infos[stream] = self.meta.refresh(stream)
        if not 0 <= sl < self.infos[stream].streamlets:
            raise BadRequest(f"stream '{stream}' has {self.infos[stream].streamlets} "
                             f"streamlets; no streamlet {sl}")

    # ------------------------------------------------------------------ cursors
    def named(self, parts, where: str) -> dict[tuple, tuple]:
        """{part: cursor} at "earliest" or "latest" of each part."""
        with _connections() as conns:
            return {part: self._named(part, where, conns) for part in parts}

    def _named(self, part: tuple, where: str, conns: dict | None = None) -> tuple:
        # A part starting from its beginning starts from its first retained group.
        return EARLIEST_CURSOR if where == "earliest" else (*self._latest(part, conns), False)

    def _latest(self, part: tuple, conns: dict | None) -> tuple[int, dict[int, int], int | None]:
        """Each group's durable end."""
        groups, first, epoch = self.groups(part, conns)
        cursor = FetchCursor.at_end(part[1], groups, first)
        return cursor.low, cursor.offsets, epoch

    def at_times(self, times: dict) -> dict[tuple, tuple]:
        """{part: cursor} at each part's time {part: timestamp_ms} (`offsets_for_time`)."""
        targets = {part: ms_to_us(ms) for part, ms in times.items()}   # refused before any call
        with _connections() as conns:
            return {part: self._cursor(part, "offsets_for_time", {"timestamp_us": us}, conns)
                    for part, us in targets.items()}

    def at_number(self, part: tuple, number: int) -> tuple:
        """The cursor at the record numbered `number` of `part` (`offsets_for_number`)."""
        if not 0 <= number <= schema.NUMBER_MAX:
            raise BadRequest(f"record number {number} is outside 0..{schema.NUMBER_MAX}")
        with _connections() as conns:
            return self._cursor(part, "offsets_for_number", {"number": number}, conns)

    def _cursor(self, part: tuple, op: str, fields: dict, conns: dict) -> tuple:
        """The cursor a broker's `op` answers for `part`."""
        header, address = self.call(part, op, fields, conns)
        try:
            c = schema.time_cursor(header)
        except BadRequest as err:
            raise KeraError(f"malformed {op} reply from {address}: {err.message}",
                            retriable=True) from None
        # From the first retained group on: read from the first retained group, even if
        # retention deletes that one before the first fetch.
        return c.low, c.offsets, c.epoch, c.low <= c.first_group

    # ------------------------------------------------------------------ spans and lag
    def groups(self, part: tuple, conns: dict | None = None) -> tuple[list, int, int | None]:
        """(groups, first_group, epoch) of a part, from its owning broker's `offsets`."""
        header, address = self.call(part, "offsets", {}, conns)
        return parse_offsets(header, address)

    def number_span(self, part: tuple) -> tuple[int, int]:
        """(first retained, durable end) record numbers of a part (`numbers`)."""
        with _connections() as conns:
            header, address = self.call(part, "numbers", {}, conns)
        start, end = header.get("start"), header.get("end")
        if not (type(start) is int and type(end) is int and 0 <= start <= end):
            raise KeraError(f"malformed numbers reply from {address}", retriable=True)
        return start, end

    def lag(self, consumed: dict) -> dict[tuple[str, int], lagmath.Lag]:
        """{part: Lag} of readers at {part: (low, offsets)}."""
        out = {}
        with _connections() as conns:
            for part, (low, offsets) in sorted(consumed.items()):
                at = {"low": low, "offsets": offsets}
                header, address = self.call(part, "offsets", {"at": at}, conns)
                groups, _first, _epoch = parse_offsets(header, address)
                out[part] = lagmath.Lag(lagmath.lag_records(groups, low, offsets),
                                        _behind_bytes(header, address))
        return out

    # ------------------------------------------------------------------ the call
    def call(self, part: tuple, op: str, extra: dict,
             conns: dict | None = None) -> tuple[dict, str]:
        """(reply, broker address) of `op` (fields `sid`, `sl` and `extra`) on the broker owning
        a part, retried through metadata refreshes until the request timeout. `conns` (address
        -> rpc.Connection, the caller closes them): connections to reuse (else one per call)."""
        stream, sl = part
        deadline = time.monotonic() + self.request_timeout_s
        for _attempt in range(int(self.request_timeout_s / RETRY_PAUSE_S) + 1):
            try:
                return self._call_once(part, op, extra, conns, deadline)
            except KeraError as e:
                if not e.retriable:
                    raise
                err = e
            if time.monotonic() + RETRY_PAUSE_S >= deadline:
                break
            time.sleep(RETRY_PAUSE_S)
            self.infos[stream] = self.meta.refresh(stream)
        raise Timeout(f"{op} of '{stream}' streamlet {sl}: {err.message}")

    def _call_once(self, part: tuple, op: str, extra: dict, conns: dict | None,
                   deadline: float) -> tuple[dict, str]:
        stream, sl = part
        info = self.info(stream)
        address = info.address_of(sl)
        if address is None:
            raise KeraError(f"streamlet {sl} of '{stream}' has no live broker", retriable=True)
        fields = {"sid": info.id, "sl": sl, **extra}
        left_s = max(0.1, deadline - time.monotonic())
        if conns is None:
            header, _ = rpc.call(address, op, fields, timeout_s=left_s, key_file=self.key_file)
        else:
            conn = conns.get(address) or conns.setdefault(
                address, rpc.Connection(address, timeout_s=self.request_timeout_s,
                                        key_file=self.key_file))
            header, _ = conn.call(op, fields, timeout_s=left_s)
        return header, address


@contextlib.contextmanager
def _connections():
    """One connection per broker for a question about many parts, closed after it."""
    conns: dict = {}
    try:
        yield conns
    finally:
        for conn in conns.values():
            conn.close()


def parse_offsets(header: dict, address: str) -> tuple[list, int, int | None]:
    """(groups, first_group, epoch) of an `offsets` reply, checked."""
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
