"""kera.daemon.malloc_policy: a daemon keeps freed C-heap memory for its next messages instead of
faulting it in again; run in child interpreters, so this test process keeps its allocator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A burst of 20 buffers of 1 MiB from the C heap (as libzmq's received messages are), every
# page written, all freed; then the same burst again, counting the page faults it takes.
PROBE = """
import ctypes, json, resource, sys
from kera.daemon import malloc_policy
took = malloc_policy.tune_daemon() if sys.argv[1] == "tuned" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE, COUNT = 1 << 20, 20

def burst():
    blocks = [libc.malloc(SIZE) for _ in range(COUNT)]
    for b in blocks:
        ctypes.memset(b, 1, SIZE)
    for b in blocks:
        libc.free(b)

burst(); burst()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
burst()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"took": took, "faults": faults, "pages": SIZE * COUNT // 4096}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return json.loads(out)


def test_a_tuned_process_reuses_freed_heap_memory_without_faulting_it_in_again():
    untuned = _probe("default")
    if untuned["faults"] < untuned["pages"] // 2:
        pytest.skip("this C library keeps such a burst's memory by default; nothing to show")
    tuned = _probe("tuned")
    assert tuned["took"] is True
    assert tuned["faults"] < tuned["pages"] // 10, (untuned, tuned)
