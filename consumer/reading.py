"""What a consumer reads, shared by its caller and its request thread: one explicit state object.

* `fetch` (kera.consumer.fetching.FetchState): each part's fetch cursor and in-flight reads;
* `tasks` (kera.consumer.tasks.TaskRunner): extra requests such as group membership's;
* `cache` (kera.consumer.cache.Cache): what was fetched and not handed out, and the positions
  of what was.

`lock` guards `fetch` and `tasks`; it is taken before the cache's lock when both are (the
request thread's order). It is re-entrant: a task's on_reply runs under it and may call
assign / unassign / seek. Moving a part (`restart`) or dropping it (`remove`) changes the fetch
side and the cache side under both locks, so a reply can never slip in between.
"""

from __future__ import annotations

import threading

from kera.codec.position import Position
from kera.consumer.cache import Cache
from kera.consumer.cursor import ConsumedCursor, FetchCursor
from kera.consumer.fetching import FetchState
from kera.consumer.tasks import TaskRunner
from kera.errors import BadRequest


class Reading:
    def __init__(self, fetch: FetchState, tasks: TaskRunner, cache: Cache, isolation_level: str):
        self.fetch = fetch
        self.tasks = tasks
        self.cache = cache
        self.isolation_level = isolation_level   # sent with every fetch
        self.lock = threading.RLock()

    def restart(self, starts: dict) -> None:
        """Read each part from its start {part: (low, offsets, epoch, earliest)} on; anything
        fetched before for it is dropped."""
        with self.lock, self.cache.lock:
            for part, (low, offsets, epoch, earliest) in starts.items():
                self.fetch.set_cursor(part, FetchCursor(part[1], low, offsets, earliest=earliest,
                                                        epoch=epoch))
                self.cache.restart(part, ConsumedCursor(part[1], low, offsets, epoch))

    def remove(self, parts) -> list[Position]:
        """Stop reading `parts`; returns the positions of what was handed out of them."""
        with self.lock, self.cache.lock:
            gone = [p for p in parts if p in self.cache.consumed]
            out = self.cache.remove(gone)
            for part in gone:
                self.fetch.remove(part)
        return out

    def check_assigned(self, parts) -> None:
        missing = self.cache.missing(parts)
        if missing:
            raise BadRequest(f"parts {missing} are not assigned to this consumer: assign() them first")

    def add_task(self, task) -> None:
        with self.lock:
            self.tasks.add(task)

    def stopping(self) -> bool:
        """Whether the request thread is to exit: the consumer closed, or a read failed for good."""
        return self.cache.closed or self.fetch.fatal
