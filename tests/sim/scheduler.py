"""The simulated clock: a queue of events ordered by time, then by scheduling order.

Nothing in the simulation reads a real clock; every callback runs at `now` and schedules
later work with `at` / `after`. Events cannot be cancelled: the callback checks whether it is
still wanted (a crashed node ignores the events of its previous incarnation).
"""

from __future__ import annotations

import heapq
from typing import Callable


class Scheduler:
    def __init__(self) -> None:
        self.now = 0.0
        self.steps = 0              # events run so far
        self._queue: list = []      # (time, seq, fn, args)
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        if t < self.now:
            t = self.now
        heapq.heappush(self._queue, (t, self._seq, fn, args))
        self._seq += 1

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def next_time(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def step(self) -> bool:
        """Run the next event; False when none is left."""
        if not self._queue:
            return False
        t, _, fn, args = heapq.heappop(self._queue)
        self.now = t
        self.steps += 1
        fn(*args)
        return True
