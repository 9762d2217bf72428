"""The stream's tail as the outbox harvester needs it: where it ends now (a checkpoint), and
which outbox row ids were published since a checkpoint (read from the records' row-id header).
"""

from __future__ import annotations

import time

from kera.consumer import Consumer
from kera.errors import Timeout
from kera.services.outbox.core import row_id_of
from kera.codec.position import Position

# One poll while reading the tail; past it with nothing handed out, ask whether the end is reached.
TAIL_POLL_S = 0.05
# Reading from a checkpoint to the end: the records between two checkpoints of a term (a few
# seconds of publishing) take well under this; past it the takeover fails and is tried again.
TAIL_SCAN_TIMEOUT_S = 60.0


def end_positions(bootstrap: str, stream: str, key_file: str | None = None) -> list[Position]:
    """The stream's durable end, every streamlet: a record stored later lies past these."""
    with Consumer(bootstrap, stream, start="latest", key_file=key_file) as consumer:
        return consumer.positions()


def published_row_ids(bootstrap: str, stream: str, since: list[Position], wanted: set[int],
                      key_file: str | None = None,
                      timeout_s: float = TAIL_SCAN_TIMEOUT_S) -> set[int]:
    """Which of `wanted` row ids were published after the positions `since` (to the end)."""
    found: set[int] = set()
    deadline = time.monotonic() + timeout_s
    # A checkpoint into a history the streamlet lost (an R=1 broker restarted empty): read
    # what it has from its start; rows whose records are gone cannot be found and are reset.
    with Consumer(bootstrap, stream, start=since, key_file=key_file,
                  on_lost_position="earliest") as consumer:
        while time.monotonic() < deadline:
            record = consumer.poll(TAIL_POLL_S)
            if record is None:
                if not any(consumer.lag().values()):
                    return found
                continue
            row_id = row_id_of(record.headers)
            if row_id in wanted:
                found.add(row_id)
    raise Timeout(f"reading stream '{stream}' from the outbox checkpoint to its end took over "
                  f"{timeout_s:.0f} s; the takeover is tried again (is a broker down? kera "
                  f"stream describe {stream})")
