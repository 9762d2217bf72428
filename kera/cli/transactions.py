"""`kera txn list|describe`: transactional producers' ids from the command line (Kafka's
kafka-transactions.sh list / describe).

The coordinator keeps transactional ids (kera.coordinator.transactions); `describe` shows an
id's producer id, epoch, state, timeout, the streamlets its current (or last) transaction
wrote, the markers still being written and the groups whose positions it carries.
"""

from __future__ import annotations

from kera.cli.output import coordinator_call, print_json, table


def add_parser(sub, admin_options) -> None:
    p = sub.add_parser("txn", help="list or describe transactional producers",
                       description="Transactional producers' ids: their producer id, epoch and "
                                   "the state of their current transaction.")
    tsub = p.add_subparsers(dest="txn_command", metavar="ACTION", required=True)
    opts = [admin_options()]
    tsub.add_parser("list", parents=opts,
                    help="list transactional ids").set_defaults(func=cmd_list)
    d = tsub.add_parser("describe", parents=opts,
                        help="an id's producer, epoch, state and streamlets")
    d.add_argument("transactional_id", help="the producer's transactional id")
    d.set_defaults(func=cmd_describe)


def cmd_list(args) -> int:
    txns = coordinator_call(args, "txn_list")["transactions"]
    if args.json:
        print_json(txns)
        return 0
    rows = [[t["transactional_id"], t["producer_id"], t["state"]] for t in txns]
    print(table(["TRANSACTIONAL ID", "PRODUCER ID", "STATE"], rows))
    return 0


def cmd_describe(args) -> int:
    t = coordinator_call(args, "txn_describe", transactional_id=args.transactional_id)
    if args.json:
        print_json(t)
        return 0
    print(f"transactional id '{t['transactional_id']}': producer {t['producer_id']} epoch "
          f"{t['epoch']}, transaction {t['txn']} {t['state']}, timeout {t['timeout_ms']} ms")
    pending = {tuple(p) for p in t.get("pending_markers", [])}
    rows = [[s, sl, "pending" if (s, sl) in pending else "-"] for s, sl in t["parts"]]
    if rows:
        print(table(["STREAM", "STREAMLET", "MARKER"], rows))
    if t.get("groups"):
        print(f"positions for groups: {', '.join(t['groups'])}")
    return 0
