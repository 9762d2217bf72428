"""Consumer-group lag as Prometheus gauges, computed when the coordinator's metrics are scraped.

`kera_group_lag_records{group,stream,streamlet}` and `kera_group_lag_bytes{...}`: how far each
committed position is behind its streamlet's durable head. The coordinator holds the committed
positions but not the durable heads: brokers heartbeat counters, not per-group tables (sending
every streamlet's group table in every heartbeat would cost more than the lag is worth). So the
metrics thread asks the owning brokers (`offsets` with the position as `at`, what `kera group
describe` does) through a Consumer of its own, off the coordinator's loop: its single thread
never waits on a broker. Like Kafka's lag exporters, the figures are as fresh as the scrape
(cached for LAG_REFRESH_MIN_S so several scrapers cost one pass).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kera.errors import KeraError
from kera.daemon.metrics import label_value

log = logging.getLogger(__name__)

# A pass asks one `offsets` per committed part: past this many parts a scrape would take too
# long (Prometheus' default scrape timeout is 10 s at ~1 ms a request), so the rest are skipped
# and counted in kera_group_lag_parts_skipped.
LAG_PARTS_MAX = 5_000
# Scrapes closer together than this reuse the last pass (Prometheus scrapes every 15 s by
# default; two scrapers, or a person refreshing, should not double the brokers' load).
LAG_REFRESH_MIN_S = 5.0
# Each part's `offsets` request: a broker being failed over makes its parts' lag unknown for
# this pass, not the scrape late (the whole pass stays within the scrape timeout for a few).
LAG_REQUEST_TIMEOUT_S = 2.0


class GroupLagExporter:
    """`text()`: the lag gauges of every committed part, in Prometheus text. `positions()`
    returns {group: [[stream, streamlet, [[g, off, epoch], ...]], ...]} and `streams()` the
    existing stream names: both safe to call from the metrics thread."""

    def __init__(self, bootstrap: str, positions: Callable[[], dict],
                 streams: Callable[[], set], key_file: str | None = None):
        self.bootstrap = bootstrap
        self.key_file = key_file   # a secure coordinator asks the brokers as itself
        self._positions, self._streams = positions, streams
        self._lock = threading.Lock()   # one pass at a time; others wait and reuse it
        self._text, self._at_s = "", None

    def text(self) -> str:
        with self._lock:
            now = time.monotonic()
            if self._at_s is None or now - self._at_s >= LAG_REFRESH_MIN_S:
                self._text, self._at_s = self._pass(), now
            return self._text

    def _pass(self) -> str:
        wanted, skipped = _bounded(self._positions(), self._streams())
        lags: dict = {}
        try:
            if wanted:
                self._ask(wanted, lags)
        except KeraError as err:   # e.g. a stream deleted since the view was taken
            log.info("group lag unknown this scrape: %s", err)
        return lag_text(lags, skipped, len(wanted) - len(lags))

    def _ask(self, wanted: dict, lags: dict) -> None:
        from kera.consumer import Consumer
        from kera.consumer.membership import positions_from_wire
        streams = sorted({s for parts in wanted.values() for s, _sl, _pos in parts})
        with Consumer(self.bootstrap, streams, streamlets=[], key_file=self.key_file,
                      request_timeout_s=LAG_REQUEST_TIMEOUT_S) as c:
            for group, parts in sorted(wanted.items()):
                try:
                    lags[group] = c.lag_detail_of(positions_from_wire(parts))
                except KeraError as err:   # a broker away: this group is unknown this time
                    log.info("lag of group %r unknown this scrape: %s", group, err)


def _bounded(positions: dict, streams: set) -> tuple[dict, int]:
    """The committed parts of existing streams, at most LAG_PARTS_MAX; and how many were left."""
    wanted: dict = {}
    taken = skipped = 0
    for group, parts in sorted(positions.items()):
        for part in parts:
            if part[0] not in streams:
                continue      # a deleted stream: its positions have no lag
            if taken >= LAG_PARTS_MAX:
                skipped += 1
                continue
            wanted.setdefault(group, []).append(part)
            taken += 1
    return wanted, skipped


def lag_text(lags: dict, skipped: int, errors: int) -> str:
    """Prometheus text of {group: {(stream, streamlet): Lag}} and the pass's own counters."""
    lines = ["# TYPE kera_group_lag_records gauge", "# TYPE kera_group_lag_bytes gauge"]
    records, sizes = [], []
    for group, parts in sorted(lags.items()):
        for (stream, sl), lag in sorted(parts.items()):
            labels = (f'{{group="{label_value(group)}",stream="{label_value(stream)}",'
                      f'streamlet="{sl}"}}')
            records.append(f"kera_group_lag_records{labels} {lag.records}")
            if lag.bytes is not None:
                sizes.append(f"kera_group_lag_bytes{labels} {lag.bytes}")
    lines[1:1] = records
    lines += sizes
    lines += ["# TYPE kera_group_lag_parts_skipped gauge",
              f"kera_group_lag_parts_skipped {skipped}",
              "# TYPE kera_group_lag_groups_unknown gauge",
              f"kera_group_lag_groups_unknown {errors}"]
    return "\n".join(lines) + "\n"

