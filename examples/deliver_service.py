"""A read model fed by `kera.services.deliver.deliverer`: account balances kept exactly right from a stream of
deposits, plus a copy of the stream pushed to an HTTP service.

The balances are a custom Target: `apply` adds each deposit to its account AND records the
last applied position per streamlet in ONE SQLite transaction, and `last_applied` reads those
positions back. So however often the deliverer is killed or the database fails, a deposit is
counted exactly once: after a crash, delivery resumes right after the last committed one.
The HTTP copy uses the reference receiver (examples/deliver_receiver.py) in a thread.

    kera local --dir /tmp/kera &            # a cluster at 127.0.0.1:7000
    python examples/deliver_service.py --bootstrap 127.0.0.1:7000 --deposits 1000

It prints each account's balance, then "balances match the N deposits".
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the reference receiver next door

from deliver_receiver import Receiver  # noqa: E402

from kera.client.admin import Admin  # noqa: E402
from kera.services.deliver.deliverer import Deliverer  # noqa: E402
from kera.services.deliver.http import HttpTarget  # noqa: E402
from kera.errors import StreamExists  # noqa: E402
from kera.cli.local import free_port  # noqa: E402
from kera.codec.position import Position  # noqa: E402
from kera.producer import Producer  # noqa: E402

ACCOUNTS = ["ada", "grace", "edsger", "barbara"]
WAIT_S = 60.0                # the deposits are applied within it, or the example fails
POLL_S = 0.1


class BalanceTarget:
    """Balances per account, and the last applied position per streamlet, in one database."""

    def __init__(self, path: str):
        self.name = f"balances:{path}"
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("CREATE TABLE IF NOT EXISTS balance (account TEXT PRIMARY KEY, "
                        "cents INTEGER NOT NULL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS applied (stream TEXT, streamlet INTEGER, "
                        "grp INTEGER, off INTEGER, PRIMARY KEY (stream, streamlet))")
        self.db.commit()

    def last_applied(self) -> dict:
        rows = self.db.execute("SELECT stream, streamlet, grp, off FROM applied").fetchall()
        return {(st, sl): Position(st, sl, g, o) for st, sl, g, o in rows}

    def apply(self, records) -> None:
        with self.db:   # one transaction: the deposits and where they end, or nothing
            for r in records:
                self.db.execute("INSERT INTO balance VALUES (?, ?) ON CONFLICT (account) DO "
                                "UPDATE SET cents = cents + excluded.cents",
                                (r.key.decode(), int(r.value)))
                self.db.execute("INSERT OR REPLACE INTO applied VALUES (?, ?, ?, ?)",
                                (r.stream, r.streamlet, r.group, r.offset))

    def balances(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT account, cents FROM balance").fetchall())

    def close(self) -> None:
        pass   # the connection lives as long as the example


def deposit(bootstrap: str, stream: str, count: int) -> dict[str, int]:
    """Send `count` deposits; the balances they should add up to."""
    expected = dict.fromkeys(ACCOUNTS, 0)
    with Producer(bootstrap) as producer:
        for i in range(count):
            account, cents = ACCOUNTS[i % len(ACCOUNTS)], 100 + i
            producer.send(stream, str(cents).encode(), key=account.encode())
            expected[account] += cents
        producer.flush()
    return expected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default="127.0.0.1:7000")
    parser.add_argument("--stream", default="deposits", help="a new stream to create")
    parser.add_argument("--deposits", type=int, default=1_000)
    args = parser.parse_args()
    try:
        Admin(args.bootstrap).create_stream(args.stream, streamlets=2)
    except StreamExists:
        print(f"stream '{args.stream}' exists: give a new --stream (the balances start at 0)")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kera-deliver-example-"))
    receiver = Receiver(free_port(), str(workdir / "http.db"))
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    balances = BalanceTarget(str(workdir / "balances.db"))
    http = HttpTarget(f"http://127.0.0.1:{receiver.server_address[1]}/")
    expected = deposit(args.bootstrap, args.stream, args.deposits)
    with Deliverer(args.bootstrap, args.stream, [balances, http]):
        deadline = time.monotonic() + WAIT_S
        while balances.balances() != expected and time.monotonic() < deadline:
            time.sleep(POLL_S)
    for account, cents in sorted(balances.balances().items()):
        print(f"{account:8} {cents / 100:10.2f}")
    if balances.balances() != expected:
        print(f"balances do not match the {args.deposits} deposits: {expected}")
        return 1
    print(f"balances match the {args.deposits} deposits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
