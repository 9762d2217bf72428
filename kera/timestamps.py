"""Record timestamps at the API: milliseconds since the epoch like Kafka, microseconds inside.

Chunks store i64 microseconds; producers, seeks by time and the CLI take milliseconds, checked
against a sane range so a value in another unit is refused instead of landing in 1970.
"""

from __future__ import annotations

from kera.errors import BadRequest

# Millisecond timestamps (Kafka's unit) a record may carry: 2000-01-01 to 2200-01-01 UTC. A value
# outside is almost surely in another unit (seconds, or microseconds) and is refused.
TIMESTAMP_MS_MIN = 946_684_800_000
TIMESTAMP_MS_MAX = 7_258_118_400_000


def ms_to_us(timestamp_ms) -> int:
    """Microseconds from a millisecond timestamp within TIMESTAMP_MS_MIN..MAX (years 2000-2200)."""
    ms = int(timestamp_ms)
    if not TIMESTAMP_MS_MIN <= ms <= TIMESTAMP_MS_MAX:
        raise BadRequest(f"timestamp_ms={ms} is not milliseconds since the epoch between years "
                         f"2000 and 2200 ({TIMESTAMP_MS_MIN}..{TIMESTAMP_MS_MAX}); seconds or "
                         f"microseconds given? (timestamp= takes microseconds)")
    return ms * 1000
