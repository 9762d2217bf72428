"""Which silent daemons the coordinator declares dead, and when it suspects that it is the
one cut off. Sans-IO: `DeathWatch.due(live, now)` is asked by `Coordinator.tick`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kera.coordinator.core import Member

log = logging.getLogger(__name__)

# The coordinator may be the one cut off: when it has at least ISOLATION_MEMBERS_MIN live
# daemons and has heard none of them for ISOLATION_QUIET_DEAD_WINDOWS of a dead window,
# declaring the silent ones dead would fail every streamlet over to no one (found on test
# hosts: a partitioned coordinator declared the whole cluster dead). "Heard none lately", not
# "all past the dead window in one tick": heartbeats are staggered by up to an interval, so
# the daemons cross the window in different ticks (found on test hosts too). It holds such
# declarations for at most ISOLATION_HOLD_DEAD_WINDOWS dead windows of silence, then declares
# them (a real failure of everything). Holding costs nothing a declaration would give: with no
# live daemon left there is nowhere to fail over to. A failure of some daemons is declared as
# usual: the others are heard every interval.
# Once the first daemon is heard again, the others still silent get as long again, counted
# from that moment: their TCP connections retransmit with a doubling backoff, so after a cut
# of several seconds their first packet may come seconds after the network healed (found on
# test hosts: a coordinator healed after 7 s declared four daemons dead the moment the first
# was heard, and their streamlets failed over to no one).
ISOLATION_MEMBERS_MIN = 3
ISOLATION_QUIET_DEAD_WINDOWS = 0.5
ISOLATION_HOLD_DEAD_WINDOWS = 5


class DeathWatch:
    """Silence past the dead window is a death, unless most daemons fall silent at once."""

    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self.isolation_suspected = False          # most daemons silent at once
        self.heard_again_s: float | None = None   # when the last suspected isolation ended

    def due(self, live: list["Member"], now: float) -> list["Member"]:
        """The daemons of `live` (those alive so far) to declare dead now."""
        silent = [m for m in live if now - m.last_heartbeat_s > self.dead_after_s]
        if self._maybe_isolated(live, silent, now):
            return [m for m in silent if now - m.last_heartbeat_s >
                    self.dead_after_s * ISOLATION_HOLD_DEAD_WINDOWS]
        return [m for m in silent if self._overdue(m, now)]

    def _overdue(self, member: "Member", now: float) -> bool:
        """A daemon past the dead window: one silent since before the end of a suspected
        isolation gets the hold again, counted from that end."""
        if self.heard_again_s is not None and member.last_heartbeat_s < self.heard_again_s:
            return now - self.heard_again_s > self.dead_after_s * ISOLATION_HOLD_DEAD_WINDOWS
        return True

    def _maybe_isolated(self, live: list["Member"], silent: list["Member"], now: float) -> bool:
        """Daemons to declare while none is heard lately: suspect this coordinator's own
        network."""
        suspect = len(live) >= ISOLATION_MEMBERS_MIN and bool(silent) and \
            now - max(m.last_heartbeat_s for m in live) > \
            self.dead_after_s * ISOLATION_QUIET_DEAD_WINDOWS
        if suspect and not self.isolation_suspected:
            log.warning("none of %d live daemons heard for %.1f s: this coordinator may be the "
                        "one cut off; holding their death for up to %.1f s", len(live),
                        now - max(m.last_heartbeat_s for m in live),
                        self.dead_after_s * ISOLATION_HOLD_DEAD_WINDOWS)
        elif not suspect and self.isolation_suspected:
            self.heard_again_s = now
            if len(silent) < len(live):   # else they were all declared dead past the hold
                log.info("daemons are heard again: those still silent have %.1f s more to be "
                         "heard before they are declared dead",
                         self.dead_after_s * ISOLATION_HOLD_DEAD_WINDOWS)
        self.isolation_suspected = suspect
        return suspect
