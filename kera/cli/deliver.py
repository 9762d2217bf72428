"""`kera deliver`: push a stream to SQL databases and HTTP endpoints, exactly once each.

    kera deliver --bootstrap 127.0.0.1:7000 --stream orders \\
        --target sqlite:orders.db --target postgresql://u@db/shop --target http://svc:8080/kera

psycopg is imported only when a PostgreSQL target is given.
"""

from __future__ import annotations

import argparse

from kera import config
from kera.services.deliver import core
from kera.services.deliver.targets import DEFAULT_TABLE_PREFIX
from kera.daemon.stop_signal import stop_on_sigterm
from kera.cli.output import CliError

DESCRIPTION = """\
Deliver every record of a stream to each target exactly once, in order per streamlet
(kera.services.deliver.deliverer). Each target stores the record number and position of the last record it
applied per streamlet, in the same transaction as the records; on start and after any failure
delivery to it resumes from there, so this command can be killed and restarted at any time.
Each target has its own reader: a slow or failing target is retried with backoff (and given up
after --retries-max consecutive failures) while the others go on. A target whose next record
is not numbered right after its last (retention deleted records it never got) is given up at
once, with the numbers in the log.

Targets:
  sqlite:PATH                 SQLite file; tables PREFIX_records and PREFIX_applied
  postgresql://... (or postgres://..., or "host=... dbname=...")
                              PostgreSQL; the same two tables
  http://URL, https://URL     POST JSON batches (Idempotency-Key header), GET last applied;
                              contract in kera/services/deliver/http.py, receiver in
                              examples/deliver_receiver.py

Logs (at INFO, the default here) say where each target resumes, each failure and retry, and
every --progress-interval-s per target: records applied, and "caught up" or "lagging by M"."""


def add_parser(sub, client_options) -> None:
    p = sub.add_parser("deliver", parents=[client_options()],
                       help="deliver a stream to SQL databases / HTTP endpoints, exactly once",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", required=True, help="stream to deliver (1 active group)")
    p.add_argument("--target", action="append", required=True, metavar="SPEC",
                   help="sqlite:PATH, postgresql://..., http(s)://...; repeat for several")
    p.add_argument("--table-prefix", default=DEFAULT_TABLE_PREFIX,
                   help="SQL targets' table name prefix (default: %(default)s)")
    p.add_argument("--batch-records-max", type=int, default=core.BATCH_RECORDS_MAX,
                   help="records per target transaction / POST, at most (default: %(default)s)")
    p.add_argument("--retries-max", type=int, default=core.RETRIES_MAX,
                   help="consecutive failures before a target is given up (default: "
                        "%(default)s; backoff doubling from 0.1 s to 5 s)")
    p.add_argument("--progress-interval-s", type=float, default=core.PROGRESS_INTERVAL_S,
                   help="how often each target's progress is logged (default: %(default)s)")
    p.add_argument("--fetch-wait-ms", type=float, default=config.DEFAULT_FETCH_WAIT_MS,
                   help="an idle reader asks again after this long a broker that did not hold "
                        "its fetch until records came (brokers of this kera hold it up to "
                        f"{config.DEFAULT_FETCH_MAX_WAIT_MS} ms; default: %(default)s)")
    p.set_defaults(func=cmd_deliver, log_level="INFO")


def target_from_spec(spec: str, table_prefix: str = DEFAULT_TABLE_PREFIX):
    """The Target a --target SPEC names."""
    if spec.startswith("sqlite:"):
        from kera.services.deliver.targets import SqliteTarget
        return SqliteTarget(spec[len("sqlite:"):], table_prefix)
    if spec.startswith(("postgresql://", "postgres://")) or "dbname=" in spec:
        from kera.services.deliver.targets import PostgresTarget
        return PostgresTarget(spec, table_prefix)
    if spec.startswith(("http://", "https://")):
        from kera.services.deliver.http import HttpTarget
        return HttpTarget(spec)
    raise CliError(f"unknown target {spec!r}: use sqlite:PATH, postgresql://... or http://...")


def cmd_deliver(args) -> int:
    from kera.services.deliver.deliverer import Deliverer
    targets = [target_from_spec(spec, args.table_prefix) for spec in args.target]
    deliverer = Deliverer(args.bootstrap, args.stream, targets,
                          batch_records_max=args.batch_records_max, retries_max=args.retries_max,
                          progress_interval_s=args.progress_interval_s, key_file=args.key_file,
                          fetch_wait_ms=args.fetch_wait_ms)
    stop_on_sigterm(deliverer.stop_event.set)
    deliverer.start()
    try:
        deliverer.wait()
    except KeyboardInterrupt:
        pass
    deliverer.stop()
    given_up = [name for name, s in deliverer.status().items() if s["gave_up"]]
    return 1 if given_up else 0
