"""`kera group list|describe|reset-positions|delete`: consumer groups from the command line.

reset-positions sets an empty group's positions to the start, the end, or a time
(`--to-datetime`, the brokers' offsets_for_time: each streamlet's first record at or after it).

The coordinator keeps groups (kera.coordinator.groups); describe adds each committed part's
lag, the durable records and chunk bytes past its committed position, asked of the part's broker.
"""

from __future__ import annotations
from kera.cli.output import print_json, table
from kera.errors import NotAuthorized


RESET_TARGETS = ("earliest", "latest")


def add_parser(sub, admin_options) -> None:
    p = sub.add_parser("group", help="list, describe, reset or delete consumer groups",
                       description="Consumer groups: members, their streamlets, committed "
                                   "positions and lag.")
    gsub = p.add_subparsers(dest="group_command", metavar="ACTION", required=True)
    opts = [admin_options()]
    gsub.add_parser("list", parents=opts, help="list groups").set_defaults(func=cmd_list)
    d = gsub.add_parser("describe", parents=opts,
                        help="members, their streamlets, committed positions and lag")
    d.add_argument("group", help="group name")
    d.set_defaults(func=cmd_describe)
    r = gsub.add_parser("reset-positions", parents=opts,
                        help="set an empty group's positions on streams to their start or end",
                        description="Set the committed positions of every streamlet of the "
                                    "given streams (refused while the group has members).")
    r.add_argument("group", help="group name")
    r.add_argument("--stream", action="append", required=True, dest="streams",
                   help="stream whose positions to reset (repeat for several)")
    to = r.add_mutually_exclusive_group(required=True)
    to.add_argument("--to", choices=RESET_TARGETS,
                    help="earliest: re-read everything retained; latest: skip to the end")
    to.add_argument("--to-datetime", metavar="TIME",
                    help="each streamlet's first record at or after TIME: milliseconds since "
                         "the epoch or ISO 8601 (no zone: UTC)")
    r.set_defaults(func=cmd_reset)
    rm = gsub.add_parser("delete", parents=opts, help="delete an empty group and its positions")
    rm.add_argument("group", help="group name")
    rm.set_defaults(func=cmd_delete)


def _call(args, op: str, **fields) -> dict:
    from kera.client.coordinator_client import CoordinatorClient
    client = CoordinatorClient(args.bootstrap, timeout_s=args.timeout_s,
                               key_file=getattr(args, "key_file", None))
    try:
        return client.call(op, fields)[0]
    finally:
        client.close()


def cmd_list(args) -> int:
    groups = [{**g, "protocol": "kera"} for g in _call(args, "group_list")["groups"]]
    groups += [{"group": name, "protocol": "kafka", "state": "-", "members": "-", "epoch": "-",
                "parts_committed": len(_kafka_offsets(args, name))}
               for name in _kafka_groups(args)]
    if args.json:
        print_json(groups)
        return 0
    rows = [[g["group"], g["protocol"], g["state"], g["members"], g["epoch"],
             g["parts_committed"]] for g in groups]
    print(table(["GROUP", "PROTOCOL", "STATE", "MEMBERS", "EPOCH", "COMMITTED PARTITIONS"], rows))
    return 0


def _kafka_groups(args) -> list[str]:
    """Groups of Kafka clients (kera.coordinator.kafka_offsets); none for a key that may not
    list them (they are listed to brokers and admins)."""
    try:
        return _call(args, "kafka_group_list")["groups"]
    except NotAuthorized:
        return []


def _kafka_offsets(args, name: str) -> list:
    return _call(args, "kafka_offset_fetch", group=name)["offsets"]


def _describe_kafka(args) -> int:
    """A Kafka client group: its committed offsets (its members live on the broker that
    coordinates it: Kafka's own tools describe them)."""
    offsets = _kafka_offsets(args, args.group)
    if args.json:
        print_json({"group": args.group, "protocol": "kafka", "offsets": offsets})
        return 0
    print(f"group '{args.group}': Kafka protocol, {len(offsets)} partitions committed")
    print(table(["TOPIC", "PARTITION", "COMMITTED OFFSET", "METADATA"], offsets))
    return 0


def cmd_describe(args) -> int:
    if args.group in _kafka_groups(args):
        return _describe_kafka(args)
    group = _call(args, "group_describe", group=args.group)
    lags = sorted(_lag(args, group["positions"]).items())
    group["lag"] = [[s, sl, lag.records] for (s, sl), lag in lags]
    group["lag_bytes"] = [[s, sl, lag.bytes] for (s, sl), lag in lags]
    if args.json:
        print_json(group)
        return 0
    owner = {tuple(p): m["member_id"] for m in group["members"] for p in m["assignment"]}
    lag = dict(lags)
    print(f"group '{group['group']}': {group['state']}, epoch {group['epoch']}, "
          f"{len(group['members'])} members")
    rows = [[s, sl, owner.get((s, sl), "-"), _show(pos), *_show_lag(lag.get((s, sl)))]
            for s, sl, pos in group["positions"]]
    rows += [[s, sl, mid, "-", "-", "-"] for (s, sl), mid in sorted(owner.items())
             if not any((s, sl) == (ps, psl) for ps, psl, _ in group["positions"])]
    print(table(["STREAM", "STREAMLET", "MEMBER", "COMMITTED (group:offset)", "LAG",
                  "LAG BYTES"], rows))
    return 0


def _show_lag(lag) -> list:
    if lag is None:
        return ["?", "?"]
    return [lag.records, "?" if lag.bytes is None else lag.bytes]


def _show(groups: list) -> str:
    return " ".join(f"{g}:{off}" for g, off, _epoch in groups)


def _lag(args, wire_positions) -> dict:
    """Lag (records, bytes) behind each committed position; parts of deleted streams are
    left out."""
    from kera import Admin, Consumer
    with Admin(args.bootstrap) as admin:
        known = {s["name"] for s in admin.list_streams()}
    from kera.consumer.membership import positions_from_wire
    live = [p for p in positions_from_wire(wire_positions) if p.stream in known]
    if not live:
        return {}
    with Consumer(args.bootstrap, sorted({p.stream for p in live}), streamlets=[],
                  request_timeout_s=args.timeout_s) as c:
        return c.lag_detail_of(live)


def cmd_reset(args) -> int:
    from kera import Admin, Consumer
    from kera.codec.timestamps import parse_time_ms
    with Admin(args.bootstrap) as admin:
        parts = [(s, sl) for s in args.streams
                 for sl in range(admin.describe_stream(s)["streamlets"])]
    at_ms = None if args.to_datetime is None else parse_time_ms(args.to_datetime)
    with Consumer(args.bootstrap, args.streams, streamlets=[], start=args.to or "earliest",
                  request_timeout_s=args.timeout_s) as c:
        if at_ms is not None:
            positions = c.offsets_for_times({part: at_ms for part in parts})
        else:
            c.assign(parts)
            positions = c.positions(parts)
    from kera.consumer.membership import positions_to_wire
    _call(args, "group_reset", group=args.group, streams=args.streams,
          positions=positions_to_wire(positions))
    target = args.to if at_ms is None else f"the first records at or after {args.to_datetime}"
    print(f"group '{args.group}': {len(parts)} streamlets of {', '.join(args.streams)} reset "
          f"to {target}")
    return 0


def cmd_delete(args) -> int:
    _call(args, "group_delete", group=args.group)
    print(f"deleted group '{args.group}'")
    return 0
