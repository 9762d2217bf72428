"""Fresh segment memory faulted in ahead of the appends, on a worker thread beside the loop.

A segment's fresh memory costs a page fault per 4 KiB on its first write, which
`madvise(MADV_POPULATE_WRITE)` does a window at a time (kera.broker.segment). Inline, that call
was the largest item of the broker loop at 64 KiB chunks: 35% of its py-spy samples (R=3,
throughput preset), the loop waiting while the kernel zeroes pages. Python's `mmap.madvise`
holds the GIL for the call; through ctypes, which lets it go, a worker thread
(`broker-populate`) faults the next window in while the loop serves requests. The kernel's work
is the same; it runs beside the loop, not inside it: 1.05x records/s at 64 KiB chunks, 1.06x
at 16 KiB, no change at 4 KiB (R=3, throughput preset, against inline alternated in one run).

A window the worker has not reached yet is faulted by the append's copy itself, as on a kernel
without MADV_POPULATE_WRITE: the worker only ever saves work, so nothing waits on it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

from kera.backup.worker import expected

MADV_POPULATE_WRITE = 23   # Linux 5.14; Python 3.11's mmap module does not name it
# Windows queued at most (each at most kera.broker.segment.POPULATE_AHEAD_MAX_BYTES): one per
# segment being filled is the usual count; past this a window is left for its appends to fault,
# so a broker filling thousands of segments at once never queues more than this.
POPULATE_JOBS_MAX = 64

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


def populate(job: tuple[mmap.mmap, int, int]) -> None:
    """Fault in `length` bytes of `memory` from `start` (page-aligned); runs on the worker
    thread, the GIL released for the call. Raises OSError when the kernel refuses."""
    memory, start, length = job
    # A buffer export for the duration of the call: the map can be neither closed nor resized
    # (and kera.broker.segment_pool does not reuse it) while the kernel works on it.
    anchor = ctypes.c_char.from_buffer(memory)
    if _madvise(ctypes.addressof(anchor) + start, length, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Populator:
    """Hands windows of segment memory to a worker (kera.backup.worker.Worker, or the
    simulation's) running `populate`; the loop calls `collect` when the worker's pipe wakes it."""

    def __init__(self, worker):
        self.worker = worker
        self.queued = 0            # submitted, not yet collected
        self.requested = 0         # windows submitted in all
        self.works = True          # False once the kernel refused: appends fault their pages
        self.skipped = 0           # windows left to the appends because the queue was full

    def request(self, memory: mmap.mmap, start: int, length: int) -> None:
        """Fault `length` bytes of `memory` from `start` in soon, off the loop."""
        if not self.works:
            return
        if self.queued >= POPULATE_JOBS_MAX:
            self.skipped += 1
            return
        self.worker.submit((memory, start, length))
        self.queued += 1
        self.requested += 1

    def collect(self) -> None:
        """Take the finished windows. A refusal (OSError: a kernel before 5.14) stops further
        requests; anything else a job raised is a bug and is raised here, on the loop."""
        for _job, _result, error in self.worker.completions():
            self.queued -= 1
            if expected(error, OSError) is not None and self.works:
                self.works = False
                log.info("segments fault their pages on first write: madvise("
                         "MADV_POPULATE_WRITE) refused (%s)", error)

    def close(self) -> None:
        self.worker.close()
