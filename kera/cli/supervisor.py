"""`kera local`'s supervisor: a daemon that exits is started again, after a back-off that
doubles with each quick failure, and given up once it keeps failing. Sans-IO: the caller
reports exits and starts with the time and asks what is due.

As systemd's `Restart=on-failure` with `RestartSec` and a start limit: a crash is survived
without anyone watching, while a daemon that cannot start (a bad flag, data of another
cluster) is not restarted in a tight loop for ever. The embedded cluster is what people try
first, so it should keep running as a service would.
"""

from __future__ import annotations

from dataclasses import dataclass

from kera.net.backoff import Backoff

# First wait before a restart; each restart that follows a short run doubles it, up to the max.
RESTART_BACKOFF_MIN_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_BACKOFF = Backoff(int(RESTART_BACKOFF_MIN_S * 1000), int(RESTART_BACKOFF_MAX_S * 1000))
# A daemon that ran this long before exiting counts as healthy: its back-off starts over.
STABLE_RUN_S = 60.0
# Restarts after short runs in a row before giving up on a daemon (about 2.5 min of trying).
QUICK_RESTARTS_MAX = 8
# Exit code of a daemon refusing its command line (argparse): restarting cannot help.
USAGE_EXIT_CODE = 2


@dataclass
class _Record:
    started_s: float
    quick_restarts: int = 0
    restart_at_s: float | None = None
    given_up: bool = False


class Supervisor:
    def __init__(self):
        self._records: dict[str, _Record] = {}

    def started(self, name: str, now: float) -> None:
        record = self._records.get(name)
        if record is None:
            self._records[name] = _Record(now)
        else:
            record.started_s, record.restart_at_s = now, None

    def exited(self, name: str, code: int | None, now: float) -> str:
        """Note an exit; returns what will happen, for the log."""
        record = self._records.setdefault(name, _Record(now))
        if code == USAGE_EXIT_CODE:
            record.given_up = True
            return "not restarted: it refused its command line"
        if now - record.started_s >= STABLE_RUN_S:
            record.quick_restarts = 0
        if record.quick_restarts >= QUICK_RESTARTS_MAX:
            record.given_up = True
            return f"not restarted: it failed {QUICK_RESTARTS_MAX} times in a row"
        record.quick_restarts += 1
        wait_s = RESTART_BACKOFF.delay_s(record.quick_restarts)
        record.restart_at_s = now + wait_s
        return f"restarting in {wait_s:.0f} s (attempt {record.quick_restarts})"

    def due(self, now: float) -> list[str]:
        """Names whose restart time has come."""
        return [name for name, r in self._records.items()
                if not r.given_up and r.restart_at_s is not None and now >= r.restart_at_s]

    def waiting(self, name: str) -> bool:
        """Whether an exit of `name` was already noted (a restart pending or given up)."""
        record = self._records.get(name)
        return record is not None and (record.restart_at_s is not None or record.given_up)
