"""What a broker tells the coordinator about where its virtual segments are replicated.

The coordinator keeps, per broker, which backups hold each virtual segment (so recovery knows
where a dead broker's data is). The broker reports changes only: a virtual log notes every
virtual segment whose backup set changed (a replica chosen, dropped or replaced) in
`VirtualLog.placement_changed`; each heartbeat carries up to REPORT_ENTRIES_MAX of them as
`vsegs` entries `[vlog, vseg, [backup ids]]` (`vseg` as named on the wire: the log's
`vseg_base`, from the broker's epoch, plus the segment's number), and an entry is forgotten
once a heartbeat that carried it was answered and the set has not changed since (a lost
heartbeat just reports it again). The coordinator drops a broker's map when the broker registers, so after every
registration the broker reports all its virtual segments again (`report_all`).
"""

from __future__ import annotations

REPORT_ENTRIES_MAX = 1024   # `vsegs` entries per heartbeat (keeps the header small)


def backups_of(vs) -> list[int]:
    return [r.backup_id for r in vs.replicas if r is not None]


def _base(vlog) -> int:
    return getattr(vlog, "vseg_base", 0)


def pending(vlogs, limit: int = REPORT_ENTRIES_MAX) -> list[list]:
    """Up to `limit` entries `[vlog, vseg, [backup ids]]` not yet acknowledged, oldest first."""
    out: list[list] = []
    for vlog in vlogs:
        for vs in vlog.placement_changed.values():
            if len(out) >= limit:
                return out
            out.append([vlog.id, _base(vlog) + vs.number, backups_of(vs)])
    return out


def acknowledged(vlogs, entries) -> None:
    """The coordinator stored `entries` (as returned by `pending`): forget those unchanged since."""
    by_id = {vlog.id: vlog for vlog in vlogs}
    for vlog_id, wire_number, backups in entries:
        vlog = by_id.get(vlog_id)
        if vlog is None:
            continue
        number = wire_number - _base(vlog)
        vs = vlog.placement_changed.get(number)
        if vs is not None and backups_of(vs) == backups:
            del vlog.placement_changed[number]


def report_all(vlogs) -> None:
    """Report every virtual segment again (after a registration: the coordinator forgot them)."""
    for vlog in vlogs:
        for vs in vlog.vsegs:
            vlog.placement_changed[vs.number] = vs
