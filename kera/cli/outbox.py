"""`kera outbox init|run`: create a PostgreSQL outbox table, and harvest it into a stream.

    kera outbox init --dsn "host=db dbname=shop" --table outbox
    kera outbox run --dsn "host=db dbname=shop" --bootstrap 127.0.0.1:7000 --stream orders

Run as many `kera outbox run` processes per table as wanted: one leads and publishes, the others
wait to take over (kera.services.outbox.harvester). psycopg is imported only when a command runs.
"""

from __future__ import annotations

import argparse

from kera.services.outbox import defaults
from kera.daemon.stop_signal import stop_on_sigterm
from kera.cli.output import CliError

RUN_DESCRIPTION = """\
Publish the rows of a PostgreSQL outbox table to a kera stream, then delete them. Services
insert rows (key, value, optional headers) into the table in the same transaction as their
business change; this command publishes each committed row exactly once, in id order per key.

Start several for availability: they elect one leader through the consumer group --group
(control stream GROUP.leader); the others wait. A leader that cannot reach the coordinator
steps down before its --session-timeout-ms ends, and another takes over within about that time.
Logs (at INFO, the default here) say when this process became leader, when it stepped down, what
it settled at takeover and how many rows it published every 10 s."""


def add_parser(sub, client_options) -> None:
    p = sub.add_parser("outbox", help="harvest a PostgreSQL outbox table into a stream",
                       description="The transactional outbox: a PostgreSQL table whose rows "
                                   "are published to a stream (kera.services.outbox.harvester).")
    osub = p.add_subparsers(dest="outbox_command", metavar="ACTION", required=True)
    i = osub.add_parser("init", help="create the outbox table (and its checkpoint table)",
                        description="Create the outbox table TABLE and TABLE_leaders if missing.")
    _db_options(i)
    i.set_defaults(func=cmd_init)
    r = osub.add_parser("run", parents=[client_options()], help="harvest the table (foreground)",
                        description=RUN_DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _db_options(r)
    _run_options(r)
    r.set_defaults(func=cmd_run, log_level="INFO")


def _db_options(p) -> None:
    p.add_argument("--dsn", required=True,
                   help='PostgreSQL connection string ("host=H port=P dbname=D user=U" or a '
                        'postgresql:// URL)')
    p.add_argument("--table", default=defaults.TABLE,
                   help="outbox table name (default: %(default)s)")


def _run_options(p) -> None:
    p.add_argument("--stream", required=True, help="stream to publish to (must exist)")
    p.add_argument("--group", default=None,
                   help="consumer group electing the leader (default: kera-outbox.TABLE)")
    p.add_argument("--in-flight-max", type=int, default=defaults.IN_FLIGHT_MAX,
                   help="rows sent and not yet acknowledged, at most (one per key; default: "
                        "%(default)s)")
    p.add_argument("--marked-max", type=int, default=defaults.MARKED_MAX,
                   help="rows marked and held in memory, at most (default: %(default)s)")
    p.add_argument("--poll-interval-ms", type=int, default=defaults.POLL_INTERVAL_MS,
                   help="how often an empty table is polled (default: %(default)s)")
    p.add_argument("--session-timeout-ms", type=int, default=defaults.SESSION_TIMEOUT_MS,
                   help="leader lease: a silent leader is replaced after it (default: "
                        "%(default)s)")
    p.add_argument("--checkpoint-interval-s", type=float, default=defaults.CHECKPOINT_INTERVAL_S,
                   help="how often the leader records the stream's end, bounding what a "
                        "successor reads to find rows published but not deleted (default: "
                        "%(default)s)")


def cmd_init(args) -> int:
    import psycopg
    from kera.services.outbox.db import create_schema
    try:
        with psycopg.connect(args.dsn, connect_timeout=defaults.DB_CONNECT_TIMEOUT_S) as conn:
            create_schema(conn, args.table)
    except psycopg.Error as err:
        raise CliError(f"cannot create outbox table '{args.table}': {err}".strip()) from err
    print(f"outbox table '{args.table}' ready (and '{args.table}_leaders')")
    return 0


def cmd_run(args) -> int:
    from kera.services.outbox.harvester import Harvester
    harvester = Harvester(args.dsn, args.bootstrap, args.stream, table=args.table,
                          group=args.group, in_flight_max=args.in_flight_max,
                          marked_max=args.marked_max, poll_interval_ms=args.poll_interval_ms,
                          session_timeout_ms=args.session_timeout_ms,
                          checkpoint_interval_s=args.checkpoint_interval_s,
                          key_file=args.key_file)
    stop_on_sigterm(harvester.stop)
    harvester.run()
    return 0
