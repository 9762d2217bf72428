"""The cyclic garbage collector's settings for kera's daemon processes.

A daemon allocates per request and reference counting frees almost all of it at once; the
cyclic collector is for reference cycles, which request handling rarely makes. At CPython's
default threshold (a young collection every 700 net container allocations) it still ran 14-26
times a second in each backup under the benchmark's presets (R=3, counted with gc.callbacks),
and every full collection (one every few seconds) walked all the objects loaded at start
(modules, numpy, pyzmq, msgpack). A daemon's start-up objects are never garbage, so they are
frozen out of every later collection, and young collections wait for more allocations: none ran
in the same benchmark window after this.

Only processes kera runs itself (`kera broker|backup|coordinator`): a library must not change
its application's collector (the client libraries leave it alone; README, "Benchmarks", says
what an application can do).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# Net container allocations between young collections (CPython's default is 700). A daemon's
# live young objects peak at one request's or one write's worth (a few thousand at 1 KiB
# chunks); below this a turn's garbage is freed by reference counting before the collector
# would look at it, and cycles, rare in the daemons, wait a little longer.
YOUNG_COLLECTION_OBJECTS = 20_000


def tune_daemon() -> None:
    """Freeze what start-up created and raise the young generation's threshold; call once the
    daemon's imports and configuration are done, before it serves."""
    gc.collect()   # start-up's own garbage, so it is not frozen
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS, older, oldest)
    log.debug("garbage collector: %d objects frozen, thresholds %s", gc.get_freeze_count(),
              gc.get_threshold())
