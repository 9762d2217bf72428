"""A quick TCP probe of an address, so a client can say at once why it cannot reach a daemon.

ZeroMQ connects lazily and retries in the background: a refused port, an unknown host and a
silent address all look like a request timeout (10 s) to it. One plain TCP connect, bounded by
PROBE_TIMEOUT_S, tells them apart before the first request is sent.
"""
from __future__ import annotations

import socket

from kera.errors import PeerUnreachable

# The first byte of a ZMTP 3 greeting, which every ZeroMQ peer (every kera daemon) sends as soon
# as a connection is accepted.
ZMTP_SIGNATURE_FIRST_BYTE = b"\xff"

# A TCP handshake on a LAN takes well under a millisecond and across regions a few hundred;
# 2 s leaves room for a loaded host while keeping "nothing listens" a two-second answer.
PROBE_TIMEOUT_S = 2.0


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return if something accepts TCP connections at "host:port"; raise PeerUnreachable with
    the reason (unknown host, connection refused, timed out) and what to check otherwise."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            _expect_greeting(sock, address, timeout_s)
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


def _expect_greeting(sock: socket.socket, address: str, timeout_s: float) -> None:
    """Something accepted the connection: a kera daemon greets at once; a proxy or another
    service that accepts and stays silent (or says something else) is named here."""
    try:
        first = sock.recv(1)
    except (socket.timeout, TimeoutError):
        raise PeerUnreachable(f"{address}: accepted the connection but sent no ZeroMQ greeting "
                              f"within {timeout_s} s: not a kera daemon (or a proxy in the "
                              f"way); check the address") from None
    if first != ZMTP_SIGNATURE_FIRST_BYTE:
        raise PeerUnreachable(f"{address}: answered but is not a kera daemon (no ZeroMQ "
                              f"greeting); check the address")
