"""The flags every daemon (coordinator, broker, backup) shares, parsed in one place.

`add_common_arguments(parser, ...)` adds --host, --port, --advertise, --coordinator,
--metrics-port and --log-level with the same names, defaults, checks and help everywhere;
`setup_logging(args)` applies --log-level. Sizes are written one way in every flag of every
command (`536870912`, `64MiB`, `1GiB`: kera.broker.memory.parse_size): give such a flag
`type=size_bytes`.
"""

from __future__ import annotations

import argparse
import re
import logging
import sys

from kera.broker.memory import parse_size

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_HOST = "127.0.0.1"   # loopback unless the operator chooses to expose the daemon
# TCP port numbers; 0 asks the system for any free port (or, for --metrics-port, turns it off).
PORT_MAX = 65535


def size_bytes(text: str) -> int:
    """An argparse `type`: bytes from a size as operators write it (`512MiB`, `1GiB`, `4096`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)?\s*$")
_DURATION_MS = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
                "w": 604_800_000}


def duration_ms(text: str) -> int:
    """An argparse `type`: milliseconds from a duration as operators write it (`604800000`,
    `7d`, `12h`, `30m`, `45s`, `500ms`; a bare number is milliseconds, as Kafka's *.ms)."""
    m = _DURATION.match(str(text))
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (examples: 500ms, 45s, "
                                         f"30m, 12h, 7d, or milliseconds: 604800000)")
    return int(float(m.group(1)) * _DURATION_MS[m.group(2)])


def port_number(text: str) -> int:
    """An argparse `type`: a TCP port, 0 to PORT_MAX."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= PORT_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to {PORT_MAX})")
    return port


def count(text: str) -> int:
    """An argparse `type`: a whole number, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")
    return n


def add_common_arguments(parser: argparse.ArgumentParser, *, default_port: int = 0,
                         coordinator: bool = True, advertise: bool = True) -> None:
    """The shared daemon flags. `coordinator`: the daemon registers with one (--coordinator,
    required); `advertise`: it tells others an address of its own (--advertise)."""
    if coordinator:
        parser.add_argument("--coordinator", required=True, metavar="HOST:PORT[,...]",
                            help="the coordinator's address; with several coordinators on "
                                 "etcd, all of them (the daemon follows the leader)")
        parser.add_argument("--cluster-id", default=None, metavar="ID",
                            help="join only the cluster with this id (`kera cluster` "
                                 "shows it): a coordinator of another cluster at the "
                                 "--coordinator address refuses this daemon, which exits 1")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="interface to bind (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=default_port,
                        help="port to bind (default: " +
                             ("%(default)s)" if default_port else "any free port)"))
    if advertise:
        parser.add_argument("--advertise", default=None, metavar="HOST:PORT",
                            help="the address others reach this daemon at: given to the "
                                 "coordinator, or by a standby coordinator naming the leader "
                                 "(default: HOST:bound port)")
    parser.add_argument("--metrics-port", type=port_number, default=0,
                        help="serve Prometheus metrics on this port (default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="address the metrics endpoint binds: plaintext HTTP that names "
                             "streams and groups, so loopback unless asked (default: "
                             "%(default)s; 0.0.0.0 for a scraper on another host)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="log level on stderr (default: %(default)s)")


def setup_logging(args: argparse.Namespace) -> None:
    """Log to stderr at --log-level, in the one format every daemon writes."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format=LOG_FORMAT)
