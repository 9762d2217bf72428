"""What a client's request thread is given from outside: its clock, its connections, its
wake-up pipe and how it is started.

The real environment (ClientEnv()) is time.monotonic, kera.net.rpc.Connection, an os pipe and a
thread. The simulation (tests/sim/clients.py) gives a simulated clock, connections over its
simulated network, a wake-up that schedules an event, and a `start` that adopts the request
thread into a simulated process which calls its `step` and `deliver` instead of `run`: the
Producer and Consumer it drives are the real ones, through their front door.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol


class Transport(Protocol):
    """One connection to one address (kera.net.rpc.Connection's sending half)."""

    def send(self, op: str, fields: dict | None = None, frames=(), timeout_s: float | None = None
             ) -> int: ...

    def close(self) -> None: ...


def _connect(address: str, timeout_s: float, key_file: str | None) -> Transport:
    from kera.net import rpc
    return rpc.Connection(address, timeout_s=timeout_s, key_file=key_file)


def _waker():
    from kera.client.request_thread import Waker
    return Waker()


def _start(thread) -> None:
    thread.start()


@dataclass(frozen=True)
class ClientEnv:
    clock: Callable[[], float] = time.monotonic
    connect: Callable[[str, float, str | None], Transport] = _connect
    waker: Callable[[], object] = _waker
    start: Callable[[object], None] = _start
    # Called with the client's kera.client.metadata.Metadata before its first lookup (None: nothing):
    # a simulated process hands over the descriptors it learnt asynchronously, since the
    # client's blocking first lookup cannot wait inside a simulation's event.
    prime: Callable[[object], None] | None = None
