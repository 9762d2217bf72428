"""A reference HTTP receiver for `kera deliver --target http://...` (contract: kera.services.deliver.http).

    python examples/deliver_receiver.py --port 8080 --db received.db
    kera deliver --bootstrap 127.0.0.1:7000 --stream orders --target http://127.0.0.1:8080/

It keeps what it receives in a SQLite file through kera's SqliteTarget, so a POSTed batch and
its last applied (record number and position) are stored in one transaction, and it skips
records at or below its last applied (a retried batch may arrive twice). `fail(True)` makes it answer 503, to
test a target that is down for a while.
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kera.services.deliver.core import TargetCursor
from kera.services.deliver.http import applied_to_json, records_from_json
from kera.services.deliver.targets import SqliteTarget


class Receiver(ThreadingHTTPServer):
    """An HTTP server storing batches into `db_path`; requests are applied one at a time."""

    daemon_threads = True

    def __init__(self, port: int, db_path: str, host: str = "127.0.0.1"):
        super().__init__((host, port), _Handler)
        self.store = SqliteTarget(db_path)
        self.lock = threading.Lock()   # one batch at a time: skip-then-apply must not race
        self.failing = False           # True: answer every request 503 (a target that is down)
        self.posts = 0

    def applied_json(self) -> bytes:
        with self.lock:
            return applied_to_json(self.store.last_applied())

    def fail(self, failing: bool) -> None:
        """Start or stop answering 503; no batch is being applied once this returns."""
        with self.lock:
            self.failing = failing

    def apply_json(self, body: bytes) -> bool:
        """Store a POSTed batch; False (nothing stored) while failing."""
        with self.lock:
            if self.failing:
                return False
            cursor = TargetCursor("receiver")
            cursor.resumed(self.store.last_applied())
            fresh = cursor.fresh(records_from_json(body))
            if fresh:
                self.store.apply(fresh)
            self.posts += 1
            return True


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def _answer(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.server.failing:
            return self._answer(503)
        self._answer(200, self.server.applied_json())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(204 if self.server.apply_json(body) else 503)

    def log_message(self, *args) -> None:
        pass   # one line per batch is noise; failures reach the deliverer's log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--db", default="received.db", help="SQLite file to store into")
    args = parser.parse_args()
    Receiver(args.port, args.db).serve_forever()


if __name__ == "__main__":
    main()
