"""Back-off: how long a retry loop waits before its next attempt. Sans-IO.

One policy for every retry loop in kera: the wait doubles from `first_ms` with each failed
attempt, up to `max_ms`. Each loop keeps its own limit (an attempt count or a deadline): this
module only says how long to wait, never whether to try again.

    RETRY = Backoff(first_ms=5, max_ms=1000)
    retry_at = now + RETRY.delay_s(attempt)   # attempt 1: 5 ms, 2: 10 ms, ... then 1 s

No jitter: kera's retriers are a handful of threads per client whose failures are spread by
their own traffic, not thousands of clients failing in the same instant, and a deterministic
wait keeps the seeded simulation (tests/sim) reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

# Doublings beyond this are capped by max_ms anyway (2**30 ms is 12 days); it keeps the shift
# small whatever attempt number a caller passes.
DOUBLINGS_MAX = 30


@dataclass(frozen=True)
class Backoff:
    """Doubling waits: `first_ms` after the first failure, twice that after the second, ...,
    never more than `max_ms`."""
    first_ms: int
    max_ms: int

    def __post_init__(self):
        if not 0 < self.first_ms <= self.max_ms:
            raise ValueError(f"back-off needs 0 < first_ms <= max_ms, not "
                             f"{self.first_ms}, {self.max_ms}")

    def delay_ms(self, attempt: int) -> int:
        """The wait after failed attempt number `attempt` (1: the first; 0 or less count as 1)."""
        return min(self.max_ms, self.first_ms << min(max(attempt - 1, 0), DOUBLINGS_MAX))

    def delay_s(self, attempt: int) -> float:
        """delay_ms in seconds."""
        return self.delay_ms(attempt) / 1000
