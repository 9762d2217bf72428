"""kera.daemon.stop_signal: SIGTERM stops a command even when it arrives while the main thread holds
the stop event's own lock (as it does inside Event.wait), where setting the event in the
handler itself would wait forever."""

import subprocess
import sys

# The main thread holds the event's lock while the SIGTERM handler runs, then lets go.
UNDER_THE_LOCK = """
import os, signal, threading, time
stop = threading.Event()
{install}
with stop._cond:                       # held, as inside stop.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10_000):            # the handler runs between these bytecodes
        pass
    time.sleep(0.05)
assert stop.wait(5.0), "not stopped"
print("stopped")
"""
LIMIT_S = 20.0   # the run takes well under a second; a deadlocked one never ends


def run(install: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", UNDER_THE_LOCK.format(install=install)],
                          capture_output=True, text=True, timeout=LIMIT_S)


def test_sigterm_stops_even_while_the_main_thread_holds_the_stop_events_lock():
    done = run("from kera.daemon.stop_signal import stop_on_sigterm\nstop_on_sigterm(stop.set)")
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr



def test_sigterm_says_so_in_the_log():
    done = run("import logging\nlogging.basicConfig(level=logging.INFO)\n"
               "from kera.daemon.stop_signal import stop_on_sigterm\nstop_on_sigterm(stop.set)")
    assert done.returncode == 0 and "SIGTERM received: stopping" in done.stderr, done.stderr
