"""Extra sans-IO tasks the consumer's request thread drives alongside fetching. Sans-IO.

A task is any object with

    next_request(now) -> (address, (op, fields)) | None   # one request at a time per task
    on_reply(reply, now)      # reply = (header, frames) of a successful reply
    on_error(err, now)        # a KeraError: an error reply, a timeout, an unreachable peer
    next_wake(now) -> float | None   # monotonic time it wants to be asked again, or None
    check(now)                # optional: called every turn, also while a request is in flight
    check_wake(now) -> float | None   # optional: when `check` wants to run (while in flight)

It is the hook for group membership (heartbeats, joins, commits): the request thread sends its
requests on the same one connection per address it fetches on, so a consumer of any number of
streams keeps one thread and one connection per peer. Times are `time.monotonic()` seconds.
TaskRunner is the bookkeeping: which task has which request in flight, and until when.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kera.codec import schema
from kera.errors import KeraError, Timeout


class Task(Protocol):
    def next_request(self, now: float) -> tuple[str, tuple[str, dict]] | None: ...

    def on_reply(self, reply: tuple[dict, list], now: float) -> None: ...

    def on_error(self, err: KeraError, now: float) -> None: ...

    def next_wake(self, now: float) -> float | None: ...


@dataclass
class Pending:
    task: object
    address: str
    deadline: float


class TaskRunner:
    def __init__(self, request_timeout_s: float):
        self.request_timeout_s = request_timeout_s
        self.tasks: list = []
        self.pending: dict[tuple[str, int], Pending] = {}   # (address, request id) -> Pending
        self._busy: set[int] = set()                         # id() of tasks with one in flight

    def add(self, task) -> None:
        self.tasks.append(task)

    def requests(self, now: float) -> list[tuple[object, str, str, dict]]:
        """(task, address, op, fields) of each idle task that has a request to send now."""
        out = []
        for task in self.tasks:
            if id(task) in self._busy:
                check = getattr(task, "check", None)
                if check is not None:
                    check(now)   # deadlines that cannot wait for the reply (self-fencing)
                continue
            want = task.next_request(now)
            if want is not None:
                address, (op, fields) = want
                out.append((task, address, op, fields))
        return out

    def sent(self, task, address: str, req_id: int, now: float) -> None:
        self.pending[(address, req_id)] = Pending(task, address, now + self.request_timeout_s)
        self._busy.add(id(task))

    def send_failed(self, task, err: KeraError, now: float) -> None:
        task.on_error(err, now)

    def on_reply(self, address: str, header: dict, frames: list, now: float) -> bool:
        """Hand a reply to the task that asked; False when it is no task's (a fetch reply)."""
        p = self.pending.pop((address, header.get("id")), None)
        if p is None:
            return False
        self._busy.discard(id(p.task))
        if header.get("ok") is True:
            p.task.on_reply((header, frames), now)
        else:
            p.task.on_error(schema.error_reply(header), now)
        return True

    def expire(self, now: float) -> None:
        for key, p in list(self.pending.items()):
            if p.deadline <= now:
                del self.pending[key]
                self._busy.discard(id(p.task))
                p.task.on_error(Timeout(f"no reply from {p.address} within "
                                        f"{self.request_timeout_s:.1f} s"), now)

    def next_wake(self, now: float) -> float | None:
        times = [p.deadline for p in self.pending.values()]
        for task in self.tasks:
            if id(task) in self._busy:
                # Its requests wait for the reply in flight: waking for them would spin.
                check_wake = getattr(task, "check_wake", None)
                t = check_wake(now) if check_wake is not None else None
            else:
                t = task.next_wake(now)
            if t is not None:
                times.append(t)
        return min(times, default=None)
