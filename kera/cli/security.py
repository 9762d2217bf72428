"""`kera keys create|list|kafka-user|kafka-cert`, `kera acl add|remove|list`, `kera quota
set|list`: the secure path.

Keys are files (kera.net.keys); ACLs live in the coordinator (kera.net.acl, kera.coordinator.acl_ops)
and need an admin key (`--key-file` or $KERA_KEY_FILE).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kera.net import certs
from kera.net import kafka_users
from kera.net import keys as keyfiles
from kera.net.scram import SCRAM_SHA_256, new_password
from kera.net.acl import ANY_PRINCIPAL, CLUSTER_NAME, OPERATIONS, Acl
from kera.cli.output import CliError, admin, print_json, size, table

KEYS_DIR_ENV = "KERA_KEYS_DIR"


def add_parsers(sub, admin_options) -> None:
    _add_keys(sub)
    _add_acl(sub, admin_options)
    _add_quota(sub, admin_options)


def _add_keys(sub) -> None:
    p = sub.add_parser("keys", help="create CURVE keys for daemons and clients",
                       description="Keys for a secure cluster: each principal gets a key pair; "
                                   "its public half goes into the keys directory the daemons "
                                   "read, its secret file to that principal alone.")
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    c = ksub.add_parser("create", help="create a principal's key pair",
                        description="Write DIR/NAME.key_secret (mode 0600: hand it to NAME "
                                    "alone) and DIR/public/ROLE/NAME.key (read by the daemons; "
                                    "new keys are accepted within a second, no restart). "
                                    "Creates the cluster's server key on first use.")
    c.add_argument("name", help="principal name (letters, digits, - _ . @)")
    c.add_argument("--role", required=True, choices=keyfiles.ROLES,
                   help="broker, backup, coordinator: daemons; admin: may do anything but act "
                        "as a daemon; client: needs ACL grants")
    _dir_argument(c)
    c.set_defaults(func=cmd_keys_create)
    ls = ksub.add_parser("list", help="list the principals of a keys directory")
    _dir_argument(ls)
    ls.set_defaults(func=cmd_keys_list)
    _add_kafka_keys(ksub)


def _add_kafka_keys(ksub) -> None:
    u = ksub.add_parser("kafka-user", help="add, change or remove a Kafka client's SASL user",
                        description="A SASL user for Kafka clients of a secure cluster's "
                                    "Kafka listeners (SASL_SSL; PLAIN or SCRAM-SHA-256): it is "
                                    "the kera principal NAME, which `kera acl` and `kera quota` "
                                    "name. Prints the client properties, the password among "
                                    "them (only its salted hash is stored). Brokers see the "
                                    "change within a second.")
    u.add_argument("name", help="user name (letters, digits, - _ . @)")
    u.add_argument("--role", choices=kafka_users.ROLES, default="client",
                   help="client: needs ACL grants (default); admin: may do anything")
    u.add_argument("--password-stdin", action="store_true",
                   help="read the password from standard input (default: generate one)")
    u.add_argument("--remove", action="store_true",
                   help="remove the user: its connections are refused at their next request")
    u.add_argument("--kafka-bootstrap", default="HOST:PORT", metavar="HOST:PORT,...",
                   help="the brokers' Kafka addresses, for the printed bootstrap.servers")
    _dir_argument(u)
    u.set_defaults(func=cmd_keys_kafka_user)
    c = ksub.add_parser("kafka-cert", help="create a broker's TLS certificate for its Kafka "
                                           "listener",
                        description="Write DIR/kafka/NAME.crt and NAME.key (0600), signed by "
                                    "the cluster's CA DIR/kafka/ca.crt (created on first use: "
                                    "give it to Kafka clients as ssl.ca.location). A broker "
                                    "whose key is NAME uses them (--kafka-port with --keys-dir).")
    c.add_argument("name", help="the broker's key name (e.g. broker-0)")
    c.add_argument("--host", action="append", default=None, metavar="HOST",
                   help="a host name or IP address clients dial for this broker (repeatable; "
                        f"default: {', '.join(certs.DEFAULT_HOSTS)})")
    _dir_argument(c)
    c.set_defaults(func=cmd_keys_kafka_cert)


def _dir_argument(p) -> None:
    p.add_argument("--dir", type=Path, default=os.environ.get(KEYS_DIR_ENV),
                   required=os.environ.get(KEYS_DIR_ENV) is None,
                   help=f"keys directory (default: ${KEYS_DIR_ENV})")


def cmd_keys_create(args) -> int:
    secret = keyfiles.create_key(args.dir, args.name, args.role)
    print(f"created {args.role} key {args.name!r}:\n  secret (give to {args.name} only, mode "
          f"0600): {secret}\n  public (in the keys directory): "
          f"{Path(args.dir) / keyfiles.PUBLIC_DIR / args.role / (args.name + '.key')}")
    if args.role == "client":
        print(f"grant it access with: kera acl add --principal {args.name} --operation read "
              f"--stream NAME")
    return 0


def kafka_client_properties(bootstrap: str, user: str, password: str, ca: Path) -> dict:
    """What a Kafka client (librdkafka's names; Java's in KAFKA.md) needs for SASL_SSL."""
    return {"bootstrap.servers": bootstrap, "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_SHA_256, "sasl.username": user, "sasl.password": password,
            "ssl.ca.location": str(ca)}


def format_properties(props: dict) -> str:
    return "\n".join(f"{k}={v}" for k, v in props.items())


def cmd_keys_kafka_user(args) -> int:
    if args.remove:
        kafka_users.set_user(args.dir, args.name, None)
        print(f"removed Kafka user {args.name!r}")
        return 0
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else new_password()
    if not password:
        raise CliError("an empty password: give one on standard input, or leave out "
                       "--password-stdin to have one generated")
    kafka_users.set_user(args.dir, args.name, password, args.role)
    ca = certs.ca_path(args.dir)
    print(f"Kafka user {args.name!r} ({args.role}); client properties:")
    print(format_properties(kafka_client_properties(args.kafka_bootstrap, args.name, password, ca)))
    if not ca.exists():
        print(f"(no CA yet: create each broker's certificate with `kera keys kafka-cert NAME "
              f"--dir {args.dir} --host HOST`)")
    if args.role == "client":
        print(f"grant it access with: kera acl add --principal {args.name} --operation write "
              f"--operation read --stream TOPIC; and --operation read --group GROUP")
    return 0


def cmd_keys_kafka_cert(args) -> int:
    crt, key = certs.create_cert(args.dir, args.name, args.host or certs.DEFAULT_HOSTS)
    print(f"certificate of {args.name} for {', '.join(args.host or certs.DEFAULT_HOSTS)}:\n"
          f"  {crt}\n  {key} (private)\nKafka clients trust: ssl.ca.location="
          f"{certs.ca_path(args.dir)}")
    return 0


def cmd_keys_list(args) -> int:
    principals = keyfiles.load_principals(args.dir)
    rows = sorted([p.name, p.role, key.decode()] for key, p in principals.items())
    rows += sorted([u.name, u.role, "(Kafka SASL user)"]
                   for u in kafka_users.load(args.dir).values())
    print(table(["PRINCIPAL", "ROLE", "PUBLIC KEY"], rows))
    return 0


def _add_acl(sub, admin_options) -> None:
    p = sub.add_parser("acl", help="grant, deny, revoke and list access (needs an admin key)",
                       description="ACLs in Kafka's shape: a principal is allowed or denied an "
                                   "operation on a stream, group or the cluster, by literal "
                                   "name or name prefix. Deny wins over allow.")
    asub = p.add_subparsers(dest="acl_command", metavar="ACTION", required=True)
    for action, summary in (("add", "add an allow (or --deny) entry"),
                            ("remove", "remove an entry (same options as add)")):
        a = asub.add_parser(action, parents=[admin_options()], help=summary)
        _entry_arguments(a)
        a.set_defaults(func=cmd_acl_change, op=f"acl_{action}")
    ls = asub.add_parser("list", parents=[admin_options()], help="list entries")
    ls.add_argument("--principal", default=None, help="only this principal's entries")
    ls.add_argument("--resource", default=None, help="only entries on this resource name")
    ls.set_defaults(func=cmd_acl_list)


def _entry_arguments(p) -> None:
    p.add_argument("--principal", required=True,
                   help=f"principal name, or {ANY_PRINCIPAL!r} for everyone")
    p.add_argument("--operation", action="append", required=True, choices=OPERATIONS,
                   help="read, write, describe, create, delete, alter or all (repeatable)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--stream", help="a stream name (or prefix, with --prefixed)")
    target.add_argument("--group", help="a consumer group name (or prefix)")
    target.add_argument("--transactional-id",
                        help="a transactional producer's id (or prefix): write to use it, "
                             "describe to see it")
    target.add_argument("--cluster", action="store_true", help="the cluster itself")
    p.add_argument("--prefixed", action="store_true",
                   help="the name is a prefix: the entry covers every name starting with it")
    p.add_argument("--deny", action="store_true", help="a deny entry (wins over any allow)")


def _entries(args) -> list[Acl]:
    rtype, name = (("stream", args.stream) if args.stream is not None else
                   ("group", args.group) if args.group is not None else
                   ("transactional_id", args.transactional_id)
                   if args.transactional_id is not None else ("cluster", CLUSTER_NAME))
    pattern = "prefixed" if args.prefixed else "literal"
    permission = "deny" if args.deny else "allow"
    return [Acl.parse([args.principal, permission, op, rtype, name, pattern])
            for op in dict.fromkeys(args.operation)]


def cmd_acl_change(args) -> int:
    entries = _entries(args)
    reply = admin(args)._call(args.op, {"acls": [e.to_list() for e in entries]})
    verb = "added" if args.op == "acl_add" else "removed"
    print(f"{verb} {reply['changed']} of {len(entries)} entries (ACL version "
          f"{reply['acl_version']})")
    return 0


def cmd_acl_list(args) -> int:
    fields = {k: v for k, v in (("principal", args.principal), ("resource", args.resource))
              if v is not None}
    reply = admin(args)._call("acl_list", fields)
    if args.json:
        print_json(reply["acls"])
        return 0
    print(table(["PRINCIPAL", "PERMISSION", "OPERATION", "TYPE", "RESOURCE", "PATTERN"],
                 reply["acls"]))
    return 0


def _add_quota(sub, admin_options) -> None:
    p = sub.add_parser("quota", help="per-principal produce and fetch byte rates (admin key)",
                       description="Byte-rate quotas per principal, metered on each broker: a "
                                   "client over its rate gets a retriable `throttled` and slows "
                                   "down; nothing is dropped. `*` sets the default.")
    qsub = p.add_subparsers(dest="quota_command", metavar="ACTION", required=True)
    s = qsub.add_parser("set", parents=[admin_options()], help="set (or, with 0, remove) rates")
    s.add_argument("--principal", required=True, help="principal name, or '*' for the default")
    s.add_argument("--produce-bytes-per-s", type=_rate, default=None, metavar="SIZE",
                   help="bytes per second this principal may produce per broker (e.g. 10MiB; "
                        "0 removes)")
    s.add_argument("--fetch-bytes-per-s", type=_rate, default=None, metavar="SIZE",
                   help="bytes per second it may fetch per broker (0 removes)")
    s.set_defaults(func=cmd_quota_set)
    qsub.add_parser("list", parents=[admin_options()], help="list quotas").set_defaults(
        func=cmd_quota_list)


def _rate(text: str) -> int:
    return size(text)


def cmd_quota_set(args) -> int:
    if args.produce_bytes_per_s is None and args.fetch_bytes_per_s is None:
        raise CliError("give --produce-bytes-per-s and/or --fetch-bytes-per-s")
    rates = admin(args).set_quota(args.principal, args.produce_bytes_per_s,
                                   args.fetch_bytes_per_s)
    print(f"quotas of {args.principal!r}: {rates.get(args.principal) or 'none'}")
    return 0


def cmd_quota_list(args) -> int:
    rates = admin(args).list_quotas()
    if args.json:
        print_json(rates)
        return 0
    print(table(["PRINCIPAL", "PRODUCE BYTES/S", "FETCH BYTES/S"],
                 [[p, r.get("produce", "-"), r.get("fetch", "-")] for p, r in sorted(rates.items())]))
    return 0
