"""The C allocator's settings for kera's daemon processes: freed memory kept for the next request.

libzmq allocates every message it receives with malloc, and a request's frames (produce
requests and replication writes of packed chunks, fetch replies) are 64 KiB to several MiB.
glibc serves such sizes with a map of fresh pages and unmaps them on free (its threshold,
128 KiB, rises only as far as the largest size freed so far), and gives the top of its heap back
once 128 KiB of it is free: a daemon under load then faults much of what it receives in again. On
this project's machine (a VM, where a fresh page costs 1-2 us) each backup took 6,000-6,600 page
faults a second at 64 KiB chunks (R=3, throughput preset); with the settings below, 24-230 (in
three runs). The broker's own faults are mostly its segments' fresh memory
(kera.broker.segment, populated a window at a time), which no allocator setting saves.

`mallopt` sets them, through ctypes, for the whole process once at start. Only processes kera
runs itself (`kera broker|backup|coordinator`), as for kera.daemon.gc_policy: the client libraries
leave their application's allocator alone (README, "Benchmarks", says what an application can
set). Without glibc (no `mallopt`), nothing changes and the daemon says so at debug level.
"""

from __future__ import annotations

import ctypes
import logging

from kera.config import MiB

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1      # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
# Allocations from this size up get a map of their own (glibc's largest allowed value on 64-bit:
# larger replies, which FETCH_REPLY_MAX_BYTES bounds at 64 MiB, still do). Below it, freed
# memory returns to the heap and serves the next message of the same size without a fault.
MMAP_THRESHOLD_BYTES = 32 * MiB
# Free memory at the top of a heap kept rather than given back: a few of the largest messages'
# worth, so memory a burst used returns to the system and steady traffic's does not.
TRIM_THRESHOLD_BYTES = 128 * MiB


def tune_daemon() -> bool:
    """Keep freed memory for reuse (see the module docstring); True when the C library took
    the settings. Call once at start, before the daemon serves."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        log.debug("allocator: no mallopt in this C library; its defaults stay")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    took = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    log.debug("allocator: mmap threshold %d bytes, trim threshold %d bytes%s",
              MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, "" if took else ": refused")
    return took
