"""What bench/test_core.py measured, for the summary table printed at the end of the session."""

from __future__ import annotations

import statistics

# name -> {"records": int per round, "bytes": wire bytes per round, "seconds": [per round]}
RESULTS: dict[str, dict] = {}
CEILING = "raw pyzmq ceiling (same bytes)"
INGEST = "send_batch (acknowledged)"


def record(name: str, records: int, wire_bytes: int, seconds: float) -> None:
    entry = RESULTS.setdefault(name, {"records": records, "bytes": wire_bytes, "seconds": []})
    entry["seconds"].append(seconds)


def rates(name: str) -> tuple[float, float] | None:
    """(records/s, wire bytes/s) of the median round."""
    entry = RESULTS.get(name)
    if not entry or not entry["seconds"]:
        return None
    s = statistics.median(entry["seconds"])
    return entry["records"] / s, entry["bytes"] / s


def table() -> str:
    if not RESULTS:
        return ""
    ceiling = rates(CEILING)
    lines = ["kera core benchmarks (1 broker, R=1, 100-byte values, 16 KiB chunks; median round)",
             f"{'measurement':42s} {'records/s':>12s} {'MB/s':>9s} {'of ceiling':>11s} rounds"]
    for name, entry in RESULTS.items():
        rec_s, bytes_s = rates(name)
        frac = f"{bytes_s / ceiling[1]:.1%}" if ceiling and name != CEILING else ""
        shown = "-" if name == CEILING else f"{rec_s:,.0f}"
        lines.append(f"{name:42s} {shown:>12s} {bytes_s / 1e6:9.1f} {frac:>11s} "
                     f"{len(entry['seconds'])}")
    ingest = rates(INGEST)
    if ceiling and ingest:
        lines.append(f"kera ingest = {ingest[1] / ceiling[1]:.1%} of the raw pyzmq ceiling "
                     f"for equal bytes")
    return "\n".join(lines)
