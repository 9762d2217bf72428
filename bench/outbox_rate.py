"""Outbox rows harvested per second: a PostgreSQL outbox table drained into a kera stream.

    python -m bench.outbox_rate [--rows N] [--keys K] [--in-flight-max M]

Starts a PostgreSQL server (tests.postgres_cluster) and a local cluster (one broker), fills the
outbox table with N rows over K keys (committed before harvesting starts), then times one
Harvester (in this process) from its start to the table being empty: election, takeover,
marking, publishing (at most one row per key in flight, M overall), acknowledgements and
purges included. The stream is then read back to check every row arrived once.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from kera.consumer import Consumer
from kera.cli.local import LocalCluster
from kera.services.outbox.harvester import Harvester
from kera.services.outbox.db import create_schema

TABLE = STREAM = "outbox_rate"
STREAMLETS = 4
DRAIN_POLL_S = 0.01
DRAIN_TIMEOUT_S = 600.0
INSERT_BATCH = 1_000
VALUE = b"x" * 100           # a typical small event


def fill(server, rows: int, keys: int) -> None:
    with server.connect() as conn:
        create_schema(conn, TABLE)
        with conn.cursor() as cur:
            for start in range(0, rows, INSERT_BATCH):
                cur.executemany(f"INSERT INTO {TABLE} (key, value) VALUES (%s, %s)",
                                [(f"k{n % keys}", VALUE)
                                 for n in range(start, min(start + INSERT_BATCH, rows))])
        conn.commit()


def drain_seconds(server, harvester: Harvester) -> float:
    started = time.perf_counter()
    thread = threading.Thread(target=harvester.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    with server.connect(autocommit=True) as conn:
        while conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]:
            if time.monotonic() > deadline:
                raise SystemExit(f"outbox not drained in {DRAIN_TIMEOUT_S} s")
            time.sleep(DRAIN_POLL_S)
    elapsed = time.perf_counter() - started
    harvester.stop()
    thread.join()
    return elapsed


def stored(bootstrap: str) -> int:
    """Records in the stream (every streamlet's high watermark)."""
    with Consumer(bootstrap, STREAM) as consumer:
        return sum(consumer.watermarks(STREAM, sl)[1] for sl in range(STREAMLETS))


def main(argv: list[str] | None = None) -> None:
    from tests.postgres_cluster import PostgresServer, postgres_bin_dir
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--in-flight-max", type=int, default=1_000)
    args = parser.parse_args(argv)
    bin_dir, why = postgres_bin_dir()
    if bin_dir is None:
        raise SystemExit(f"no PostgreSQL: {why}")
    server = PostgresServer(bin_dir).start()
    try:
        with tempfile.TemporaryDirectory() as tmp, \
                LocalCluster(Path(tmp), log_level="WARNING") as cluster:
            cluster.admin().create_stream(STREAM, streamlets=STREAMLETS)
            fill(server, args.rows, args.keys)
            harvester = Harvester(server.dsn, cluster.bootstrap, STREAM, table=TABLE,
                                  in_flight_max=args.in_flight_max)
            elapsed = drain_seconds(server, harvester)
            print(f"{args.rows} rows over {args.keys} keys, in_flight_max "
                  f"{args.in_flight_max}: drained in {elapsed:.2f} s = "
                  f"{args.rows / elapsed:,.0f} rows/s harvested; "
                  f"{stored(cluster.bootstrap)} records in the stream")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
