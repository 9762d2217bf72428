"""A kera.net.server timer whose interval can change (a daemon learns its heartbeat interval from
the coordinator's register reply): re-arming replaces the old timer, which turns into a no-op,
because kera.net.server timers cannot be removed."""

from __future__ import annotations

from typing import Callable


class IntervalTimer:
    def __init__(self, server, fn: Callable[[], None]):
        self._server = server
        self._fn = fn
        self._generation = 0
        self.interval_s: float | None = None

    def arm(self, interval_s: float) -> None:
        """Call fn every `interval_s` from now on (nothing changes if that is already so)."""
        if interval_s == self.interval_s:
            return
        self.interval_s = interval_s
        self._generation += 1
        generation = self._generation

        def tick() -> None:
            if generation == self._generation:
                self._fn()

        self._server.every(interval_s, tick)
