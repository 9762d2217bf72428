"""Stopping a command on SIGTERM without taking a lock inside the signal handler.

A Python signal handler runs on the main thread between two bytecodes, possibly while that
thread holds a lock: `threading.Event.wait` holds the event's condition lock around its
waiting. A handler that sets that same event then waits for a lock its own thread holds, for
good (the outbox harvester waits on its stop event on the main thread). So the handler only
starts a thread that calls `stop`; that thread takes the lock once the main thread lets go.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


def stop_on_sigterm(stop) -> None:
    """Call `stop()` on SIGTERM, from a thread of its own (see the module doc), saying so in
    the log (from that thread too: logging takes a lock)."""
    def stopping() -> None:
        log.info("SIGTERM received: stopping (work in progress finishes or resumes on restart)")
        stop()

    def handler(*_) -> None:
        threading.Thread(target=stopping, name="sigterm-stop", daemon=True).start()
    signal.signal(signal.SIGTERM, handler)
