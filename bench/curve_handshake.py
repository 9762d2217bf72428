"""What a CURVE connection costs to open: connect + first request, plaintext vs CURVE, side by side.

    python -m bench.curve_handshake --connections 200

Starts two one-broker local clusters (one `secure`), then alternates: open a connection to the
coordinator, send `cluster`, wait for the reply, close; the medians and p99s of each and their
difference are the handshake's price per connection (CURVE adds a 4-message handshake with
Curve25519 key agreement, and the daemon's ZAP lookup).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from kera.net import rpc
from kera.cli.local import LocalCluster


def open_and_ask(bootstrap: str, key_file: str | None) -> float:
    started = time.perf_counter()
    with rpc.Connection(bootstrap, timeout_s=10.0, key_file=key_file) as conn:
        conn.call("cluster")
    return (time.perf_counter() - started) * 1000


def measure(connections: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kera-handshake-") as tmp:
        with LocalCluster(f"{tmp}/plain", log_level="WARNING") as plain, \
                LocalCluster(f"{tmp}/curve", log_level="WARNING", secure=True) as curve:
            runs = {"plaintext": [], "curve": []}
            for _ in range(connections):   # alternating, so machine noise hits both alike
                runs["plaintext"].append(open_and_ask(plain.bootstrap, None))
                runs["curve"].append(open_and_ask(curve.bootstrap, curve.key_file))
    return {name: {"median_ms": statistics.median(v),
                   "p99_ms": sorted(v)[int(0.99 * (len(v) - 1))]} for name, v in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.curve_handshake", description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=200, help="connections per mode (default: %(default)s)")
    args = p.parse_args(argv)
    out = measure(args.connections)
    for name, v in out.items():
        print(f"{name:10s} connect + first request: median {v['median_ms']:.2f} ms, p99 {v['p99_ms']:.2f} ms")
    extra = out["curve"]["median_ms"] - out["plaintext"]["median_ms"]
    print(f"CURVE handshake adds {extra:.2f} ms per connection (median; "
          f"{out['curve']['median_ms'] / out['plaintext']['median_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
