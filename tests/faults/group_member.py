"""A consumer-group member as its own process, for tests/faults/test_group_processes.py.

    python -m tests.faults.group_member BOOTSTRAP STREAM GROUP

Prints one JSON line per event on stdout: {"t": monotonic s, "ev": "assigned"|"revoked",
"parts": [[stream, sl], ...]} and {"t", "ev": "rec", "v": value, "sl": streamlet}. SIGTERM
closes the consumer (a graceful leave: final commit, then leave); SIGKILL is the crash.
`time.monotonic()` is the machine's CLOCK_MONOTONIC, comparable across processes.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from kera import Consumer

AUTO_COMMIT_INTERVAL_MS = 200
SESSION_TIMEOUT_MS = 3000


_out = threading.Lock()   # callbacks run on the request thread, records on the main one


def emit(**event) -> None:
    line = json.dumps({"t": time.monotonic(), **event}) + "\n"
    with _out:    # one whole line at a time: print() from two threads can interleave
        sys.stdout.write(line)
        sys.stdout.flush()


def main(bootstrap: str, stream: str, group: str) -> None:
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    with Consumer(bootstrap, stream, group=group, auto_commit_interval_ms=AUTO_COMMIT_INTERVAL_MS,
                  session_timeout_ms=SESSION_TIMEOUT_MS,
                  on_assigned=lambda parts: emit(ev="assigned", parts=parts),
                  on_revoked=lambda parts: emit(ev="revoked", parts=parts)) as c:
        emit(ev="started")
        while not stopping:
            r = c.poll(timeout_s=0.1)
            if r is not None:
                emit(ev="rec", v=int(r.value), sl=r.streamlet)
        # The application reads nothing more from here; closing then leaves the group, after
        # which another member may be granted these parts (before "closed" is written).
        emit(ev="closing")
    emit(ev="closed")


if __name__ == "__main__":
    main(*sys.argv[1:4])
