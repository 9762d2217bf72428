"""The broker daemon's side of failover: incarnations and recovery jobs on the server loop.

Thin I/O around kera.broker.recovery: applies the epoch the coordinator gives this broker
(`broker_streams` reply; a new epoch means a new incarnation, which keeps only its R=1
streams), starts recovery jobs when the metadata marks streamlets recovering here, sends their
`list_replicas` / `read_replica` requests through Peers (each with a deadline) and the
`recovered` reports to the coordinator.
"""

from __future__ import annotations

import logging

from typing import Callable

from kera.broker.core import Broker
from kera.broker.recovery import Recovery, Request, reset_incarnation
from kera.daemon.coordinator_link import CoordinatorLink

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.2   # between `recovered` reports (a refused one is sent again)


class RecoveryService:
    """`core`: the broker core; `server`: its loop (peers to backups); `link`: its coordinator
    session; `answer_due()` sends the replies due now; `refresh_backups()` asks for the live
    backup list."""

    def __init__(self, core: Broker, clock, server, link: CoordinatorLink,
                 answer_due: Callable[[], None], refresh_backups: Callable[[], None]):
        self.core = core
        self.clock = clock
        self.server = server
        self.link = link
        self.answer_due = answer_due
        self.refresh_backups = refresh_backups
        self.recovery = Recovery(core)
        self._report_at = 0.0
        # Loop time spent replaying (verifying and placing recovered chunks, installing): the
        # rest of a recovery's reading phase is waiting for the backups.
        self.replay_s = 0.0
        self.replay_cpu_s = 0.0   # the same, CPU time of the loop thread (a loaded machine)

    # ------------------------------------------------------------------ coordinator replies
    def streams_reply(self, header: dict, apply) -> None:
        """A `broker_streams` reply: take the epoch, then `apply()` the metadata, then start
        recovering what it marks."""
        core = self.core
        epoch = header.get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**32:
            if core.epoch is not None and epoch < core.epoch:
                log.info("ignoring a broker_streams reply of an older incarnation")
                return
            if core.epoch is not None and epoch != core.epoch:
                # Answers already due go out first: they are about chunks this broker still
                # holds (durable before the failover fenced its replicas).
                self.answer_due()
                reset_incarnation(core)
                self.recovery = Recovery(core)
            if core.epoch != epoch:
                core.set_epoch(epoch)
                log.info("broker %s incarnation epoch %d", core.broker_id, epoch)
        apply()
        self.recovery.take_fence_tokens(header.get("fence_tokens"))
        if self.recovery.apply(header.get("streams"), self.clock.monotonic()):
            self.refresh_backups()   # recover from a fresh list of backups

    def cluster_reply(self, header: dict) -> None:
        self.recovery.set_backups(header.get("backups"), self.clock.monotonic(),
                                  header.get("settled", True) is not False)

    def heartbeat_fields(self) -> dict:
        epoch = self.core.epoch
        return {} if epoch is None else {"epoch": epoch}

    # ------------------------------------------------------------------ loop
    def pump(self) -> None:
        recovery = self.recovery
        if not recovery.active:
            return
        now = self.clock.monotonic()
        started, cpu = self.clock.perf_counter(), self.clock.thread_time()
        requests = recovery.take_requests(now)   # installs a job whose reads are all done
        self.replay_s += self.clock.perf_counter() - started
        self.replay_cpu_s += self.clock.thread_time() - cpu
        for req in requests:
            self._send(recovery, req)
        due = recovery.reports_due()
        if due and self.core.epoch is not None and now >= self._report_at:
            self._report_at = now + REPORT_INTERVAL_S
            fields = {"broker_id": self.core.broker_id, "epoch": self.core.epoch,
                      "token": self.link.session.identity.token, "streamlets": due}
            self.link.call("recovered",
                           fields, lambda header: recovery.reported(due, self.clock.monotonic()))

    def _send(self, recovery: Recovery, req: Request) -> None:
        def done(header, frames, error):
            started, cpu = self.clock.perf_counter(), self.clock.thread_time()
            recovery.on_reply(req, header, frames, error, self.clock.monotonic())
            self.replay_s += self.clock.perf_counter() - started
            self.replay_cpu_s += self.clock.thread_time() - cpu

        self.server.peer(req.address).request(req.op, req.fields, [], req.timeout_s, done)

    def stats(self) -> dict:
        return {**self.recovery.stats(), "recovery_replay_s": round(self.replay_s, 6),
                "recovery_replay_cpu_s": round(self.replay_cpu_s, 6)}
