"""`kera group describe` and `kera group reset-positions` for Kafka-protocol groups.

A Kafka group's committed offsets are kera's coordinator's (kera.coordinator.kafka_offsets);
its members live on the broker that coordinates it (kera.broker.kafka.group_admin), which
this asks over kera's protocol: no Kafka port, client or SASL user needed. Offsets are record
numbers; a partition's start and end come from its owning broker (`numbers`), so lag is
Kafka's: the partition's end (its next record number) minus the committed offset. Partition
p of a stream with Q active groups is slot p % Q of streamlet p // Q
(kera.broker.kafka.slots).

A reset is refused while the group has live members, as kafka-consumer-groups refuses one:
the coordinating broker checks and writes in one step (`kafka_group_reset`). Targets are
Kafka's: earliest, latest, a number (clamped to what is retained, as Kafka clamps), or a time
(each partition's first record at or after it, its end when there is none).

The sans-IO parts (targets, lag rows) are plain functions of what was fetched.
"""

from __future__ import annotations

import sys

from kera.cli.output import coordinator_call, print_json, table
from kera.errors import KeraError

# Brokers asked to find the group's coordinator: the first one asked names it, so two are
# enough unless the group moves meanwhile (a broker joined or failed); one more covers that.
COORDINATOR_HOPS_MAX = 3
US_PER_MS = 1000


# ---------------------------------------------------------------------- sans-IO
def reset_offset(span: tuple[int, int], to: str | None, number: int | None,
                 at_time: int | None = None, committed: int | None = None,
                 shift_by: int | None = None) -> int:
    """The offset a reset gives a partition whose retained records are `span` (start, end):
    `to` earliest/latest, else `number` clamped to the span, else the `committed` offset
    moved `shift_by` (clamped to the span), else the record found at a time (`at_time`,
    None: none at or after it, so the end)."""
    start, end = span
    if to == "earliest":
        return start
    if to == "latest":
        return end
    if number is not None:
        return min(max(number, start), end)
    if shift_by is not None:
        return min(max(committed + shift_by, start), end)
    return end if at_time is None else at_time


def lag_rows(committed: list, spans: dict, members: list) -> list[dict]:
    """One row per partition committed or assigned: committed offset, partition end, lag
    (None where unknown), and the member it is assigned to (None: no member holds it)."""
    owner = {(t, p): m for m in members for t, p in m.get("assignment", [])}
    offsets = {(t, p): off for t, p, off, _meta in committed}
    rows = []
    for part in sorted(set(offsets) | set(owner)):
        off, span = offsets.get(part), spans.get(part)
        end = None if span is None else span[1]
        lag = None if off is None or end is None else max(end - off, 0)
        rows.append({"topic": part[0], "partition": part[1], "committed": off, "end": end,
                     "lag": lag, "member": owner.get(part)})
    return rows


# ---------------------------------------------------------------------- calls
def _admin(args):
    from kera import Admin
    return Admin(args.bootstrap, timeout_s=args.timeout_s,
                 key_file=getattr(args, "key_file", None))


def _rpc(args, address: str, op: str, **fields) -> dict:
    from kera.net import rpc
    header, _ = rpc.call(address, op, fields, timeout_s=args.timeout_s,
                         key_file=getattr(args, "key_file", None))
    return header


def _kafka_brokers(admin) -> dict[int, str]:
    """{broker id: its kera address} of the live brokers with a Kafka listener."""
    return {b["id"]: b["address"] for b in admin.cluster()["brokers"]
            if b.get("alive") and b.get("kafka_address")}


def group_members(args, brokers: dict[int, str]) -> dict | None:
    """The coordinating broker's view of the group (kera.broker.kafka.group_admin.members)
    with `address` added; None when no broker runs a Kafka listener."""
    if not brokers:
        return None
    bid = min(brokers)
    for _ in range(COORDINATOR_HOPS_MAX):
        reply = _rpc(args, brokers[bid], "kafka_group_members", group=args.group)
        named = reply.get("coordinator")
        if named == bid:
            return {**reply, "address": brokers[bid]}
        if named not in brokers:
            raise KeraError(f"no broker coordinates Kafka group {args.group!r} now (broker "
                            f"{bid} names {named}): retry once the cluster settled",
                            retriable=True)
        bid = named
    raise KeraError(f"Kafka group {args.group!r} moved between brokers while asked: retry",
                    retriable=True)


def spans(args, admin, parts, at_ms: int | None = None, errors: list | None = None) -> dict:
    """{(topic, partition): (start, end[, found at time])} from each owning broker; a
    partition whose broker does not answer, or a deleted topic's, is left out (its error
    appended to `errors`, if given)."""
    from kera.codec import schema
    out, infos = {}, {}
    for topic, p in parts:
        try:
            if topic not in infos:
                infos[topic] = schema.stream_descriptor(admin.describe_stream(topic))
            info = infos[topic]
            sl, slot = divmod(p, info.active_groups)   # kera.broker.kafka.slots' numbering
            fields = {"sid": info.id, "sl": sl, "slot": slot}
            if at_ms is not None:
                fields["timestamp_us"] = max(at_ms, 0) * US_PER_MS
            r = _rpc(args, info.owner(sl), "numbers", **fields)
        except KeraError as err:
            if errors is not None:
                errors.append(err)
            continue
        out[(topic, p)] = (r["start"], r["end"], r.get("at_time"))
    return out


def _partitions(admin, stream: str) -> int:
    """A stream's Kafka partitions: one per streamlet and active group slot."""
    d = admin.describe_stream(stream)
    return d["streamlets"] * d.get("active_groups", 1)


# ---------------------------------------------------------------------- commands
def describe(args, committed: list) -> int:
    """Committed offsets, ends, lag and members of a Kafka group (kafka-consumer-groups
    --describe's columns)."""
    with _admin(args) as admin:
        view = group_members(args, _kafka_brokers(admin))
        members = [] if view is None else view.get("members", [])
        assigned = [tuple(p) for m in members for p in m.get("assignment", [])]
        found = spans(args, admin, sorted({(t, p) for t, p, *_ in committed} | set(assigned)))
    rows = lag_rows(committed, {k: v[:2] for k, v in found.items()}, members)
    state = "-" if view is None else view.get("state", "-")
    if args.json:
        print_json({"group": args.group, "protocol": "kafka", "state": state,
                    "members": members, "offsets": committed, "partitions": [
                        {**r, "member": None if r["member"] is None else r["member"]["member_id"]}
                        for r in rows]})
        return 0
    print(f"group '{args.group}': Kafka protocol, {state}, {len(members)} members")
    print(table(["TOPIC", "PARTITION", "CURRENT-OFFSET", "LOG-END-OFFSET", "LAG",
                 "CONSUMER-ID", "HOST", "CLIENT-ID"], [_row(r) for r in rows]))
    return 0


def _row(r: dict) -> list:
    m = r["member"] or {}
    return [r["topic"], r["partition"], *("-" if r[k] is None else r[k]
                                          for k in ("committed", "end", "lag")),
            m.get("member_id", "-"), m.get("host", "-"), m.get("client_id", "-")]


def reset(args, at_ms: int | None, committed: list) -> int:
    """Set the group's offsets on every partition of `args.streams`; refused while the group
    has members."""
    with _admin(args) as admin:
        parts = [(s, p) for s in args.streams for p in range(_partitions(admin, s))]
        current = {(t, p): off for t, p, off, _meta in committed}
        metadata = {(t, p): meta for t, p, _off, meta in committed}
        if args.to_current or args.shift_by is not None:
            parts = [part for part in parts if part in current]   # the committed ones only
            if not parts:
                raise KeraError(f"group '{args.group}' has no committed offsets on "
                                f"{', '.join(args.streams)}: nothing to shift or keep")
        errors: list = []
        found = spans(args, admin, parts, at_ms, errors)
        missing = [part for part in parts if part not in found]
        if missing:
            raise KeraError(f"no answer for partitions {missing[:10]} from their brokers "
                            f"({errors[0].message if errors else 'a failover under way?'}): "
                            f"nothing was reset; retry", retriable=True)
        offsets = [[t, p, current[(t, p)], metadata[(t, p)]] if args.to_current else
                   [t, p, reset_offset(found[(t, p)][:2], args.to, args.to_offset,
                                       found[(t, p)][2], current.get((t, p)), args.shift_by), ""]
                   for t, p in parts]
        view = group_members(args, _kafka_brokers(admin))
    if not args.execute:
        print(table(["TOPIC", "PARTITION", "NEW-OFFSET"], [o[:3] for o in offsets]))
        from kera.cli.groups import DRY_RUN_NOTE
        print(DRY_RUN_NOTE, file=sys.stderr)
        return 0
    if view is None:   # no Kafka listener: no member can be in the group
        coordinator_call(args, "kafka_offset_commit", group=args.group, offsets=offsets)
    else:
        _rpc(args, view["address"], "kafka_group_reset", group=args.group, offsets=offsets)
    if args.json:
        print_json({"group": args.group, "protocol": "kafka", "offsets": offsets})
        return 0
    print(f"group '{args.group}' (Kafka protocol): {len(parts)} partitions of "
          f"{', '.join(args.streams)} reset")
    print(table(["TOPIC", "PARTITION", "NEW-OFFSET"], [o[:3] for o in offsets]))
    return 0
