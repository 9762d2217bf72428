"""The broker daemon's side of compaction: the I/O around the sans-IO kera.broker.compactor.

- every COMPACTION_CHECK_S, and as soon as a pass ends: the next due streamlet's pass goes to
  the compaction thread (one pass at a time, COMPACTIONS_IN_FLIGHT_MAX; the thread is started
  on the first pass, so a broker without compacted streams runs none);
- every loop turn: the thread's outcome (its wake-up pipe is on the loop's poller), whose new
  chunks the compactor hands to their virtual logs before this turn's replication writes;
  then the swap, once the durable walk passed them;
- what is seen: the broker-wide counters and, per compacted stream, the dirty ratio, bytes
  before and after, passes and their seconds (`stats`, for the `stats` op and `kera stats`),
  and the same per stream as Prometheus gauges labelled by stream (`metric_rows`, served
  only with --metrics-stream-labels, as the per-stream traffic is).
"""

from __future__ import annotations

import time

import zmq

from kera.broker.compactor import COMPACTIONS_IN_FLIGHT_MAX, Built, Compactor, PassJob, run_pass

# How often the broker looks for a due streamlet: a pass is long next to it (its records are
# read in Python), and a streamlet becomes due only as whole groups finish.
COMPACTION_CHECK_S = 1.0
# Per-stream fields exported as `kera_broker_compaction_<field>{stream="..."}` gauges.
METRIC_FIELDS = ("dirty_ratio", "passes", "bytes_before", "bytes_after", "seconds")


def timed_pass(job: PassJob) -> Built:
    """A pass on the compaction thread, with the wall time it took there."""
    start = time.perf_counter()
    built = run_pass(job)
    built.seconds = time.perf_counter() - start
    return built


class CompactionService:
    def __init__(self, core, server, env):
        self.core = core
        self.server = server
        self.env = env
        self.compactor = Compactor(core)
        self.worker = None
        self.metric_rows: dict[str, dict] = {}   # replaced whole: read by the metrics thread
        server.every(COMPACTION_CHECK_S, self.check)

    def check(self) -> None:
        self._refresh_metrics()
        self._start_next()

    def _start_next(self) -> None:
        job = self.compactor.next_pass(self.core.wall_ms)
        if job is None:
            return
        if self.worker is None:
            self.worker = self.env.worker("broker-compaction", timed_pass, COMPACTIONS_IN_FLIGHT_MAX)
            if self.worker.wake_fd >= 0:
                self.server.poller.register(self.worker.wake_fd, zmq.POLLIN)
        self.worker.submit(job)

    def pump(self) -> None:
        was_busy = self.compactor.busy
        if self.worker is not None:
            for _job, result, error in self.worker.completions():
                self.compactor.built(result, error)
        self.compactor.on_durable()
        if was_busy and not self.compactor.busy:
            # A pass just ended (swapped, or failed): the next due streamlet starts now, not
            # at the next check, or a busy stream's passes would idle the thread half the time
            # and fall behind its updates (bench.compaction_rate).
            self._start_next()

    def stats(self) -> dict:
        """Broker-wide counters since start, and `compaction_streams`: {stream name: its dirty
        ratio, clean and dirty bytes, passes, bytes before and after, seconds}."""
        c = self.compactor
        return {"compaction_passes": c.passes, "compaction_bytes_before": c.bytes_before,
                "compaction_bytes_after": c.bytes_after, "compaction_seconds": c.seconds,
                "compaction_streams": c.stream_stats(self.core.wall_ms)}

    def _refresh_metrics(self) -> None:
        rows = self.compactor.stream_stats(self.core.wall_ms)
        self.metric_rows = {name: {f: row[f] for f in METRIC_FIELDS} for name, row in rows.items()}

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
