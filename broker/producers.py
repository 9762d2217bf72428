"""The duplicate-detection table: per (producer id, stream id, streamlet), the last sequence
stored and where that chunk went.

A chunk with `sequence <= last` is a retry of something stored: acknowledge it, store nothing.
`last + 1` (or 0 for a producer never seen) is appended; anything further ahead is a gap. The
table is bounded (least recently used entries are evicted); `evictions` tells the caller that an
unknown producer may be one it forgot, so it can look the producer up in the stored chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kera import config

APPEND = 0
DUPLICATE = 1
GAP = 2


class Entry(NamedTuple):
    sequence: int
    group: int
    segment: int
    base_offset: int
    end_offset: int   # record offset just past the chunk, for "is it durable yet"


class ProducerTable:
    __slots__ = ("max_entries", "_entries", "evictions")

    def __init__(self, max_entries: int = config.PRODUCER_TABLE_MAX):
        assert max_entries >= 1
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, int, int], Entry] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, int, int]) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[int, int, int], entry: Entry) -> None:
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
        entries[key] = entry
        if len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evictions += 1

    def drop_stream(self, stream_id: int) -> None:
        """Forget a deleted stream's producers (stream ids are never reused, so this only
        frees room)."""
        for key in [k for k in self._entries if k[1] == stream_id]:
            del self._entries[key]


def classify(entry: Entry | None, sequence: int) -> int:
    """APPEND, DUPLICATE or GAP for a chunk with `sequence` given the producer's entry."""
    if entry is None:
        return APPEND if sequence == 0 else GAP
    last = entry.sequence
    if sequence <= last:
        return DUPLICATE
    return APPEND if sequence == last + 1 else GAP
