"""The duplicate-detection index: per (producer id, stream id, streamlet), the last sequence
stored and where that chunk went.

A chunk with `sequence <= last` is a retry of something stored: acknowledge it, store nothing.
`last + 1` (or 0 for a producer never seen) is appended; anything further ahead is a gap.

Two hash tables, so every operation is O(1) whatever the number of producers:

- `hot`: the recently used entries, LRU-bounded (`max_entries`);
- `retained`: entries evicted from `hot`, kept (even once retention deleted the chunks: an
  idle producer resuming with `last + 1` must not see a gap). Bounded by `retained_max`
  (oldest evicted first) so that a flood of one-chunk producers cannot take the broker's
  memory; past both bounds a producer is forgotten (`forgotten` counts them): its retry of
  sequence 0 would be stored again, and any later sequence is a gap.

The table is rebuilt from the chunk headers when a broker reloads its disk (kera.broker.reload)
or rebuilds a streamlet (kera.broker.rebuild): each header carries producer id and sequence.
`probes` counts hash-table operations, so tests can check the O(1) cost without timing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kera import config
from kera.codec import txn
from kera.codec.chunk import FLAG_KAFKA

APPEND = 0
DUPLICATE = 1
GAP = 2

Key = tuple[int, int, int]   # (producer id, stream id, streamlet)


class Entry(NamedTuple):
    sequence: int
    group: int
    segment: int
    base_offset: int
    end_offset: int   # record offset just past the chunk, for "is it durable yet"


class ProducerTable:
    __slots__ = ("max_entries", "retained_max", "_entries", "_retained", "evictions",
                 "forgotten", "probes")

    def __init__(self, max_entries: int = config.PRODUCER_TABLE_MAX,
                 retained_max: int = config.PRODUCER_RETAINED_MAX):
        assert max_entries >= 1 and retained_max >= 0
        self.max_entries = max_entries
        self.retained_max = retained_max
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        self._retained: dict[Key, Entry] = {}     # insertion order: oldest evicted first
        self.evictions = 0     # entries moved from `hot` to `retained`
        self.forgotten = 0     # entries dropped from `retained` (its bound)
        self.probes = 0

    def __len__(self) -> int:
        """Entries in the hot table (the retained ones: `retained_count`)."""
        return len(self._entries)

    @property
    def retained_count(self) -> int:
        return len(self._retained)

    def verdict(self, h, sid: int, sl: int) -> tuple:
        """(key, entry, verdict) of a stored chunk's producer (`h`: its ChunkHeader): kera's
        rule (sequences count chunks), Kafka's for a Kafka batch (sequences count records),
        none for a Kafka producer without idempotence (ids below txn.ANONYMOUS_PRODUCER_IDS:
        every batch is new, as Kafka has it)."""
        key = (h.producer_id, sid, sl)
        if h.flags & FLAG_KAFKA:
            if txn.is_anonymous_kafka(h.producer_id):
                return None, None, APPEND
            entry = self.get(key)
            return key, entry, classify_kafka(entry, h.sequence)
        entry = self.get(key)
        return key, entry, classify(entry, txn.plain_sequence(h.sequence))

    def get(self, key: Key) -> Entry | None:
        """The producer's entry (moved back to the hot table if it was evicted)."""
        self.probes += 1
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        self.probes += 1
        entry = self._retained.pop(key, None)
        if entry is not None:
            self.put(key, entry)
        return entry

    def put(self, key: Key, entry: Entry) -> None:
        self.probes += 1
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
        entries[key] = entry
        if len(entries) > self.max_entries:
            self._evict(*entries.popitem(last=False))

    def _evict(self, key: Key, entry: Entry) -> None:
        self.probes += 1
        self.evictions += 1
        retained = self._retained
        retained.pop(key, None)
        retained[key] = entry
        if len(retained) > self.retained_max:
            del retained[next(iter(retained))]
            self.forgotten += 1

    def drop_stream(self, stream_id: int) -> None:
        """Forget a deleted stream's producers (stream ids are never reused, so this only
        frees room). A scan, but only on a stream deletion, never per chunk."""
        for table in (self._entries, self._retained):
            for key in [k for k in table if k[1] == stream_id]:
                del table[key]


# The producer id of a Kafka batch from a producer without idempotence (its producerId -1):
# no duplicate detection and no table entry, as a Kafka broker has none for it.
ANONYMOUS_PRODUCER_ID = txn.ANONYMOUS_PRODUCER_ID


def classify_kafka(entry: Entry | None, sequence: int) -> int:
    """APPEND, DUPLICATE or GAP for a Kafka idempotent producer's batch (kera.codec.chunk
    FLAG_KAFKA): Kafka's sequences count records, so the next batch's base sequence is the
    last one's plus its record count; a producer this broker has no entry of (a new
    producer id or epoch) starts where it says, as Kafka brokers since 2.5 accept."""
    if entry is None:
        return APPEND
    expected = entry.sequence + (entry.end_offset - entry.base_offset)
    if sequence == expected:
        return APPEND
    return DUPLICATE if sequence < expected else GAP


def classify(entry: Entry | None, sequence: int) -> int:
    """APPEND, DUPLICATE or GAP for a chunk with `sequence` given the producer's entry."""
    if entry is None:
        return APPEND if sequence == 0 else GAP
    last = entry.sequence
    if sequence <= last:
        return DUPLICATE
    return APPEND if sequence == last + 1 else GAP
