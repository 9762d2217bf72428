"""Counters a daemon exposes: through its `stats` op and as a Prometheus text endpoint."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

log = logging.getLogger(__name__)


class Counters(dict):
    """Named numeric counters; `add` and `set` are the only writers."""

    def add(self, name: str, amount: int | float = 1) -> None:
        self[name] = self.get(name, 0) + amount

    def set(self, name: str, value: int | float) -> None:
        self[name] = value


def prometheus_text(prefix: str, stats: dict, labels: dict | None = None) -> str:
    label_text = ""
    if labels:
        label_text = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    lines = []
    for name, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric = f"{prefix}_{name}".replace(".", "_").replace("-", "_")
        lines.append(f"# TYPE {metric} gauge")
        lines.append(f"{metric}{label_text} {value}")
    return "\n".join(lines) + "\n"


def labelled_text(prefix: str, label: str, rows: dict[str, dict]) -> str:
    """Prometheus text of {label value: {name: number}}: one gauge `prefix_name` per name with
    one sample per label value (e.g. a broker's per-stream traffic)."""
    samples: dict[str, list[str]] = {}
    for value, stats in sorted(rows.items()):
        for name, number in stats.items():
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                samples.setdefault(name, []).append(
                    f'{prefix}_{name}{{{label}="{label_value(value)}"}} {number}')
    lines = []
    for name in sorted(samples):
        lines += [f"# TYPE {prefix}_{name} gauge", *samples[name]]
    return "\n".join(lines) + "\n" if lines else ""


def label_value(value: str) -> str:
    """A label value as Prometheus' text format wants it (backslash, quote, newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def serve_metrics(port: int, prefix: str, snapshot: Callable[[], dict], labels: dict | None = None,
                  host: str = "127.0.0.1",
                  extra: Callable[[], str] | None = None) -> ThreadingHTTPServer:
    """Serve `GET /metrics` on a daemon thread. `snapshot` must be safe to call from that thread
    (return a copy taken under the daemon's own lock, or a dict the loop replaces whole);
    `extra`, if given, returns more Prometheus text (labelled gauges) to append."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server naming)
            if self.path.rstrip("/") not in ("", "/metrics"):
                self.send_error(404)
                return
            text = prometheus_text(prefix, dict(snapshot()), labels)
            body = (text + (extra() if extra is not None else "")).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name=f"{prefix}-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, httpd.server_address[1])
    return httpd
