"""Record timestamps at the API: milliseconds since the epoch like Kafka, microseconds inside.

Chunks store i64 microseconds; producers, seeks by time and the CLI take milliseconds, checked
against a sane range so a value in another unit is refused instead of landing in 1970.
"""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np

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


def ms_column_to_us(timestamps_ms):
    """ms_to_us of one int, or of every value of a sequence (an int64 numpy array back)."""
    if isinstance(timestamps_ms, (int, np.integer)):
        return ms_to_us(timestamps_ms)
    ms = np.asarray(timestamps_ms, dtype=np.int64)
    if ms.size:
        ms_to_us(int(ms.min()))
        ms_to_us(int(ms.max()))
    return ms * 1000


def check_us(timestamp_us: int, lowest_us: int | None = None) -> None:
    """Refuse a microsecond timestamp that is a millisecond one of years 2000-2200 (Kafka's
    unit, given where kera takes microseconds): stored as is it would read back as a day in
    January to March 1970. `lowest_us`/`timestamp_us`: the range of a batch's column."""
    low = timestamp_us if lowest_us is None else lowest_us
    if TIMESTAMP_MS_MIN <= low <= TIMESTAMP_MS_MAX or \
            TIMESTAMP_MS_MIN <= timestamp_us <= TIMESTAMP_MS_MAX:
        raise BadRequest(f"timestamp {low} looks like milliseconds since the epoch, but "
                         f"timestamp= is in microseconds (it would be stored as 1970): pass "
                         f"timestamp_ms= (timestamps_ms= for a batch) or multiply by 1000")


def parse_time_ms(text: str) -> int:
    """Milliseconds since the epoch from a command line's time: an integer (milliseconds) or
    an ISO 8601 date-time ("2027-01-15T08:00:00+01:00"; without a zone it is UTC, so a command
    means the same on every machine). Checked as ms_to_us checks."""
    text = text.strip()
    if text.isdigit():
        ms = int(text)
    else:
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise BadRequest(f"time {text!r} is neither milliseconds since the epoch nor an ISO "
                             f"8601 date-time such as 2027-01-15T08:00:00Z") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        ms = round(when.timestamp() * 1000)
    ms_to_us(ms)
    return ms
