"""The `kera` command: daemons, a local cluster, stream administration, produce and consume.

    kera local --dir /tmp/kera-data --brokers 2 --backups 1
    kera stream create events --streamlets 4 --replication 2
    seq 10 | kera produce events
    kera consume events --from earliest --max-records 10
    kera bench --preset quick

A KeraError prints one line on stderr and exits 1; a usage error exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time

import kera
from kera import config
from kera.codec import cleanup
from kera.codec.partitioner import PARTITIONERS
from kera.cli import groups as cli_groups
from kera.cli import transactions as cli_transactions
from kera.cli import security as cli_security
from kera.daemon import file_limit
from kera.daemon import gc_policy
from kera.daemon import malloc_policy
from kera.cli import outbox as cli_outbox
from kera.cli import deliver as cli_deliver
from kera.client.admin import DEFAULT_REBALANCE_TIMEOUT_S
from kera.daemon.flags import LOG_LEVELS, duration_ms
from kera.net.keys import KEY_FILE_ENV
from kera.errors import KeraError

from kera.cli.output import CliError, admin as _admin, print_json as _print_json, size as _size, table as _table  # noqa: E402

log = logging.getLogger("kera.cli.main")

DEFAULT_BOOTSTRAP = "127.0.0.1:7000"
BOOTSTRAP_ENV = "KERA_BOOTSTRAP"
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
# `kera stats --streams --interval-s`: a rate over more than an hour is better read from metrics.
STATS_INTERVAL_S_MAX = 3600.0
# Daemons written elsewhere: `kera <name>` runs `<module>.run(args)` after `add_arguments`.
DAEMONS = {
    "coordinator": ("kera.coordinator.server",
                    "run the coordinator (cluster membership, stream metadata, placement)"),
    "broker": ("kera.broker.server", "run a broker (stores streamlets, replicates to backups)"),
    "backup": ("kera.backup.server", "run a backup (stores replicas of virtual segments)"),
}


# ---------------------------------------------------------------------- parser

def _client_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--bootstrap", default=os.environ.get(BOOTSTRAP_ENV, DEFAULT_BOOTSTRAP),
                   help=f"coordinator address host:port, or several comma-separated (they "
                        f"are asked in turn for the leader) (default: ${BOOTSTRAP_ENV} or "
                        f"{DEFAULT_BOOTSTRAP}; now %(default)s)")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="log level on stderr (default: %(default)s)")
    p.add_argument("--key-file", default=os.environ.get(KEY_FILE_ENV),
                   help=f"CURVE key to connect with, for a secure cluster (a NAME.key_secret "
                        f"from `kera keys create`; default: ${KEY_FILE_ENV}, else plaintext)")
    return p


def _admin_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, parents=[_client_options()])
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="how long to wait for the cluster to answer (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _options_after_subcommand() -> argparse.ArgumentParser:
    """The admin options for a subcommand of a command that has them too (`kera cluster
    deregister`): without defaults of their own, which would override what was given before
    the subcommand (the command's parser sets the defaults)."""
    p = _admin_options()
    for action in p._actions:
        action.default = argparse.SUPPRESS
        action.help = (action.help or "").replace(" (default: %(default)s)", "").replace(
            "; now %(default)s", "")
    return p


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kera", description="kera: stream storage with shared virtual logs.",
        epilog="Run 'kera COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"kera {kera.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = _first_positional(sys.argv[1:] if argv is None else argv)
    for name, (module, summary) in DAEMONS.items():
        _add_daemon(sub, name, module, summary, load=(wanted == name))
    _add_local(sub)
    _add_stream(sub)
    _add_cluster(sub)
    _add_stats(sub)
    _add_produce(sub)
    _add_consume(sub)
    cli_groups.add_parser(sub, _admin_options)
    cli_transactions.add_parser(sub, _admin_options)
    cli_security.add_parsers(sub, _admin_options)
    cli_outbox.add_parser(sub, _client_options)
    cli_deliver.add_parser(sub, _client_options)
    # `kera bench ...` is `python -m bench ...` (kera.bench.cli), loaded only when it runs.
    _add_daemon(sub, "bench", "kera.bench.cli", "benchmark kera against Apache Kafka",
                load=(wanted == "bench"))
    return parser


def _first_positional(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _add_daemon(sub, name: str, module: str, summary: str, load: bool) -> None:
    # A daemon's module is imported only when its command runs, so `kera stream list` does not
    # pay for (or break on) broker code.
    p = sub.add_parser(name, help=summary, description=summary[:1].upper() + summary[1:] + ".")
    if not load:
        return
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        p.description = f"{summary[:1].upper() + summary[1:]}. Not available here: {exc}"
        p.set_defaults(func=lambda args, exc=exc: _unavailable(name, exc), unavailable=True)
        return
    mod.add_arguments(p)
    p.set_defaults(func=mod.run, daemon=True)


def _unavailable(name: str, exc: Exception) -> int:
    raise CliError(f"'kera {name}' is not available in this installation: {exc}")


def _add_local(sub) -> None:
    p = sub.add_parser(
        "local", help="run a coordinator, brokers and backups on this machine (foreground)",
        description="Start a coordinator, N brokers and K backups as subprocesses on loopback "
                    "ports, print the bootstrap address, and run until Ctrl-C or SIGTERM. "
                    "Daemon logs go to DIR/logs/.")
    p.add_argument("--dir", required=True, help="data directory (metadata, replicas, logs)")
    p.add_argument("--port", type=int, default=7000,
                   help="coordinator port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--brokers", type=int, default=1, help="brokers (default: %(default)s)")
    p.add_argument("--backups", type=int, default=0, help="backups (default: %(default)s)")
    p.add_argument("--virtual-logs", type=int, default=None,
                   help="virtual logs per broker (replication capacity; default: broker's)")
    p.add_argument("--no-auto-rebalance", action="store_true",
                   help="the coordinator never moves streamlets to restarted brokers on its own "
                        "(kera cluster rebalance still does)")
    p.add_argument("--heartbeat-interval-ms", type=int, default=None,
                   help="daemon heartbeat interval (default: coordinator's)")
    p.add_argument("--start-timeout-s", type=float, default=30.0,
                   help="how long to wait for every daemon to register (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="log level of this command and of the daemons (default: %(default)s)")
    p.add_argument("--secure", action="store_true",
                   help="CURVE encryption and authentication on every daemon: keys for each "
                        "daemon, an admin and a client are created in DIR/keys")
    p.add_argument("--kafka-port", type=int, default=None, metavar="PORT",
                   help="every broker also speaks Kafka's wire protocol, broker i on PORT+i "
                        "(0: free ports), creating topics on first use; prints the "
                        "bootstrap.servers line for Kafka clients, and with --secure the "
                        "SASL_SSL client properties (default: off)")
    p.set_defaults(func=cmd_local)


def _add_stream(sub) -> None:
    p = sub.add_parser("stream", help="create, describe, list or delete streams",
                       description="Stream administration through the coordinator.")
    ssub = p.add_subparsers(dest="stream_command", metavar="ACTION", required=True)
    opts = [_admin_options()]

    c = ssub.add_parser("create", parents=opts, help="create a stream",
                        description="Create a stream and wait until its brokers serve it.")
    c.add_argument("name", help="stream name: 1-255 characters of [A-Za-z0-9._-]")
    c.add_argument("--if-not-exists", action="store_true",
                   help="succeed without changing anything when the stream exists already "
                        "(kafka-topics --if-not-exists)")
    c.add_argument("--streamlets", type=int, default=config.DEFAULT_STREAMLETS,
                   help="partitions M (1-4096, default: %(default)s)")
    c.add_argument("--active-groups", type=int, default=config.DEFAULT_ACTIVE_GROUPS,
                   help="groups open to appends per streamlet Q (1-256, default: %(default)s)")
    c.add_argument("--replication", type=int, default=config.DEFAULT_REPLICATION,
                   help="copies R: the broker's and R-1 backups' (1-8, default: %(default)s)")
    c.add_argument("--durability", choices=["memory", "disk"], default=config.DEFAULT_DURABILITY,
                   help="backups acknowledge from memory or after fsync (default: %(default)s)")
    c.add_argument("--group-segments", type=int, default=config.DEFAULT_GROUP_SEGMENTS,
                   help="segments per group G (default: %(default)s)")
    c.add_argument("--segment-size-bytes", type=_size, default=config.DEFAULT_SEGMENT_SIZE_BYTES,
                   help="segment capacity (default: %(default)s)")
    c.add_argument("--replication-capacity", type=int, default=0,
                   help="virtual logs the stream may use, 0 = all (default: %(default)s)")
    _retention_arguments(c, default=0)
    _cleanup_arguments(c)
    c.add_argument("--partitioner", default=None, choices=sorted(PARTITIONERS),
                   help="how clients that name no partitioner place keys: crc32c (the default) "
                        "or murmur2 (as Kafka's clients do); fixed for the stream's life")
    c.add_argument("--no-wait", action="store_true",
                   help="return once created, without waiting for the brokers")
    c.set_defaults(func=cmd_stream_create)

    a = ssub.add_parser("alter", parents=opts,
                        help="change a stream's retention, cleanup policy or streamlet count",
                        description="Change a stream's retention or cleanup policy, or raise "
                                    "its streamlet count, "
                                    "and wait until its brokers apply it. New streamlets go to "
                                    "the least loaded live brokers. As with Kafka partitions, "
                                    "the count only grows, and keyed records map over the new "
                                    "count: a key's later records may go to another streamlet "
                                    "than its earlier ones, so per-key order holds only within "
                                    "each side of the change.")
    a.add_argument("name", help="stream name")
    _retention_arguments(a, default=None)
    _cleanup_arguments(a)
    a.add_argument("--streamlets", type=int, default=None, metavar="N",
                   help="raise the streamlet count to N (clients use the new streamlets "
                        "within their metadata max age, 30 s by default)")
    a.add_argument("--no-wait", action="store_true",
                   help="return once changed, without waiting for the brokers")
    a.set_defaults(func=cmd_stream_alter)

    d = ssub.add_parser("describe", parents=opts, help="show a stream's descriptor")
    d.add_argument("name", help="stream name")
    d.set_defaults(func=cmd_stream_describe)

    ls = ssub.add_parser("list", parents=opts, help="list streams")
    ls.set_defaults(func=cmd_stream_list)

    rm = ssub.add_parser("delete", parents=opts, help="delete a stream")
    rm.add_argument("name", help="stream name")
    rm.set_defaults(func=cmd_stream_delete)


def _add_cluster(sub) -> None:
    p = sub.add_parser("cluster", parents=[_admin_options()],
                       help="list brokers and backups known to the coordinator",
                       description="Show every registered broker and backup and whether it "
                                   "is alive.")
    p.add_argument("--replicas", action="store_true",
                   help="also list which backups hold each broker's virtual segments")
    p.set_defaults(func=cmd_cluster)
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    d = csub.add_parser("deregister", parents=[_options_after_subcommand()],
                        help="forget a dead broker or backup",
                        description="Remove a dead daemon from the cluster's metadata (its id is "
                                    "never reused). Refused while it is alive, or while a broker "
                                    "still owns streamlets or is a source of a recovery.")
    which = d.add_mutually_exclusive_group(required=True)
    which.add_argument("--broker", type=int, metavar="ID", help="the broker id to forget")
    which.add_argument("--backup", type=int, metavar="ID", help="the backup id to forget")
    d.set_defaults(func=cmd_cluster_deregister)
    r = csub.add_parser("rebalance", parents=[_options_after_subcommand()],
                        help="move streamlets to restarted or added brokers",
                        description="Even out streamlets per broker. Each step hands one "
                                    "loaded broker's replicated streamlets over as at a restart: "
                                    "they spread over every live broker and are recovered from "
                                    "their replicas (each answers not_ready, which clients retry, "
                                    "for its recovery). Steps run one after another until no "
                                    "step makes the spread smaller. R=1 streamlets never move. "
                                    "The coordinator also does this on its own once brokers are "
                                    "steady, unless started with --no-auto-rebalance.")
    r.add_argument("--dry-run", action="store_true",
                   help="show the next step's plan without moving anything")
    r.add_argument("--wait-s", type=float, default=DEFAULT_REBALANCE_TIMEOUT_S, metavar="S",
                   help="give up after this long, steps and recoveries included "
                        "(default: %(default)s)")
    r.set_defaults(func=cmd_cluster_rebalance)


def _add_stats(sub) -> None:
    p = sub.add_parser("stats", parents=[_admin_options()],
                       help="counters of the coordinator and every live broker and backup",
                       description="Ask every live daemon for its counters and print them "
                                   "grouped by daemon kind and topic, each group with a legend, "
                                   "a unit column and one column per daemon (--json: raw). "
                                   "--streams: one row per stream instead, its traffic added up "
                                   "over the brokers (since they started, or per second over "
                                   "--interval-s).")
    p.add_argument("--streams", action="store_true",
                   help="per-stream traffic: records, chunks and bytes in and out")
    p.add_argument("--interval-s", type=float, default=None, metavar="S",
                   help="with --streams: sample twice, S seconds apart, and print rates per "
                        "second instead of totals")
    p.set_defaults(func=cmd_stats)


def _add_produce(sub) -> None:
    p = sub.add_parser("produce", parents=[_client_options()],
                       help="append lines from stdin to a stream",
                       description="Read lines from stdin and append each as one record "
                                   "(the line without its newline is the value).")
    p.add_argument("stream", help="stream name")
    p.add_argument("--key-sep", default=None,
                   help="split each line at the first SEP into key and value "
                        "(a line without SEP has no key)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                   help="producer option, e.g. -o linger_ms=20 (repeatable)")
    p.add_argument("--partitioner", default=None, choices=sorted(PARTITIONERS),
                   help="how keys map to streamlets: crc32c or murmur2 (as Kafka's clients do, "
                        "so a key lands where a Kafka producer puts it); default: the "
                        "stream's own (kera stream describe)")
    p.add_argument("--quiet", action="store_true", help="do not print the record count")
    p.add_argument("-H", "--header", action="append", default=[], metavar="KEY=VALUE",
                   help="a header on every record (repeatable; kcat's -H)")
    p.add_argument("-z", "--compression", choices=["lz4", "zstd"], default=None,
                   help="compress chunks (consumers decompress transparently)")
    p.add_argument("-f", "--format", default=None, metavar="FMT",
                   help="how each line is read, as kera consume -f prints it: %%s value, "
                        "%%k key, %%T timestamp (ms since the epoch; empty: now), %%h headers "
                        "(k=v,k=v), text between fields, \\t tab; the last field takes the "
                        "rest of the line. E.g. -f '%%T\\t%%h\\t%%k\\t%%s'")
    p.set_defaults(func=cmd_produce)


def _add_consume(sub) -> None:
    p = sub.add_parser("consume", parents=[_client_options()],
                       help="print a stream's records to stdout",
                       description="Read a stream and write each record's value as one line.")
    p.add_argument("stream", help="stream name")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--from", dest="start", choices=["earliest", "latest"], default="latest",
                       help="start at the first record or after the last (default: %(default)s)")
    start.add_argument("--from-time", default=None, metavar="TIME",
                       help="start at each streamlet's first record at or after TIME: "
                            "milliseconds since the epoch or ISO 8601 (no zone: UTC)")
    p.add_argument("--max-records", type=int, default=None,
                   help="exit after this many records")
    p.add_argument("--group", default=None, metavar="GROUP",
                   help="read as a member of this consumer group (kafka-console-consumer "
                        "--group): share the streamlets with its other members, resume from "
                        "its committed positions (--from for a new group), and commit what "
                        "was printed on exit")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="exit when no record arrives for this long (default: never)")
    p.add_argument("--print-key", action="store_true",
                   help="print KEY<sep>VALUE (separator from --key-sep)")
    p.add_argument("--key-sep", default="\t", help="separator for --print-key (default: tab)")
    p.add_argument("-f", "--format", default=None, metavar="FMT",
                   help="kcat-style output per record (overrides --print-key): %%s value, "
                        "%%k key, %%t stream, %%S streamlet, %%g group, %%o offset, "
                        "%%n record number, "
                        "%%T timestamp (ms), %%h headers (k=v,k=v), %%%% a percent sign; \\n newline, \\t tab. "
                        "E.g. -f '%%S %%g:%%o %%k=%%s\\n'")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                   help="consumer option, e.g. -o cache_chunks_max=64 (repeatable)")
    p.set_defaults(func=cmd_consume)


# ---------------------------------------------------------------------- commands

def _retention_arguments(p, default) -> None:
    p.add_argument("--retention-ms", type=duration_ms, default=default, metavar="DURATION",
                   help="delete whole groups whose last record is older than this (7d, 12h, "
                        "500ms, or milliseconds), 0 = keep forever"
                        + (" (default: %(default)s)" if default is not None else ""))
    p.add_argument("--retention-bytes", type=_size, default=default,
                   help="per streamlet, delete the oldest groups beyond this size (e.g. 1GiB), "
                        "0 = no limit" + (" (default: %(default)s)" if default is not None else ""))
    p.add_argument("--retain-until-consumed", action=argparse.BooleanOptionalAction,
                   default=False if default is not None else None,
                   help="delete by age only what every consumer group has committed past "
                        "(with --retention-ms 0: as soon as it has); --retention-bytes still "
                        "bounds the size")


def _cleanup_arguments(p) -> None:
    """Kafka's cleanup.policy and compaction settings (kera.codec.cleanup); unset: the
    coordinator's default on create, unchanged on alter."""
    p.add_argument("--cleanup-policy", default=None, metavar="POLICY",
                   help="delete (retention deletes old groups; the default), compact (keep the "
                        "last record of each key: every record needs a key) or compact,delete")
    p.add_argument("--min-cleanable-dirty-ratio", type=float, default=None, metavar="RATIO",
                   help="compact a streamlet once this share of its closed bytes is superseded "
                        f"(0-1, default {cleanup.DEFAULT_MIN_CLEANABLE_DIRTY_RATIO})")
    p.add_argument("--delete-retention-ms", type=duration_ms, default=None, metavar="DURATION",
                   help="keep a tombstone (null value) this long after compaction first kept "
                        "it (7d, 12h, 500ms, or milliseconds; default 1d)")
    p.add_argument("--min-compaction-lag-ms", type=duration_ms, default=None, metavar="DURATION",
                   help="never compact records younger than this (default 0)")
    p.add_argument("--max-compaction-lag-ms", type=duration_ms, default=None, metavar="DURATION",
                   help="compact records older than this whatever the dirty ratio, 0 = no "
                        "maximum (default 0)")


def _cleanup_options(args) -> dict:
    return {"cleanup_policy": args.cleanup_policy,
            **{name: getattr(args, name) for name in cleanup.SETTINGS}}


def cmd_stream_create(args) -> int:
    from kera.errors import StreamExists
    try:
        return _create_stream(args)
    except StreamExists:
        if not args.if_not_exists:
            raise
    print(f"stream '{args.name}' exists already; left as it is", file=sys.stderr)
    return 0


def _create_stream(args) -> int:
    with _admin(args) as admin:
        stream = admin.create_stream(
            args.name, streamlets=args.streamlets, active_groups=args.active_groups,
            replication=args.replication, group_segments=args.group_segments,
            segment_size_bytes=args.segment_size_bytes, durability=args.durability,
            replication_capacity=args.replication_capacity, retention_ms=args.retention_ms,
            retention_bytes=args.retention_bytes, wait_ready=not args.no_wait,
            retain_until_consumed=args.retain_until_consumed, partitioner=args.partitioner,
            **_cleanup_options(args))
    if args.json:
        _print_json(stream)
    else:
        print(f"created stream '{stream['name']}' (id {stream['id']}): "
              f"{stream['streamlets']} streamlets on brokers "
              f"{', '.join(sorted(stream['brokers'], key=int))}, replication "
              f"{stream['replication']}, {'ready' if stream['ready'] else 'not ready yet'}")
    return 0


def cmd_stream_describe(args) -> int:
    with _admin(args) as admin:
        stream = admin.describe_stream(args.name)
    if args.json:
        _print_json(stream)
        return 0
    streamlets = ("placement", "brokers", "states", "recovering")
    width = max(len(k) for k in stream)
    for key in stream:
        if key not in streamlets:
            print(f"{key:<{width}}  {stream[key]}")
    print()
    print(_streamlet_table(args, stream))
    return 0


def _streamlet_table(args, stream: dict) -> str:
    """Each streamlet's owner, state and durable end in records (asked of its broker)."""
    from kera.consumer import Consumer
    states = stream.get("states") or ["?"] * stream["streamlets"]
    rows, failed = [], {}   # a broker that did not answer is not asked again
    with Consumer(args.bootstrap, stream["name"], streamlets=[],
                  request_timeout_s=min(args.timeout_s, 2.0)) as c:
        for sl, owner in enumerate(stream["placement"]):
            end = "-"
            if states[sl] == "serving" and owner not in failed:
                try:
                    end = c.watermarks(stream["name"], sl)[1]
                except KeraError as err:
                    failed[owner] = f"? ({err.code})"
            end = failed.get(owner, end)
            rows.append([sl, owner, stream["brokers"].get(str(owner), "-"), states[sl], end])
    return _table(["STREAMLET", "OWNER", "ADDRESS", "STATE", "DURABLE END (records)"], rows)


def _readiness(stream: dict) -> str:
    """READY: "yes" only when every streamlet is served; else what keeps it from being so."""
    states = stream.get("states", [])
    down = [state for state in ("offline", "recovering") if state in states]
    if down:
        return f"no ({states.count(down[0])} {down[0]})"
    return "yes" if stream["ready"] else "no"


def cmd_stream_list(args) -> int:
    with _admin(args) as admin:
        streams = admin.list_streams()
    if args.json:
        _print_json(streams)
        return 0
    rows = [[s["name"], s["id"], s["streamlets"], s["active_groups"], s["replication"],
             s["durability"], _readiness(s), ",".join(sorted(s["brokers"], key=int))]
            for s in streams]
    print(_table(["NAME", "ID", "STREAMLETS", "GROUPS", "R", "DURABILITY", "READY", "BROKERS"],
                 rows))
    return 0


def cmd_stream_alter(args) -> int:
    with _admin(args) as admin:
        stream = admin.alter_stream(args.name, retention_ms=args.retention_ms,
                                    retention_bytes=args.retention_bytes,
                                    wait_ready=not args.no_wait,
                                    retain_until_consumed=args.retain_until_consumed,
                                    streamlets=args.streamlets, **_cleanup_options(args))
    if args.json:
        _print_json(stream)
    else:
        print(f"altered stream '{stream['name']}': {stream['streamlets']} streamlets, "
              f"retention_ms {stream.get('retention_ms', 0)}, "
              f"retention_bytes {stream.get('retention_bytes', 0)}, "
              f"cleanup_policy {stream.get('cleanup_policy', cleanup.DEFAULT_POLICY)}, "
              f"{'ready' if stream['ready'] else 'not ready yet'}")
    return 0


def cmd_stream_delete(args) -> int:

    with _admin(args) as admin:
        admin.delete_stream(args.name)
    if not args.json:
        print(f"deleted stream '{args.name}'")
    return 0


def cmd_cluster(args) -> int:
    with _admin(args) as admin:
        cluster = admin.cluster()
        if args.replicas:
            cluster["replicas"] = admin.replicas()
    if args.json:
        _print_json(cluster)
        return 0
    rows = [[kind[:-1], m["id"], m["address"], m["node"], "yes" if m["alive"] else "NO"]
            for kind in ("brokers", "backups") for m in cluster[kind]]
    print(_table(["KIND", "ID", "ADDRESS", "NODE", "ALIVE"], rows))
    print(f"metadata version {cluster['metadata_version']}, cluster id "
          f"{cluster.get('cluster_id', '-')}")
    if args.replicas:
        rows = [[b, vlog, vseg, ",".join(map(str, backups)) or "-"]
                for b, vlog, vseg, backups in cluster["replicas"]]
        print()
        print(_table(["BROKER", "VLOG", "VSEG", "BACKUPS"], rows))
    return 0


def cmd_cluster_deregister(args) -> int:
    kind, daemon_id = ("broker", args.broker) if args.broker is not None else ("backup", args.backup)
    with _admin(args) as admin:
        reply = admin.deregister(kind, daemon_id)
    if args.json:
        _print_json(reply)
    else:
        print(f"deregistered {kind} {daemon_id}")
    return 0


def cmd_cluster_rebalance(args) -> int:
    with _admin(args) as admin:
        if args.dry_run:
            reply = admin.rebalance(dry_run=True)
            _print_json(reply) if args.json else print(_rebalance_line(reply))
            return 0
        said: list = [None]

        def progress(reply: dict) -> None:
            line = _rebalance_line(reply)
            if line != said[0] and not args.json:
                print(line, flush=True)
            said[0] = line

        steps = admin.rebalance_all(args.wait_s, progress)
    if args.json:
        _print_json({"steps": steps})
    else:
        print(f"balanced after {len(steps)} step{'s' * (len(steps) != 1)}")
    return 0


def _rebalance_line(reply: dict) -> str:
    loads = ", ".join(f"broker {b}: {n}" for b, n in reply["loads"].items())
    if reply.get("started"):
        return (f"step: broker {reply['broker']} hands {reply['moves']} streamlets over "
                f"(spread {reply['spread']} -> {reply['spread_after']})")
    if reply["busy"]:
        return f"waiting: {reply['busy']}"
    if reply["broker"] is None:
        return f"streamlets per broker: {loads} (spread {reply['spread']}): balanced"
    return (f"streamlets per broker: {loads} (spread {reply['spread']}); next step: broker "
            f"{reply['broker']} hands {reply['moves']} streamlets over (spread -> "
            f"{reply['spread_after']})")


def cmd_stats(args) -> int:
    if args.streams:
        return _stream_stats(args)
    if args.interval_s is not None:
        raise SystemExit("kera stats: --interval-s goes with --streams")
    with _admin(args) as admin:
        stats = admin.stats()
    if args.json:
        _print_json(stats)
        return 0
    from kera.cli.stats_view import render
    print(render(stats))
    return 0


def _stream_stats(args) -> int:
    from kera.cli.stats_view import render_streams
    if args.interval_s is not None and not 0 < args.interval_s <= STATS_INTERVAL_S_MAX:
        raise SystemExit(f"kera stats: --interval-s must be in (0, {STATS_INTERVAL_S_MAX:.0f}]")
    with _admin(args) as admin:
        first = admin.stream_traffic()
        if args.interval_s is None:
            result, per_s = first, None
        else:
            time.sleep(args.interval_s)
            result, per_s = admin.stream_traffic(), args.interval_s
    if per_s is not None:
        result = {"streams": _rates(first["streams"], result["streams"], per_s),
                  "errors": result["errors"], "interval_s": per_s}
    if args.json:
        _print_json(result)
    else:
        print(render_streams(result["streams"], per_s is not None))
    for broker, error in sorted(result["errors"].items()):
        print(f"broker {broker} did not answer: {error} (its traffic is missing)", file=sys.stderr)
    return 0


def _rates(before: dict, after: dict, seconds: float) -> dict:
    """Per second, what each counter grew by between two samples (a broker that restarted in
    between counts from zero again: a negative difference is taken as the new total)."""
    out = {}
    for name, now in after.items():
        then = before.get(name, {})
        out[name] = {k: round((v - then.get(k, 0) if v >= then.get(k, 0) else v) / seconds, 1)
                     for k, v in now.items()}
    return out




def _options(pairs: list[str]) -> dict:
    """`-o name=value` pairs as keyword arguments (ints, floats and booleans parsed)."""
    out = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.isidentifier():
            raise CliError(f"option must be NAME=VALUE, not {pair!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        out[name] = value
    return out


def cmd_produce(args) -> int:
    from kera.producer import Producer
    parse = _line_reader(args)
    count = 0
    producer = Producer(args.bootstrap, compression=args.compression,
                        **{"partitioner": args.partitioner, **_options(args.option)})
    try:
        for line in sys.stdin.buffer:
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            record = parse(line)
            producer.send(args.stream, record.value, key=record.key, headers=record.headers,
                          timestamp_ms=record.timestamp_ms)
            count += 1
        producer.flush()
    finally:
        producer.close()
    if not args.quiet:
        print(f"produced {count} records to '{args.stream}'", file=sys.stderr)
    return 0


def _line_reader(args):
    """How one line becomes a record: --format, else [KEY<sep>]VALUE; -H headers on each."""
    from kera.cli.line_format import ParsedLine, compile_parser
    headers = [_header(h) for h in args.header]
    if args.format is not None:
        if args.key_sep is not None:
            raise CliError("give --format or --key-sep, not both (%k in the format is the key)")
        parse = compile_parser(args.format)

        def read(line: bytes) -> ParsedLine:
            record = parse(line)
            return record._replace(headers=headers + record.headers)
        return read
    sep = args.key_sep.encode() if args.key_sep else None

    def split(line: bytes) -> ParsedLine:
        if sep is not None:
            k, found, v = line.partition(sep)
            if found:
                return ParsedLine(v, k, None, headers)
        return ParsedLine(line, None, None, headers)
    return split


def _header(pair: str) -> tuple[str, bytes]:
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise CliError(f"--header must be KEY=VALUE, not {pair!r}")
    return key, value.encode()


def _line_writer(args):
    """How one record is written: --format, else [KEY<sep>]VALUE and a newline."""
    if args.format is not None:
        from kera.cli.line_format import compile_format
        return compile_format(args.format)
    sep = args.key_sep.encode()
    if args.print_key:
        return lambda r: (r.key or b"") + sep + (r.value or b"") + b"\n"
    return lambda r: (r.value or b"") + b"\n"  # a tombstone prints as an empty line


def cmd_consume(args) -> int:
    from kera.consumer import Consumer
    from kera.codec.timestamps import parse_time_ms
    if args.max_records is not None and args.max_records < 0:
        raise CliError("--max-records must not be negative")
    out = sys.stdout.buffer
    line = _line_writer(args)
    count = 0
    if args.max_records == 0:
        return 0
    from_ms = None if args.from_time is None else parse_time_ms(args.from_time)
    if args.group is not None and from_ms is not None:
        raise CliError("--from-time and --group: a group resumes from its committed positions "
                       "(move them with kera group reset-positions --to-datetime)")
    consumer = Consumer(args.bootstrap, args.stream, start=args.start, group=args.group,
                        **_options(args.option))
    records = _records if args.group is None else _records_one_by_one
    try:
        if from_ms is not None:
            consumer.seek_to_time(from_ms)
        try:
            for record in records(consumer, args.timeout_s):
                out.write(line(record))
                count += 1
                if args.max_records is not None and count >= args.max_records:
                    break
                if args.timeout_s is not None:
                    out.flush()  # a reader waiting on an idle stream sees what arrived
        except KeyboardInterrupt:
            pass   # Ctrl-C ends a group read normally: what was printed is committed below
        out.flush()
        if args.group is not None:
            consumer.commit()
            print(f"committed {count} records' positions in group '{args.group}'",
                  file=sys.stderr)
    finally:
        consumer.close()
    return 0


def _records_one_by_one(consumer, idle_timeout_s: float | None):
    """Records one poll at a time, so a group's positions cover exactly what was printed
    (a batch is handed out whole), ending after `idle_timeout_s` without one."""
    while True:
        record = consumer.poll(timeout_s=idle_timeout_s)
        if record is None:
            return
        yield record


def _records(consumer, idle_timeout_s: float | None):
    """The consumer's records, read as whole batches (whose records carry their headers); with
    a timeout, ends after that long without one."""
    while True:
        batches = consumer.poll_batch(timeout_s=idle_timeout_s)
        if not batches:
            return
        for batch in batches:
            yield from batch.records()


# How often `kera local` looks for daemons that exited (and restarts those that are due).
SUPERVISE_INTERVAL_S = 0.2


def cmd_local(args) -> int:
    from kera.cli.local import ClusterError, LocalCluster
    if args.brokers < 0 or args.backups < 0:
        raise CliError("--brokers and --backups must not be negative")
    stop = _stop_on_signals()
    try:
        cluster = LocalCluster(args.dir, port=args.port, brokers=args.brokers,
                               backups=args.backups, virtual_logs=args.virtual_logs,
                               log_level=args.log_level,
                               heartbeat_interval_ms=args.heartbeat_interval_ms,
                               start_timeout_s=args.start_timeout_s, secure=args.secure,
                               extra_coordinator_args=["--no-auto-rebalance"]
                               if args.no_auto_rebalance else [], kafka_port=args.kafka_port)
    except ClusterError as exc:
        raise CliError(f"the local cluster did not start: {exc}") from None
    try:
        print(cluster.bootstrap, flush=True)
        print(cluster.summary(), flush=True)
        if cluster.kafka_bootstrap:
            print(cluster.kafka_summary(), flush=True)
        if cluster.keys is not None:
            print(f"secure (CURVE): keys in {cluster.keys.dir}\n  admin key:  {cluster.keys.admin}"
                  f"\n  client key: {cluster.keys.client} (needs grants: kera acl add)\n"
                  f"  e.g. export {KEY_FILE_ENV}={cluster.keys.admin}", flush=True)
        print("Ctrl-C to stop", file=sys.stderr, flush=True)
        supervisor = cluster.supervisor()
        while not stop:
            time.sleep(SUPERVISE_INTERVAL_S)
            cluster.supervise(supervisor, time.monotonic())
    finally:
        log.info("stopping the local cluster")
        cluster.stop()
    print("stopped", file=sys.stderr)
    return 0


def _stop_on_signals() -> list:
    """A list that becomes truthy on SIGINT or SIGTERM."""
    stop: list = []

    def handler(signum, frame):
        stop.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


# ---------------------------------------------------------------------- entry point

def _probe_bootstrap(args) -> None:
    """Tell a refused port, an unknown host and a silent address apart within PROBE_TIMEOUT_S
    rather than after the request timeout (zmq connects lazily and would just wait)."""
    bootstrap = getattr(args, "bootstrap", None)
    if not bootstrap:
        return
    from kera.net.coordinators import parse_addresses
    from kera.net.probe import probe
    first = None
    for address in parse_addresses(bootstrap):   # one answering is enough, as for the library
        try:
            probe(address)
            return
        except KeraError as err:
            first = first or err
    raise first


def _explain(err: KeraError, args) -> str:
    """A broker or backup given as the coordinator answers "unknown op": say so."""
    if err.code == "bad_request" and err.message.startswith("unknown op"):
        return (f"{getattr(args, 'bootstrap', 'the address')} is a kera daemon but not the "
                f"coordinator (a broker or backup?): give the coordinator's host:port with "
                f"--bootstrap ({err.message})")
    return err.message


def main(argv: list[str] | None = None) -> int:
    from kera.cli.local import watch_parent_from_env
    watch_parent_from_env()
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "key_file", None):
        # Every connection this command opens (kera.net.rpc) authenticates with it.
        os.environ[KEY_FILE_ENV] = str(args.key_file)
    level = getattr(args, "log_level", "WARNING")
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in DAEMONS and not getattr(args, "unavailable", False):
        gc_policy.tune_daemon()   # a process of kera's own: see kera.daemon.gc_policy
        malloc_policy.tune_daemon()   # and kera.daemon.malloc_policy
        file_limit.tune_daemon()      # and kera.daemon.file_limit
    try:
        _probe_bootstrap(args)
        return int(args.func(args) or 0)
    except KeraError as err:
        print(f"kera: error: {_explain(err, args)} ({err.code})", file=sys.stderr)
        return EXIT_ERROR
    except CliError as err:
        print(f"kera: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout closed by the reader (`kera consume ... | head`): not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
