"""A quick TCP probe of an address, so a client can say at once why it cannot reach a daemon.

ZeroMQ connects lazily and retries in the background: a refused port, an unknown host and a
silent address all look like a request timeout (10 s) to it. One plain TCP connect, bounded by
PROBE_TIMEOUT_S, tells them apart before the first request is sent.
"""
from __future__ import annotations

import socket

from kera.errors import PeerUnreachable

# A TCP handshake on a LAN takes well under a millisecond and across regions a few hundred;
# 2 s leaves room for a loaded host while keeping "nothing listens" a two-second answer.
PROBE_TIMEOUT_S = 2.0


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return if something accepts TCP connections at "host:port"; raise PeerUnreachable with
    the reason (unknown host, connection refused, timed out) and what to check otherwise."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except socket.gaierror as exc:
        raise PeerUnreachable(f"{address}: unknown host {host!r} ({exc.strerror}); "
                              f"check the host name") from None
    except ConnectionRefusedError:
        raise PeerUnreachable(f"{address}: connection refused (nothing listens on port {port}); "
                              f"is the daemon running, and is the port right?") from None
    except (socket.timeout, TimeoutError):
        raise PeerUnreachable(f"{address}: timed out after {timeout_s} s connecting (no answer: "
                              f"a firewall, or a host that is down)") from None
    except OSError as exc:
        raise PeerUnreachable(f"{address}: cannot connect ({exc.strerror or exc})") from None
