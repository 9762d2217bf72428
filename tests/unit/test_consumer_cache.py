"""The consumer's caller side, without sockets: its cache (kera.consumer.cache) hands out what
the request thread pushed, in order, and keeps exact positions of what it handed out; its
shared reading state (kera.consumer.reading) moves and drops parts on both sides at once."""

import pytest

from kera.codec import chunk
from kera.codec.position import Position
from kera.consumer.cache import Cache
from kera.consumer.cursor import ChunkItem, ConsumedCursor, ErrorItem, FetchCursor, LowItem
from kera.consumer.fetching import FetchState
from kera.consumer.reading import Reading
from kera.consumer.tasks import TaskRunner
from kera.errors import BadRequest, ClientClosed, KeraError

A, B = ("a", 0), ("b", 1)


def chunk_at(part, base, n, group=0):
    buf = bytearray(chunk.encode(1, 0, 7, part[1], [b"%s%d" % (part[0].encode(), base + i)
                                                    for i in range(n)]))
    chunk.stamp(buf, group, 0, base, base)
    return ChunkItem(part, chunk.Chunk(bytes(buf)), 0)


class Wakes:
    def __init__(self):
        self.count = 0

    def __call__(self):
        self.count += 1


def cache_of(*parts, chunks_max=4):
    wakes = Wakes()
    c = Cache(chunks_max, wakes)
    c.consumed = {part: ConsumedCursor(part[1]) for part in parts}
    return c, wakes


def test_records_come_in_push_order_and_positions_follow_what_was_handed_out():
    c, _ = cache_of(A, B)
    c.push([chunk_at(A, 0, 2), chunk_at(B, 0, 1), chunk_at(A, 2, 1)])
    got = [c.poll(0) for _ in range(3)]
    assert [(r.stream, r.offset) for r in got] == [("a", 0), ("a", 1), ("b", 0)]
    # A's first chunk is finished; its second is fetched but not handed out.
    assert c.positions() == [Position("a", 0, 0, 2), Position("b", 1, 0, 1)]
    assert c.poll(0).offset == 2 and c.poll(0) is None
    assert c.stats() == {"records_consumed": 4, "cached_chunks": 0}


def test_a_full_cache_wakes_the_request_thread_once_a_chunk_is_handed_out():
    c, wakes = cache_of(A, chunks_max=2)
    c.push([chunk_at(A, 0, 1), chunk_at(A, 1, 1)])
    assert c.room() == 0 and wakes.count == 0
    c.poll(0)                                    # walks the first chunk: room for one more
    assert wakes.count == 1 and c.room() == 1
    c.poll(0)
    assert wakes.count == 1                      # not waiting any more: no second wake-up


def test_restart_drops_what_was_fetched_of_a_part_and_its_half_walked_chunk():
    c, _ = cache_of(A, B)
    c.push([chunk_at(A, 0, 3), chunk_at(B, 0, 2), chunk_at(A, 3, 2)])
    assert c.poll(0).offset == 0                 # A's first chunk is being walked
    with c.lock:
        c.restart(A, ConsumedCursor(0, 0, {0: 40}))
    assert c.stats()["cached_chunks"] == 1       # B's chunk only
    assert c.positions([A]) == [Position("a", 0, 0, 40)]
    assert [(r.stream, r.offset) for r in (c.poll(0), c.poll(0))] == [("b", 0), ("b", 1)]
    assert c.poll(0) is None


def test_remove_returns_the_exact_positions_of_a_part_and_forgets_it():
    c, _ = cache_of(A, B)
    c.push([chunk_at(A, 10, 3), LowItem(B, 2)])
    c.poll(0)
    with c.lock:
        assert c.remove([A, ("x", 9)]) == [Position("a", 0, 0, 11)]
    assert c.parts() == [B] and c.missing([A, B]) == [A]
    assert c.poll(0) is None                     # the LowItem moved B's low, nothing to hand out
    assert c.positions() == [Position("b", 1, 2, 0)]


def test_a_batch_poll_delivers_what_precedes_an_error_then_raises_it():
    c, _ = cache_of(A)
    c.push([chunk_at(A, 0, 2), ErrorItem(KeraError("gone"))])
    batches = c.poll_batch(0, limit=10)
    assert [(b.offset, len(b)) for b in batches] == [(0, 2)]
    with pytest.raises(KeraError, match="gone"):
        c.poll_batch(0, limit=10)
    with pytest.raises(KeraError, match="gone"):   # the error sticks once the cache is empty
        c.poll(0)


def test_each_chunk_handed_out_is_noted_and_a_closed_cache_ends_polls():
    c, _ = cache_of(A)
    noted = []
    c.on_chunk = lambda: noted.append(True)
    c.push([chunk_at(A, 0, 1), chunk_at(A, 1, 1)])
    c.poll(0)
    c.poll_batch(0, limit=1)
    assert len(noted) == 2
    c.close()
    with pytest.raises(ClientClosed):
        c.poll(None)                             # would wait forever on an open cache


def reading_of(*parts):
    cache, _ = cache_of()
    fetch = FetchState({"a": 7, "b": 8}, {}, fetch_max_bytes=1 << 20, request_timeout_s=1.0,
                       idle_wait_s=0.0)
    r = Reading(fetch, TaskRunner(1.0), cache, "read_committed")
    r.restart({part: (0, {}, None, True) for part in parts})
    return r


def test_reading_moves_a_part_on_both_sides_at_once_and_drops_it_from_both():
    r = reading_of(A, B)
    r.cache.push([chunk_at(A, 0, 2)])
    r.restart({A: (3, {3: 9}, 5, False)})
    cursor = r.fetch.cursors[A]
    assert (cursor.low, cursor.offsets, cursor.epoch, cursor.earliest) == (3, {3: 9}, 5, False)
    assert r.cache.positions([A]) == [Position("a", 0, 3, 9, 5)]
    assert r.cache.poll(0) is None               # what was fetched before the move is gone
    assert r.remove([A]) == [Position("a", 0, 3, 9, 5)]
    assert A not in r.fetch.cursors and r.cache.parts() == [B]
    assert isinstance(r.fetch.cursors[B], FetchCursor)


def test_reading_refuses_parts_not_assigned_and_stops_with_a_closed_cache():
    r = reading_of(A)
    r.check_assigned([A])
    with pytest.raises(BadRequest, match="not assigned"):
        r.check_assigned([A, B])
    assert not r.stopping()
    r.fetch.fatal = True
    assert r.stopping()
    r.fetch.fatal = False
    r.cache.close()
    assert r.stopping()
