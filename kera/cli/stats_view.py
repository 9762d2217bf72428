"""`kera stats` as a reader wants it: counters grouped by daemon kind and by what they are
about, each group headed by a one-line legend, with a unit column and one column per daemon.

Pure: `render(stats)` takes what `Admin.stats()` returns ({"coordinator": {...}, "brokers":
{id: {...}}, "backups": {id: {...}}}) and returns the text, ending with one row per compacted
stream (the brokers' `compaction_streams`, added up); `render_streams` takes
`Admin.stream_traffic()["streams"]` (`kera stats --streams`): one row per stream. Nothing here
talks to a daemon.
"""

from __future__ import annotations

# Per daemon kind: (group, legend, name prefixes that belong to it). First match wins; a
# counter matching none is shown under "other", so a new counter is never hidden.
GROUPS: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "coordinator": [
        ("requests", "requests answered since start, by op",
         ("requests_",)),
        ("membership", "registered daemons, how many are alive, and failovers run",
         ("brokers", "backups", "failovers", "streamlets_recovering")),
        ("metadata", "streams, the metadata version and the cost of persisting it",
         ("streams", "metadata_", "snapshots", "persist", "replica_entries")),
    ],
    "broker": [
        ("produce", "what producers appended since start; duplicates absorbed; requests waiting",
         ("chunks_appended", "bytes_appended", "duplicates", "pending_produce", "producer_")),
        ("reads", "fetch requests answered and what they sent; fetches held until records came",
         ("fetch_",)),
        ("replication", "copies sent to backups, and how far acknowledged data is ahead of them",
         ("replication_", "chunks_per_replication", "durable_lag", "writes_in_flight",
          "live_backups", "virtual_")),
        ("memory and tiering", "memory held, segments resident/mapped, data moved to disk",
         ("memory_", "tier", "segments_", "retention_")),
        ("recovery", "recovery of dead brokers' streamlets run by this broker",
         ("recovery_",)),
        ("compaction", "passes over compacted streams swapped in, record bytes before and after, "
         "their time (per stream: below)",
         ("compaction_",)),
        ("metadata", "streams this broker serves and the metadata version it applied",
         ("streams", "metadata_")),
    ],
    "backup": [
        ("replication in", "copies received from brokers since start; refused or repeated ones",
         ("replicate_", "chunks_received", "bytes_received", "chunks_rejected",
          "repeated_chunks", "chunks_per_replicate", "throttled")),
        ("flushing and disk", "data written to disk, what still waits in memory, disk use",
         ("flush", "unflushed", "disk_", "storage_errors", "memory_")),
        ("reads", "replica reads served (recovery of a dead broker's streamlets)",
         ("reads", "read_")),
        ("replicas", "replicas held, open, on disk, failed; registration",
         ("replicas", "registered", "backup_id")),
    ],
}
OTHER = ("other", "counters without a group yet")
KIND_TITLES = {"coordinator": "coordinator", "brokers": "broker", "backups": "backup"}
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
KIB = 1024


def render(stats: dict) -> str:
    """Every daemon kind present in `stats` as grouped tables (see the module docstring)."""
    compacted = compaction_streams(stats.get("brokers") or {})
    stats = {**stats, "brokers": {b: _without(s, COMPACTION_STREAMS)
                                  for b, s in (stats.get("brokers") or {}).items()}}
    sections = []
    for key, kind in KIND_TITLES.items():
        columns = _columns(key, stats.get(key))
        if columns:
            sections.append(_section(kind, columns))
    if compacted:
        sections.append(render_compaction(compacted))
    return "\n\n".join(sections)


def _without(d, key: str):
    return {k: v for k, v in d.items() if k != key} if isinstance(d, dict) else d


# The brokers' per compacted stream counters (kera.broker.compaction_service.stats): summed
# over brokers, since a stream's streamlets may live on several; the ratio is recomputed from
# the summed clean and dirty bytes.
COMPACTION_STREAMS = "compaction_streams"
COMPACTION_SUMMED = ("clean_bytes", "dirty_bytes", "passes", "bytes_before", "bytes_after",
                     "seconds")
COMPACTION_COLUMNS = (("dirty_ratio", "dirty ratio"), ("dirty_bytes", "dirty"),
                      ("clean_bytes", "clean"), ("passes", "passes"),
                      ("bytes_before", "bytes before"), ("bytes_after", "bytes after"),
                      ("seconds", "pass time s"))


def compaction_streams(brokers: dict) -> dict[str, dict]:
    """{stream: summed counters and its dirty ratio} over the brokers' stats."""
    out: dict[str, dict] = {}
    for s in brokers.values():
        rows = s.get(COMPACTION_STREAMS) if isinstance(s, dict) else None
        for name, row in (rows or {}).items():
            into = out.setdefault(name, dict.fromkeys(COMPACTION_SUMMED, 0))
            for f in COMPACTION_SUMMED:
                value = row.get(f, 0)
                into[f] += value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
    for row in out.values():
        total = row["clean_bytes"] + row["dirty_bytes"]
        row["dirty_ratio"] = row["dirty_bytes"] / total if total else 0.0
    return out


def render_compaction(streams: dict[str, dict]) -> str:
    """One row per compacted stream, by name."""
    legend = ("per compacted stream, over the live brokers: dirty share of what a pass may "
              "reach now; passes since start, bytes they rewrote before/after, their time")
    header = ["stream", *(title for _, title in COMPACTION_COLUMNS)]
    rows = [[name, *(_compaction_cell(f, streams[name][f]) for f, _ in COMPACTION_COLUMNS)]
            for name in sorted(streams)]
    return "== compacted streams ==\n\n" + legend + "\n" + _table(header, rows, left=1)


def _compaction_cell(field: str, value) -> str:
    if field == "dirty_ratio":
        return f"{value:.3f}"
    if field == "seconds":
        return f"{value:,.2f}"
    return format_value(field, value)


def _columns(key: str, part) -> dict[str, dict]:
    """Daemon name -> its flat counters."""
    if not part:
        return {}
    if key == "coordinator":
        return {"coordinator": _flatten(part)}
    kind = KIND_TITLES[key]
    return {f"{kind}-{i}": _flatten(c) for i, c in sorted(part.items(), key=lambda kv: int(kv[0]))}


def _section(kind: str, columns: dict[str, dict]) -> str:
    names = sorted({n for c in columns.values() for n in c})
    lines = [f"== {kind}s ==" if kind != "coordinator" else "== coordinator =="]
    for group, legend, members in _grouped(kind, names):
        rows = [[n, unit_of(n, _first(columns, n)), *(format_value(n, c.get(n)) for c in columns.values())]
                for n in members]
        lines += ["", f"{group}: {legend}", _table(["COUNTER", "UNIT", *columns], rows)]
    return "\n".join(lines)


def _grouped(kind: str, names: list[str]) -> list[tuple[str, str, list[str]]]:
    groups = GROUPS.get(kind, [])
    out = {g: [] for g, _, _ in groups}
    out[OTHER[0]] = []
    for n in names:
        group = next((g for g, _, prefixes in groups if n.startswith(prefixes)), OTHER[0])
        out[group].append(n)
    legends = {g: legend for g, legend, _ in groups} | {OTHER[0]: OTHER[1]}
    return [(g, legends[g], members) for g, members in out.items() if members]


def unit_of(name: str, value) -> str:
    """The unit a counter's name says (suffix), else what its value is."""
    if isinstance(value, bool):
        return "yes/no"
    if "bytes" in name.split("_"):      # unflushed_bytes, bytes_appended
        return "bytes"
    if name.endswith(("_ms", "_ms_total")):
        return "ms"
    if name.endswith(("_s", "_seconds")):
        return "s"
    if "_per_" in name:
        return "ratio"
    if name.endswith(("_version", "_id")):
        return "id"
    return "count"


def format_value(name: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if unit_of(name, value) == "bytes" and isinstance(value, (int, float)):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; below 1 KiB the exact count."""
    if abs(n) < KIB:
        return f"{int(n)} B"
    for unit in BYTE_UNITS[1:]:
        n /= KIB
        if abs(n) < KIB or unit == BYTE_UNITS[-1]:
            return f"{n:,.1f} {unit}"
    raise AssertionError("unreachable")


def _first(columns: dict[str, dict], name: str):
    return next((c[name] for c in columns.values() if c.get(name) is not None), None)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _table(header: list[str], rows: list[list[str]], left: int = 2) -> str:
    """The first `left` columns (name and unit) left-aligned, values right-aligned."""
    cells = [header, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in cells)


STREAM_COLUMNS = (("records_in", "records in"), ("chunks_in", "chunks in"),
                  ("bytes_in", "bytes in"), ("chunks_out", "chunks out"),
                  ("bytes_out", "bytes out"))


def render_streams(streams: dict[str, dict], per_second: bool) -> str:
    """One row per stream (busiest first by bytes in), its traffic totals or rates."""
    if not streams:
        return "no stream has traffic on a live broker"
    suffix = "/s" if per_second else ""
    header = ["stream", "", *(title + suffix for _, title in STREAM_COLUMNS)]
    order = sorted(streams, key=lambda n: (-streams[n].get("bytes_in", 0), n))
    rows = [[name, "", *(format_value(field, streams[name].get(field, 0))
                         for field, _ in STREAM_COLUMNS)] for name in order]
    legend = ("per stream, added up over the live brokers: records and chunks appended "
              "(in) and chunks fetched by readers (out)")
    legend += ", per second" if per_second else ", since each broker started"
    return legend + "\n" + _table(header, rows)
