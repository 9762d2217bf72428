"""What every `kera` command shares: its one-line error, the Admin it opens, sizes as written,
and printing (tables, JSON)."""

from __future__ import annotations

import json


class CliError(Exception):
    """A problem with the command line's input, reported as one line."""


def size(text: str) -> int:
    """A size flag's value in the one size syntax (536870912, 64MiB, 1GiB) of parse_size."""
    from kera.daemon.flags import size_bytes
    return size_bytes(text)


def admin(args):
    from kera.client.admin import Admin
    return Admin(args.bootstrap, timeout_s=args.timeout_s)


def coordinator_call(args, op: str, **fields) -> dict:
    """One request of the leading coordinator of --bootstrap, with the command's timeout and
    key; its reply header."""
    from kera.client.coordinator_client import CoordinatorClient
    client = CoordinatorClient(args.bootstrap, timeout_s=args.timeout_s,
                               key_file=getattr(args, "key_file", None))
    try:
        return client.call(op, fields)[0]
    finally:
        client.close()


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def table(header: list[str], rows: list[list], right: bool = False) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])]
        for i in range(1, len(row)):
            parts.append(row[i].rjust(widths[i]) if right else row[i].ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
