"""A thread that runs blocking jobs (disk writes or reads) off the server loop.

The loop submits jobs to a bounded queue (the store never hands out more than the bound, so a
submit never waits) and collects outcomes without blocking: each finished job is appended to a
completion deque and one byte is written to a pipe whose read end sits in the loop's poller,
so the loop wakes as soon as there is something to collect.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

_STOP = object()


def expected(error: Exception | None, *kinds: type) -> Exception | None:
    """`error` when it is None or one of `kinds` (what the job's I/O may fail with, e.g.
    OSError), for the caller to report. Anything else a job raised is a bug: it is raised again
    here, on the loop thread, so the daemon's error boundary (kera.net.server) logs it with the
    job's stack and stops the daemon instead of serving on with state the bug may have broken."""
    if error is None or isinstance(error, kinds):
        return error
    raise error


class Worker:
    def __init__(self, name: str, run_job: Callable[[object], object], max_jobs: int):
        self.name = name
        self._run_job = run_job
        self._jobs: queue.Queue = queue.Queue(maxsize=max_jobs + 1)  # +1: room for the stop mark
        self._done: collections.deque = collections.deque()
        self.wake_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_write_fd, False)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: object) -> None:
        self._jobs.put_nowait(job)  # queue.Full here is a bug in the caller's bound

    def completions(self) -> list[tuple[object, object, Exception | None]]:
        """Finished jobs as (job, result, error), oldest first; never blocks."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                outcome = (job, self._run_job(job), None)
            except Exception as exc:  # reported to the loop, which answers the request
                outcome = (job, None, exc)
            self._done.append(outcome)
            try:
                os.write(self._wake_write_fd, b"!")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the loop will look

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._jobs.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("%s: job queue still full at close", self.name)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("%s: still running a job after %.1f s", self.name, timeout_s)
        else:
            os.close(self.wake_fd)
            os.close(self._wake_write_fd)
