"""An order service using the transactional outbox: each order and its "order placed" event are
written in ONE database transaction, and a harvester publishes the events to stream `orders`.

The service never talks to kera: it commits the business row and the outbox row together, so
an event exists exactly when its order does (a rolled-back order publishes nothing), and the
harvester (here in a thread; in production `kera outbox run` processes) publishes each event
once, in order per customer (the row key).

Run it against a PostgreSQL database and a kera cluster:

    kera local --dir /tmp/kera &            # a cluster at 127.0.0.1:7000
    python examples/outbox_service.py --dsn "host=127.0.0.1 dbname=postgres user=postgres" \
        --bootstrap 127.0.0.1:7000 --orders 100

It prints each event read back from the stream, then "published N of N orders".
"""

from __future__ import annotations

import argparse
import json
import random
import threading

import psycopg

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.errors import StreamExists
from kera.services.outbox.harvester import Harvester
from kera.services.outbox.db import create_schema

ORDERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
  id        bigserial PRIMARY KEY,
  customer  text NOT NULL,
  amount    numeric(10, 2) NOT NULL
)"""
CUSTOMERS = ["ada", "grace", "edsger", "barbara"]
ROLLBACK_EVERY = 10          # every 10th order is rolled back: it must never be published
READ_TIMEOUT_S = 30.0        # reading the events back


class Rejected(Exception):
    """The order was refused after its rows were written: the transaction rolls back."""


def place_order(conn: psycopg.Connection, customer: str, amount: float, reject: bool) -> None:
    """The business change and its event, committed together (or not at all)."""
    try:
        with conn.transaction():
            order_id = conn.execute("INSERT INTO orders (customer, amount) VALUES (%s, %s) "
                                    "RETURNING id", (customer, amount)).fetchone()[0]
            event = {"order": order_id, "customer": customer, "amount": amount}
            conn.execute("INSERT INTO outbox (key, value, header_keys, header_values) "
                         "VALUES (%s, %s, %s, %s)",
                         (customer, json.dumps(event).encode(), ["type"], [b"order-placed"]))
            if reject:
                raise Rejected(f"order {order_id} refused")
    except Rejected:
        pass


def setup(dsn: str, bootstrap: str, stream: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(ORDERS_SCHEMA)
        create_schema(conn, "outbox")
    with Admin(bootstrap) as admin:
        try:
            admin.create_stream(stream, streamlets=2)
        except StreamExists:
            pass


def read_events(bootstrap: str, stream: str, expected: int) -> int:
    seen = 0
    with Consumer(bootstrap, stream, start="earliest") as consumer:
        while seen < expected:
            record = consumer.poll(READ_TIMEOUT_S)
            if record is None:
                break
            print(dict(record.headers)["type"].decode(), json.loads(record.value))
            seen += 1
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="PostgreSQL connection string")
    parser.add_argument("--bootstrap", default="127.0.0.1:7000", help="kera coordinator")
    parser.add_argument("--stream", default="orders", help="stream the events go to")
    parser.add_argument("--orders", type=int, default=100, help="orders to place")
    args = parser.parse_args()
    setup(args.dsn, args.bootstrap, args.stream)
    harvester = Harvester(args.dsn, args.bootstrap, args.stream)
    thread = threading.Thread(target=harvester.run, daemon=True)
    thread.start()
    with psycopg.connect(args.dsn) as conn:
        for i in range(args.orders):
            place_order(conn, random.choice(CUSTOMERS), round(random.uniform(5, 500), 2),
                        reject=(i % ROLLBACK_EVERY == ROLLBACK_EVERY - 1))
    committed = args.orders - args.orders // ROLLBACK_EVERY
    seen = read_events(args.bootstrap, args.stream, committed)
    harvester.stop()
    thread.join()
    print(f"published {seen} of {committed} orders")


if __name__ == "__main__":
    main()
