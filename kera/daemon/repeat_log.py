"""Warnings that repeat: the first of a kind is logged, repeats of it within an interval are
only counted, and the next line logged says how many there were. A process left running with a
wrong `--id`, or a stale incarnation that keeps sending its old token, retries every second or
every heartbeat; a line each time buries everything else in an operator's log. Sans-IO: the
caller passes its clock, so the simulation and unit tests drive it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

# A repeated warning is logged at most this often per key: often enough that an operator
# tailing the log sees the problem is still there, rarely enough not to drown other lines.
REPEAT_LOG_INTERVAL_S = 60.0
# Keys remembered at once. Keys come from what remote processes send (ids, addresses), so the
# table must not grow without bound; the least recently logged key is forgotten first, and
# only logs its next repeat at once.
REPEAT_KEYS_MAX = 1024


class RepeatedWarnings:
    """Which repeats of a warning to log: `admit(key, now)` is None for a repeat to count and
    drop, else the number of repeats dropped since the key was last logged (0 the first time)."""

    def __init__(self, interval_s: float = REPEAT_LOG_INTERVAL_S,
                 keys_max: int = REPEAT_KEYS_MAX):
        if interval_s < 0 or keys_max < 1:
            raise ValueError("interval_s must be >= 0 and keys_max >= 1")
        self.interval_s = interval_s
        self.keys_max = keys_max
        self._keys: OrderedDict[Hashable, list] = OrderedDict()   # key -> [logged_s, dropped]

    def admit(self, key: Hashable, now: float) -> int | None:
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            return None
        dropped = 0 if entry is None else entry[1]
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self.keys_max:
            self._keys.popitem(last=False)
        return dropped

    def note(self, dropped: int) -> str:
        """What to append to the logged line about the repeats dropped before it."""
        if not dropped:
            return ""
        return (f" ({dropped} more like it in the last {self.interval_s:g} s not logged; "
                f"at most one line per {self.interval_s:g} s)")
