"""Exactly-once delivery of a stream to N targets, in order per streamlet (LogPlayer-style).

    from kera.services.deliver.deliverer import Deliverer
    from kera.services.deliver.targets import SqliteTarget, PostgresTarget
    from kera.services.deliver.http import HttpTarget

    with Deliverer("127.0.0.1:7000", "orders",
                   targets=[SqliteTarget("orders.db"), HttpTarget("http://svc/kera")]) as d:
        d.wait()          # until stop() (or every target was given up)

Each target gets its own thread and its own Consumer: its read position is its own, and the
consumer's bounded chunk cache is its bounded queue, so a slow or dead target never holds up
the others; a target that fell behind catches up by its own reading while the others go on.
A session of a target starts from the target's `last_applied()` (its source of truth, on start
and after every failure), then loops: collect a batch, drop what the target already applied,
`apply` it (records and new last-applied atomically, the target's promise), advance. A failure
closes the session; it is retried with backoff up to a limit (kera.services.deliver.core), logged with
the target's name. The decisions live in kera.services.deliver.core; this module is the threads.
"""

from __future__ import annotations

import logging
import threading
import time

from kera import config
from kera.services.deliver.core import (BATCH_RECORDS_MAX, PROGRESS_INTERVAL_S, RETRIES_MAX,
                                TargetCursor, check_orderable, resume_numbers,
                                resume_positions)
from kera.errors import BadRequest, DeliveryGap
from kera.client.metadata import Metadata

log = logging.getLogger(__name__)

# How long a session waits for a first record before checking for stop and logging progress.
POLL_WAIT_S = 0.1
# Chunks a target's consumer caches ahead of its target: its bounded queue.
CACHE_CHUNKS_MAX = 8
# stop(): how long to wait for a target's thread (it may be inside a slow apply).
STOP_TIMEOUT_S = 30.0


class Deliverer:
    """Pushes `stream` to each of `targets` (kera.services.deliver.targets.Target) exactly once."""

    def __init__(self, bootstrap: str, stream: str, targets: list, *,
                 batch_records_max: int = BATCH_RECORDS_MAX, retries_max: int = RETRIES_MAX,
                 progress_interval_s: float = PROGRESS_INTERVAL_S, key_file: str | None = None,
                 request_timeout_s: float = config.DEFAULT_REQUEST_TIMEOUT_S,
                 fetch_wait_ms: float = config.DEFAULT_FETCH_WAIT_MS):
        """`fetch_wait_ms`: how long each target's consumer waits before asking again a
        broker that had nothing new and did not hold the fetch (brokers of this kera hold it
        until records arrive: Consumer's `fetch_max_wait_ms`)."""
        names = [t.name for t in targets]
        if not targets or len(set(names)) != len(names):
            raise BadRequest(f"give one or more targets with distinct names, not {names}")
        meta = Metadata(bootstrap, timeout_s=request_timeout_s, key_file=key_file)
        try:
            check_orderable(stream, meta.stream(stream).active_groups)
        finally:
            meta.close()
        self.bootstrap, self.stream, self.key_file = bootstrap, stream, key_file
        self.request_timeout_s, self.fetch_wait_ms = request_timeout_s, fetch_wait_ms
        self.batch_records_max = batch_records_max
        self.progress_interval_s = progress_interval_s
        self.stop_event = threading.Event()
        self.workers = [_TargetWorker(self, t, TargetCursor(t.name, retries_max))
                        for t in targets]

    def start(self) -> "Deliverer":
        for worker in self.workers:
            worker.thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stop() or every target was given up; True if so within `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for worker in self.workers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            worker.thread.join(left)
        return not any(w.thread.is_alive() for w in self.workers)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.stop_event.set()
        self.wait(timeout_s)

    def status(self) -> dict[str, dict]:
        """Per target name: records applied since start, consecutive failures, given up."""
        return {w.cursor.name: {"applied": w.cursor.applied_total,
                                "failures": w.cursor.failures, "gave_up": w.gave_up}
                for w in self.workers}

    def __enter__(self) -> "Deliverer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _TargetWorker:
    """One target's thread: sessions from its last-applied, retried with backoff."""

    def __init__(self, deliverer: Deliverer, target, cursor: TargetCursor):
        self.d, self.target, self.cursor = deliverer, target, cursor
        self.gave_up = False
        self.thread = threading.Thread(target=self._run, name=f"deliver-{target.name}",
                                       daemon=True)

    def _run(self) -> None:
        try:
            while not self.d.stop_event.wait(max(0.0, self.cursor.retry_at_s - time.monotonic())):
                try:
                    self._session()
                except DeliveryGap as err:   # retrying cannot fill a hole
                    self.gave_up = True
                    log.error("giving up: %s", err)
                    return
                except Exception as err:
                    if not self._failed(err):
                        return
        finally:
            self.target.close()

    def _failed(self, err: Exception) -> bool:
        """Log a failed session and schedule a retry; False: the target is given up."""
        self.target.close()
        if not self.cursor.failed(time.monotonic()):
            self.gave_up = True
            log.error("target %s: giving up after %d failed attempts (last: %s); restart "
                      "kera deliver once it is fixed, it resumes from its last applied",
                      self.cursor.name, self.cursor.failures, err)
            return False
        delay_ms = (self.cursor.retry_at_s - time.monotonic()) * 1000
        log.warning("target %s failed (attempt %d of %d): %s; retrying in %.0f ms from its "
                    "last applied", self.cursor.name, self.cursor.failures,
                    self.cursor.retries_max, err, delay_ms)
        return True

    def _session(self) -> None:
        from kera.consumer import Consumer
        self.cursor.resumed(self.target.last_applied())
        start = resume_positions(self.cursor.applied, self.d.stream)
        log.info("target %s: resuming after %s", self.cursor.name,
                 {sl: _described(a) for (_, sl), a in sorted(self.cursor.applied.items())}
                 or "nothing (from the earliest records)")
        with Consumer(self.d.bootstrap, self.d.stream, start=start,
                      cache_chunks_max=CACHE_CHUNKS_MAX, key_file=self.d.key_file,
                      request_timeout_s=self.d.request_timeout_s,
                      fetch_wait_ms=self.d.fetch_wait_ms) as consumer:
            for streamlet, number in resume_numbers(self.cursor.applied, self.d.stream).items():
                consumer.seek_to_number(self.d.stream, streamlet, number)
            progress = _Progress(self.cursor, self.d.progress_interval_s)
            while not self.d.stop_event.is_set():
                batch = self.cursor.fresh(self._collect(consumer))
                if batch:
                    self.target.apply(batch)
                    self.cursor.acknowledged(batch)
                progress.tick(consumer, idle=not batch)

    def _collect(self, consumer) -> list:
        """Up to batch_records_max records: waits for the first, then takes what is ready."""
        record = consumer.poll(timeout_s=POLL_WAIT_S)
        batch = []
        while record is not None:
            batch.append(record)
            if len(batch) >= self.d.batch_records_max:
                break
            record = consumer.poll(timeout_s=0)
        return batch


def _described(applied) -> str:
    where = "" if applied.group is None else f"group {applied.group} offset {applied.offset}"
    number = "" if applied.number is None else f"number {applied.number}"
    return ", ".join(filter(None, (number, where)))


class _Progress:
    """Logs a target's progress every interval, and when it catches up (lag costs a request
    per streamlet: it is asked at the interval, and when an idle poll suggests a catch-up)."""

    def __init__(self, cursor: TargetCursor, interval_s: float):
        self.cursor, self.interval_s = cursor, interval_s
        self.next_s = time.monotonic() + interval_s
        self.applied_before = cursor.applied_total
        self.caught_up = False

    def tick(self, consumer, idle: bool) -> None:
        now = time.monotonic()
        if now < self.next_s and (self.caught_up or not idle):
            if not idle:
                self.caught_up = False
            return
        lag = sum(consumer.lag().values())
        if lag == 0 and not self.caught_up:
            log.info("target %s: caught up (%d applied since start)", self.cursor.name,
                     self.cursor.applied_total)
        self.caught_up = lag == 0
        if now >= self.next_s:
            applied = self.cursor.applied_total - self.applied_before
            self.applied_before, self.next_s = self.cursor.applied_total, now + self.interval_s
            log.info("target %s: applied %d records in %.0f s (%d since start); %s",
                     self.cursor.name, applied, self.interval_s, self.cursor.applied_total,
                     "caught up" if lag == 0 else f"lagging by {lag} records")
