"""`kera group list|describe|reset-positions|delete`: consumer groups from the command line.

reset-positions sets an empty group's positions to the start, the end, a record number
(`--to-offset`), a time (`--to-datetime`, the brokers' offsets_for_time: each streamlet's
first record at or after it), or the committed ones moved (`--shift-by`) or kept
(`--to-current`).

The coordinator keeps groups (kera.coordinator.groups); describe adds each committed part's
lag, the durable records and chunk bytes past its committed position, asked of the part's broker.
Groups of Kafka clients (the brokers' Kafka listeners) are described and reset alike, by
kera.cli.kafka_groups: a group holding Kafka offsets is one, or any group with `--protocol
kafka`.
"""

from __future__ import annotations

import sys

from kera.cli.output import CliError, coordinator_call, print_json, table
from kera.errors import NotAuthorized


RESET_TARGETS = ("earliest", "latest")
PROTOCOLS = ("kera", "kafka")


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
    d.add_argument("--protocol", choices=PROTOCOLS, default=None,
                   help="kafka: a group of Kafka clients (default: kafka when the group holds "
                        "Kafka offsets, else kera)")
    d.set_defaults(func=cmd_describe)
    r = gsub.add_parser("reset-positions", parents=opts,
                        help="set an empty group's positions on streams: start, end, a number or a time",
                        description="Set the committed positions of every streamlet of the "
                                    "given streams (refused while the group has members). "
                                    "Without --execute, only prints what it would set (as "
                                    "kafka-consumer-groups --reset-offsets --dry-run).")
    r.add_argument("group", help="group name")
    streams = r.add_mutually_exclusive_group(required=True)
    streams.add_argument("--stream", action="append", dest="streams",
                         help="stream whose positions to reset (repeat for several)")
    streams.add_argument("--all-streams", action="store_true",
                         help="every stream the group has committed positions on")
    r.add_argument("--execute", action="store_true",
                   help="apply the reset (default: a dry run that prints the new positions)")
    r.add_argument("--dry-run", action="store_true",
                   help="print the new positions and change nothing (the default)")
    to = r.add_mutually_exclusive_group(required=True)
    to.add_argument("--to", choices=RESET_TARGETS,
                    help="earliest: re-read everything retained; latest: skip to the end")
    to.add_argument("--to-datetime", metavar="TIME",
                    help="each streamlet's first record at or after TIME: milliseconds since "
                         "the epoch or ISO 8601 (no zone: UTC)")
    to.add_argument("--to-offset", metavar="N", type=int,
                    help="record number N of every streamlet (Kafka's offset): the first "
                         "retained record when N was deleted, the end when N is not written")
    to.add_argument("--shift-by", metavar="N", type=int,
                    help="each committed position moved N records (negative: back), kept "
                         "within the retained records; streamlets without one are left alone")
    to.add_argument("--to-current", action="store_true",
                    help="the committed positions as they are (kafka-consumer-groups "
                         "--to-current): prints them, or writes them again with --execute")
    r.add_argument("--protocol", choices=PROTOCOLS, default=None,
                   help="kafka: a group of Kafka clients, refused while it has members "
                        "(default: kafka when the group holds Kafka offsets, else kera)")
    r.set_defaults(func=cmd_reset)
    rm = gsub.add_parser("delete", parents=opts, help="delete an empty group and its positions")
    rm.add_argument("group", help="group name")
    rm.set_defaults(func=cmd_delete)


def cmd_list(args) -> int:
    groups = [{**g, "protocol": "kera"} for g in coordinator_call(args, "group_list")["groups"]]
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
        return coordinator_call(args, "kafka_group_list")["groups"]
    except NotAuthorized:
        return []


def _kafka_offsets(args, name: str) -> list:
    return coordinator_call(args, "kafka_offset_fetch", group=name)["offsets"]


def _is_kafka(args) -> bool:
    if args.protocol is not None:
        return args.protocol == "kafka"
    return args.group in _kafka_groups(args)


def cmd_describe(args) -> int:
    if _is_kafka(args):
        from kera.cli import kafka_groups
        return kafka_groups.describe(args, _kafka_offsets(args, args.group))
    group = coordinator_call(args, "group_describe", group=args.group)
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
    if args.execute and args.dry_run:
        raise CliError("give --execute or --dry-run, not both")
    at_ms = None if args.to_datetime is None else parse_time_ms(args.to_datetime)
    kafka = _is_kafka(args)
    if args.all_streams:
        args.streams = _committed_streams(args, kafka)
    if kafka:
        from kera.cli import kafka_groups
        return kafka_groups.reset(args, at_ms, _kafka_offsets(args, args.group))
    with Admin(args.bootstrap) as admin:
        described = {s: admin.describe_stream(s) for s in args.streams}
    parts = [(s, sl) for s, d in described.items() for sl in range(d["streamlets"])]
    with Consumer(args.bootstrap, args.streams, streamlets=[], start=args.to or "earliest",
                  request_timeout_s=args.timeout_s) as c:
        if at_ms is not None:
            positions = c.offsets_for_times({part: at_ms for part in parts})
        elif args.to_offset is not None:
            positions = [p for s, sl in parts for p in c.offsets_for_number(s, sl, args.to_offset)]
        elif args.to_current or args.shift_by is not None:
            positions = _moved_positions(args, c, described)
            parts = sorted({(p.stream, p.streamlet) for p in positions})
        else:
            c.assign(parts)
            positions = c.positions(parts)
    if not args.execute:
        print(table(["STREAM", "STREAMLET", "GROUP", "NEW-OFFSET"],
                    [[p.stream, p.streamlet, p.group, p.offset] for p in positions]))
        print(DRY_RUN_NOTE, file=sys.stderr)
        return 0
    from kera.consumer.membership import positions_to_wire
    coordinator_call(args, "group_reset", group=args.group, streams=args.streams,
                     positions=positions_to_wire(positions))
    target = reset_target(args)
    print(f"group '{args.group}': {len(parts)} streamlets of {', '.join(args.streams)} reset "
          f"to {target}")
    return 0


DRY_RUN_NOTE = "dry run: nothing was changed; add --execute to apply these positions"


def reset_target(args) -> str:
    """What a reset moved the positions to, in words."""
    if args.to:
        return args.to
    if args.to_offset is not None:
        return f"record number {args.to_offset}"
    if args.shift_by is not None:
        return f"their committed positions shifted by {args.shift_by}"
    if args.to_current:
        return "their committed positions"
    return f"the first records at or after {args.to_datetime}"


def _moved_positions(args, consumer, described: dict) -> list:
    """The group's committed positions on `described` streams, each shifted by --shift-by
    records (kept within the retained ones) or kept (--to-current). A committed position's
    record number is its streamlet's durable end minus the records behind it (numbers count
    every offset, gaps included), so shifting needs one ordered unit per streamlet."""
    from kera.consumer.membership import positions_from_wire
    committed = [p for p in positions_from_wire(coordinator_call(
        args, "group_offsets", group=args.group)["positions"]) if p.stream in described]
    if not committed:
        raise CliError(f"group '{args.group}' has no committed positions on "
                       f"{', '.join(described)}: nothing to shift or keep")
    if args.to_current:
        return committed
    multi = sorted(s for s, d in described.items() if d.get("active_groups", 1) != 1)
    if multi:
        raise CliError(f"--shift-by needs one active group per streamlet; {', '.join(multi)} "
                       f"have several (record numbers are per slot): use --to-offset or "
                       f"--to-datetime")
    behind = consumer.lag_of(committed)
    out = []
    for (stream, sl), lag in sorted(behind.items()):
        start, end = consumer.number_span(stream, sl)
        target = min(max(end - lag + args.shift_by, start), end)
        out += consumer.offsets_for_number(stream, sl, target)
    return out


def _committed_streams(args, kafka: bool) -> list[str]:
    """The streams a group has committed positions on (--all-streams)."""
    if kafka:
        names = {t for t, _p, _off, _meta in _kafka_offsets(args, args.group)}
    else:
        names = {s for s, _sl, _pos in coordinator_call(args, "group_offsets",
                                                        group=args.group)["positions"]}
    if not names:
        raise CliError(f"group '{args.group}' has no committed positions: name the streams "
                       f"with --stream")
    return sorted(names)


def cmd_delete(args) -> int:
    coordinator_call(args, "group_delete", group=args.group)
    print(f"deleted group '{args.group}'")
    return 0
