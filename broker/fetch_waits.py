"""Fetches that found nothing, held until one of their streamlets has new durable records or
their wait is over (Kafka's fetch.max.wait.ms). Sans-IO.

A consumer at the end of every stream it reads used to ask again after its idle back-off (5 ms):
200 fetches a second per broker, each reading every streamlet it owns for that consumer, so a
consumer of a thousand quiet streams kept the broker busy answering "nothing new". A fetch
that asks for it (`wait_ms`) and finds nothing is parked here instead; the shell answers it,
by fetching again, once `take_ready` returns it: when records become durable in one of its
streamlets (`wake`, called by the core where durable heads move) or at its deadline
(`expire`). New records then reach a waiting consumer at once, not after its back-off. A
fetch asks to be held at most kera.config.FETCH_WAIT_MAX_MS.
"""

from __future__ import annotations

import heapq
import itertools
# Reads held at once over all parked fetches (each is the request's small [sid, sl, cursor,
# max_bytes] list, ~0.2 KB): 200,000 reads keep parked fetches under ~40 MB. Past it a fetch
# is answered at once, and its consumer backs off as it did before fetches could wait.
PARKED_READS_MAX = 200_000


class ParkedFetch:
    """One held fetch: the shell's `token` (its request) and the streamlets it reads."""

    __slots__ = ("token", "deadline", "streamlets", "done")

    def __init__(self, token, deadline: float, streamlets: frozenset):
        self.token = token
        self.deadline = deadline
        self.streamlets = streamlets   # {(stream id, streamlet)}
        self.done = False


class FetchWaits:
    def __init__(self, reads_max: int = PARKED_READS_MAX):
        self.reads_max = reads_max
        # (stream id, streamlet) -> the parked fetches reading it. Empty when none waits, which
        # is all `wake`'s callers look at on the append path.
        self.watched: dict[tuple[int, int], set[ParkedFetch]] = {}
        self._deadlines: list = []   # (deadline, tiebreak, fetch); done ones are skipped
        self._tiebreak = itertools.count()
        self._ready: list[ParkedFetch] = []
        self.reads_parked = 0
        self.parked = 0       # held now
        self.held = 0         # since start: held, then released by new records or the deadline
        self.woken = 0
        self.expired = 0

    def park(self, token, streamlets: frozenset, deadline: float) -> bool:
        """Hold a fetch that found nothing until `deadline`; False (not held: answer it now)
        when that would pass `reads_max`."""
        if not streamlets or self.reads_parked + len(streamlets) > self.reads_max:
            return False
        fetch = ParkedFetch(token, deadline, streamlets)
        for key in streamlets:
            self.watched.setdefault(key, set()).add(fetch)
        heapq.heappush(self._deadlines, (deadline, next(self._tiebreak), fetch))
        self.reads_parked += len(streamlets)
        self.parked += 1
        self.held += 1
        return True

    def wake(self, stream_id: int, streamlet: int) -> None:
        """Records of the streamlet became durable: its parked fetches are ready."""
        waiting = self.watched.pop((stream_id, streamlet), None)
        if waiting:
            for fetch in waiting:
                if not fetch.done:
                    self.woken += 1
                    self._release(fetch)

    @property
    def idle(self) -> bool:
        """Nothing held and nothing to answer: the shell's per-turn check stops here."""
        return not self._deadlines and not self._ready

    def expire(self, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            fetch = heapq.heappop(deadlines)[2]
            if not fetch.done:
                self.expired += 1
                self._release(fetch)

    def take_ready(self) -> list:
        """The tokens of the fetches to answer now, in the order they became ready."""
        ready, self._ready = self._ready, []
        return [fetch.token for fetch in ready]

    def stats(self) -> dict:
        return {"fetch_held": self.held, "fetch_held_now": self.parked,
                "fetch_held_woken": self.woken, "fetch_held_expired": self.expired}

    def _release(self, fetch: ParkedFetch) -> None:
        fetch.done = True
        self._ready.append(fetch)
        self.reads_parked -= len(fetch.streamlets)
        self.parked -= 1
        watched = self.watched
        for key in fetch.streamlets:
            others = watched.get(key)
            if others is not None:
                others.discard(fetch)
                if not others:
                    del watched[key]
