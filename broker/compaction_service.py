"""The broker daemon's side of compaction: the I/O around the sans-IO kera.broker.compactor.

- every COMPACTION_CHECK_S: the next due streamlet's pass goes to the compaction thread (one
  pass at a time, COMPACTIONS_IN_FLIGHT_MAX; the thread is started on the first pass, so a
  broker without compacted streams runs none);
- every loop turn: the thread's outcome (its wake-up pipe is on the loop's poller), whose new
  chunks the compactor hands to their virtual logs before this turn's replication writes;
  then the swap, once the durable walk passed them.
"""

from __future__ import annotations

import zmq

from kera.broker.compactor import COMPACTIONS_IN_FLIGHT_MAX, Compactor, run_pass

# How often the broker looks for a due streamlet: a pass is long next to it (its records are
# read in Python), and a streamlet becomes due only as whole groups finish.
COMPACTION_CHECK_S = 1.0


class CompactionService:
    def __init__(self, core, server, env):
        self.core = core
        self.server = server
        self.env = env
        self.compactor = Compactor(core)
        self.worker = None
        server.every(COMPACTION_CHECK_S, self.check)

    def check(self) -> None:
        job = self.compactor.next_pass(self.core.wall_ms)
        if job is None:
            return
        if self.worker is None:
            self.worker = self.env.worker("broker-compaction", run_pass, COMPACTIONS_IN_FLIGHT_MAX)
            if self.worker.wake_fd >= 0:
                self.server.poller.register(self.worker.wake_fd, zmq.POLLIN)
        self.worker.submit(job)

    def pump(self) -> None:
        if self.worker is not None:
            for _job, result, error in self.worker.completions():
                self.compactor.built(result, error)
        self.compactor.on_durable()

    def stats(self) -> dict:
        c = self.compactor
        return {"compaction_passes": c.passes, "compaction_bytes_before": c.bytes_before,
                "compaction_bytes_after": c.bytes_after}

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
