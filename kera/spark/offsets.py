"""Spark offsets for kera: exact, resumable positions as canonical JSON, and the planning of
which records of which groups a batch covers.

One stream's offset, as Spark stores it in the checkpoint::

    {"id": <stream id>, "streamlets": {"<sl>": {"next": N, "groups": {"<g>": offset, ...},
                                                "epoch": E}}}

`epoch` (absent while unknown, and in offsets written before epochs existed) is the epoch of
the streamlet history the cursor points into (kera.broker.history_epoch): a cursor of another
history than the streamlet's current one names records that were lost (`epoch_lost`).

and a source's offset maps stream names to that. Per streamlet (a `Cursor`):

- a group listed in `groups` is at that record offset (the next record to read);
- a group below `next` that is not listed is finished (closed and read to its end);
- a group at or above `next` was not seen yet: it is read from its first record.

So groups created later need no entry, finished groups drop out, and the JSON stays as small
as the number of groups still open. A group finished *in* a batch stays listed (at its final
offset) in that batch's end offset, so that planning a batch always has a numeric end for every
group it reads, even after a restart from the checkpoint; the next batch drops it.

Spark compares offsets as JSON strings (an unchanged offset means "no new data"), so every
offset is built in one canonical form: keys sorted numerically, integers only.

Order: a producer appends to the group of slot `producer_id mod Q`, and a slot's next group is
created only once the previous one closed. A batch therefore never advances a group while an
earlier group of the same slot still has records the batch does not include: one producer's
records reach Spark in the order they were sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from kera.consumer.cursor import GroupInfo, parse_groups
from kera.errors import KeraError

# What the source reads (kera.consumer.consumer.ISOLATION_LEVELS), as Spark's Kafka source
# does: committed transactions only, in its fetches and in the latest offsets it plans to.
ISOLATION = "read_committed"
EARLIEST = -2  # per-streamlet shorthand in user JSON, as in Spark's Kafka source
LATEST = -1


class DataLoss(KeraError):
    """Records a query expected to read are gone (stream recreated, group missing or truncated)."""
    code = "data_loss"


class Groups(list):
    """A streamlet's groups (GroupInfo, sorted) and `first_group`, the broker's first retained
    group: every group below it was deleted by retention (the `offsets` reply's field), and
    `epoch`, the streamlet's current history epoch (None: no data yet, or an older broker)."""
    first_group = 0
    epoch: int | None = None


def history_epoch(infos) -> int | None:
    return getattr(infos, "epoch", None)


def epoch_lost(start: "Cursor", infos) -> str | None:
    """Why `start` points into a history the streamlet no longer has, or None."""
    current = history_epoch(infos)
    if start.epoch is None or current is None or start.epoch == current:
        return None
    return (f"the streamlet's history changed (epoch {start.epoch} -> {current}): its data was "
            "lost and it restarted empty")


def first_group(infos) -> int:
    return getattr(infos, "first_group", 0)


def group_infos(raw) -> list[GroupInfo]:
    """Validate a broker's groups list (kera.consumer.cursor.parse_groups) and sort it by group."""
    return sorted(parse_groups(raw))


@dataclass(frozen=True)
class Cursor:
    """Where a reader is in one streamlet (see the module docstring)."""
    next: int = 0
    groups: Mapping[int, int] = field(default_factory=dict)
    epoch: int | None = None   # the history pointed into; None: unknown (not checked)

    def position(self, g: int) -> int | None:
        """Next record offset of group g, or None when g is finished."""
        if g in self.groups:
            return self.groups[g]
        return 0 if g >= self.next else None

    def to_json(self) -> dict:
        out = {"next": self.next, "groups": {str(g): self.groups[g] for g in sorted(self.groups)}}
        if self.epoch is not None:
            out["epoch"] = self.epoch
        return out

    @staticmethod
    def from_json(obj) -> "Cursor":
        if not isinstance(obj, dict) or set(obj) - {"next", "groups", "epoch"}:
            raise ValueError(f"a streamlet offset must be {{'next': N, 'groups': {{...}}}}, not {obj!r}")
        nxt = _non_negative(obj.get("next", 0), "next")
        groups = obj.get("groups", {})
        if not isinstance(groups, dict):
            raise ValueError(f"'groups' must map group ids to offsets, not {groups!r}")
        parsed = {_non_negative(int(g), "group"): _non_negative(off, "offset") for g, off in groups.items()}
        epoch = obj.get("epoch")
        if epoch is not None:
            epoch = _non_negative(epoch, "epoch")
        return Cursor(max(nxt, max(parsed, default=-1) + 1), parsed, epoch)


@dataclass(frozen=True)
class StreamOffset:
    """Cursors of every streamlet of one stream; `stream_id` detects a recreated stream."""
    stream_id: int | None
    cursors: Mapping[int, Cursor]

    def to_json(self) -> dict:
        return {"id": self.stream_id,
                "streamlets": {str(sl): self.cursors[sl].to_json() for sl in sorted(self.cursors)}}

    @staticmethod
    def from_json(obj) -> "StreamOffset":
        if not isinstance(obj, dict) or "streamlets" not in obj:
            raise ValueError(f"a stream offset must be {{'id': ..., 'streamlets': {{...}}}}, not {obj!r}")
        sid = obj.get("id")
        if sid is not None:
            sid = _non_negative(sid, "id")
        return StreamOffset(sid, {_non_negative(int(sl), "streamlet"): Cursor.from_json(c)
                                  for sl, c in obj["streamlets"].items()})


def to_json(offsets: Mapping[str, StreamOffset]) -> dict:
    """The canonical JSON-able dict of a source offset."""
    return {name: offsets[name].to_json() for name in sorted(offsets)}


def from_json(obj) -> dict[str, StreamOffset]:
    if isinstance(obj, str):
        obj = json.loads(obj)
    if not isinstance(obj, dict):
        raise ValueError(f"an offset must be a JSON object, not {obj!r}")
    return {name: StreamOffset.from_json(value) for name, value in obj.items()}


def _non_negative(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {value!r}")
    return value


# --------------------------------------------------------------------------- boundaries

def earliest(infos: list[GroupInfo]) -> Cursor:
    """Every record still stored."""
    return Cursor(first_group(infos), {i.group: i.start for i in infos if i.start > 0},
                  history_epoch(infos))


def latest(infos: list[GroupInfo]) -> Cursor:
    """Past every durable record: groups that exist are listed at their durable end (a finished
    group stays listed: harmless, and it is dropped by the first batch)."""
    return Cursor(infos[-1].group + 1 if infos else first_group(infos),
                  {i.group: i.durable_end for i in infos}, history_epoch(infos))


def parse_boundary(spec: str, streams: list[str], default: int) -> dict[str, dict[int, object]]:
    """Parse a `startingOffsets` / `endingOffsets` option into {stream: {sl: Cursor | EARLIEST |
    LATEST}}; a streamlet or stream missing from JSON gets `default`. Keys of the result that
    are missing mean `default` too (the streamlet count is only known from the descriptor)."""
    spec = spec.strip()
    if spec == "earliest":
        return {s: {"*": EARLIEST} for s in streams}
    if spec == "latest":
        return {s: {"*": LATEST} for s in streams}
    try:
        obj = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"offsets must be 'earliest', 'latest' or JSON, not {spec!r}: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"offsets JSON must be an object keyed by stream name, not {spec!r}")
    unknown = set(obj) - set(streams)
    if unknown:
        raise ValueError(f"offsets name streams {sorted(unknown)} that this query does not read")
    out: dict[str, dict] = {}
    for name in streams:
        per_sl: dict = {"*": default}
        value = obj.get(name, {})
        if isinstance(value, dict) and "streamlets" in value:
            value = value["streamlets"]
        if not isinstance(value, dict):
            raise ValueError(f"offsets of stream {name!r} must map streamlets to offsets")
        for sl, v in value.items():
            sl = _non_negative(int(sl), "streamlet")
            if v in (EARLIEST, LATEST):
                per_sl[sl] = v
            else:
                per_sl[sl] = Cursor.from_json(v)
        out[name] = per_sl
    return out


@dataclass(frozen=True)
class AtTime:
    """A starting boundary by time (options startingTimestamp / startingOffsetsByTimestamp):
    the first record at or after `timestamp_us` in each group, resolved by the streamlet's
    broker (`offsets_for_time`), not from the group list."""
    timestamp_us: int


def with_times(boundary: dict[str, dict], times: Mapping[str, Mapping]) -> dict[str, dict]:
    """`boundary` (parse_boundary's) with {stream: {sl or "*": timestamp_us}} laid over it."""
    out = {name: dict(per_sl) for name, per_sl in boundary.items()}
    for name, per_sl in times.items():
        out[name].update({sl: AtTime(us) for sl, us in per_sl.items()})
    return out


def spec_of(boundary: Mapping, sl: int):
    """What a parsed boundary says for streamlet `sl`: EARLIEST, LATEST, a Cursor or AtTime."""
    return boundary.get(sl, boundary.get("*", EARLIEST))


def cursor_from_time(low: int, offsets: Mapping[int, int], epoch: int | None) -> Cursor:
    """A broker's time cursor (groups below `low` finished, groups >= `low` missing from
    `offsets` at 0) as a Cursor, which lists every group below `next` it does not finish."""
    nxt = max(low, max(offsets, default=-1) + 1)
    return Cursor(nxt, {g: offsets.get(g, 0) for g in range(low, nxt)}, epoch)


def resolve(boundary: Mapping, sl: int, infos: list[GroupInfo]) -> Cursor:
    """The cursor a parsed boundary gives streamlet `sl`, given its groups now (an AtTime
    boundary is resolved by its broker instead: kera.spark.metadata.cursor_at_time)."""
    spec = spec_of(boundary, sl)
    if spec == EARLIEST:
        return earliest(infos)
    if spec == LATEST:
        return latest(infos)
    return spec


# --------------------------------------------------------------------------- advancing

def check_loss(start: Cursor, infos: list[GroupInfo], where: str) -> list[str]:
    """Problems that mean records `start` still has to read are gone."""
    problems = []
    known = {i.group: i for i in infos}
    first = first_group(infos)
    if start.next < first:
        problems.append(f"{where} groups [{start.next}, {first}) were deleted by retention")
    for g, off in start.groups.items():
        info = known.get(g)
        if info is None:
            problems.append(f"{where} group {g} is gone")
        elif off < info.start:
            problems.append(f"{where} group {g} records [{off}, {info.start}) are gone")
        elif off > info.durable_end:
            problems.append(f"{where} group {g} is at {off}, past its durable end {info.durable_end}")
    for info in infos:
        if info.group >= start.next and info.group not in start.groups and info.start > 0:
            problems.append(f"{where} group {info.group} records [0, {info.start}) are gone")
    return problems


def advance(start: Cursor, infos: list[GroupInfo], cap: Cursor | None = None,
            max_records: int | None = None) -> Cursor:
    """The end cursor of a batch starting at `start`: every durable record the broker reports
    (`infos`), at most up to `cap` per group and `max_records` in all, never advancing a group
    while an earlier group of its slot is not finished. Pure: same inputs, same JSON."""
    heads = _heads(start, infos, cap)
    if max_records is not None:
        heads = _apply_budget(start, infos, heads, max_records)
    groups: dict[int, int] = {}
    for info in infos:
        s = _start_of(start, info)
        if s is None:
            continue
        e = heads.get(info.group, s)
        # Drop a group only once it was already finished at the batch's start: a group
        # finished during this batch keeps its final offset listed (see module docstring).
        if info.closed and s >= info.durable_end and s == e:
            continue
        groups[info.group] = e
    nxt = max(start.next, infos[-1].group + 1 if infos else 0, first_group(infos))
    epoch = history_epoch(infos)
    return Cursor(nxt, groups, start.epoch if epoch is None else epoch)


def _start_of(start: Cursor, info: GroupInfo) -> int | None:
    s = start.position(info.group)
    if s is None:
        return None
    return max(s, info.start)  # records below start are gone (check_loss reports them)


def _chains(infos: list[GroupInfo]) -> dict[int, list[GroupInfo]]:
    chains: dict[int, list[GroupInfo]] = {}
    for info in infos:  # sorted by g: each chain is in creation order
        chains.setdefault(info.slot, []).append(info)
    return chains


def _heads(start: Cursor, infos: list[GroupInfo], cap: Cursor | None) -> dict[int, int]:
    """Per group the furthest offset a batch may reach, honouring slot order and the cap."""
    heads: dict[int, int] = {}
    for chain in _chains(infos).values():
        blocked = False
        for info in chain:
            s = _start_of(start, info)
            if s is None:
                continue
            e = s
            if not blocked:
                e = max(s, info.durable_end)
                if cap is not None:
                    limit = cap.position(info.group)
                    if limit is not None:  # None: the cap has the group finished
                        e = max(s, min(e, limit))
            heads[info.group] = e
            if not (info.closed and e >= info.durable_end):
                blocked = True
    return heads


def _apply_budget(start: Cursor, infos: list[GroupInfo], heads: dict[int, int],
                  max_records: int) -> dict[int, int]:
    """Share `max_records` among slot chains in proportion to what each has available, then
    walk each chain in order."""
    chains = _chains(infos)
    avail = {slot: sum(heads[i.group] - _start_of(start, i) for i in chain if i.group in heads)
             for slot, chain in chains.items()}
    if sum(avail.values()) <= max_records:
        return heads
    shares = share(avail, max_records)
    out = dict(heads)
    for slot, chain in chains.items():
        budget = shares[slot]
        for info in chain:
            if info.group not in heads:
                continue
            s = _start_of(start, info)
            take = min(budget, heads[info.group] - s)
            out[info.group] = s + take
            budget -= take
    return out


def share(avail: Mapping, total: int) -> dict:
    """Split `total` among keys in proportion to `avail` (never more than a key has), the
    remainder going to the largest first. Deterministic; sums to min(total, sum(avail))."""
    whole = sum(avail.values())
    if whole <= total:
        return dict(avail)
    shares = {k: (total * a) // whole for k, a in avail.items()}
    left = total - sum(shares.values())
    for k in sorted(avail, key=lambda k: (-avail[k], str(k))):
        if left == 0:
            break
        if shares[k] < avail[k]:
            shares[k] += 1
            left -= 1
    return shares


def size(start: Cursor, end: Cursor, infos: list[GroupInfo] | None = None) -> int:
    """Records between two cursors of one streamlet."""
    return sum(e - s for _, s, e in plan(start, end, infos))


# --------------------------------------------------------------------------- planning

def plan(start: Cursor, end: Cursor, infos: list[GroupInfo] | None = None) -> list[tuple[int, int, int]]:
    """(group, start offset, end offset) for every group with records in [start, end).

    A group that `end` has finished without listing it is read to its final offset from
    `infos` (a user-written endingOffsets). Without `infos` such a group has nothing left:
    `advance` drops a group only once the start is already at its end."""
    final = {i.group: i.finished_at for i in infos or ()}
    out = []
    candidates = set(start.groups) | set(end.groups) | set(range(start.next, end.next))
    for g in sorted(candidates):
        s = start.position(g)
        if s is None:
            continue
        e = end.position(g)
        if e is None:
            if infos is None or g not in final:  # nothing left, or the group is gone
                e = s
            elif final[g] is None:
                raise ValueError(f"the end offset has group {g} finished but it is still open")
            else:
                e = final[g]
        if e < s:
            raise ValueError(f"group {g} would be read backwards: from {s} to {e}")
        if e > s:
            out.append((g, s, e))
    return out


# --------------------------------------------------------------------------- consumer groups

def finished_below_next(cursor: Cursor) -> bool:
    """Whether the cursor leaves groups below `next` unlisted between its listed ones: their
    final offsets are then needed (`group_positions`' `infos`) to state it as group positions."""
    low = min([*cursor.groups, cursor.next])
    return any(g not in cursor.groups for g in range(low, cursor.next))


def group_positions(cursor: Cursor, infos) -> list[list]:
    """The cursor as a consumer group's committed position of its streamlet,
    `[[group, offset, epoch], ...]` (kera.coordinator.groups: groups below the lowest listed
    one are finished; one listed is at its offset; one above not listed is read from 0).

    A Spark cursor may leave a finished group unlisted *between* listed ones (below `next`):
    it is listed here at its final offset, taken from `infos` (the streamlet's groups). One
    absent from `infos` was deleted by retention: left out, as a reader cannot go there."""
    low = min([*cursor.groups, cursor.next])
    ends = {i.group: i.durable_end for i in infos or ()}
    out = []
    for g in range(low, cursor.next):
        offset = cursor.groups.get(g, ends.get(g))
        if offset is not None:
            out.append([g, offset, cursor.epoch])
    out += [[g, off, cursor.epoch] for g, off in sorted(cursor.groups.items()) if g >= cursor.next]
    return out or [[cursor.next, 0, cursor.epoch]]
