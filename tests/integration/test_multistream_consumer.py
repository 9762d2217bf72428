"""One Consumer reading many streams, seeking, lag and assignment, against a real local cluster.

Values are `b"<stream>:<n>"`, so every record read names where it came from and which one it
is: a test can check no loss, no duplicate, and that a seek lands on the exact record.
"""

from __future__ import annotations

import threading
import time

import pytest

from kera import Consumer, Producer
from kera.errors import BadRequest

DRAIN_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster(brokers=2, backups=1, log_level="WARNING")


_names = iter(range(10**6))


def new_streams(cluster, n, streamlets=3):
    names = [f"ms-{next(_names)}" for _ in range(n)]
    with cluster.admin() as admin:
        for name in names:
            admin.create_stream(name, streamlets=streamlets)
    return names


def produce(cluster, streams, n, start=0):
    with Producer(cluster.bootstrap) as p:
        for name in streams:
            for i in range(start, start + n):
                p.send(name, f"{name}:{i}".encode(), key=str(i).encode())
        p.flush()


def drain(consumer, expected, timeout_s=DRAIN_TIMEOUT_S):
    """The next `expected` records (fails after `timeout_s`)."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expected:
        assert time.monotonic() < deadline, f"only {len(got)} of {expected} within {timeout_s} s"
        record = consumer.poll(timeout_s=0.5)
        if record is not None:
            got.append(record)
    return got


def nothing_more(consumer, wait_s=0.5):
    return consumer.poll(timeout_s=wait_s) is None


def test_one_consumer_reads_every_stream_with_one_thread_and_one_connection_per_broker(cluster):
    streams = new_streams(cluster, 8)
    produce(cluster, streams, 50)
    before = {t.name for t in threading.enumerate()}
    with Consumer(cluster.bootstrap, streams) as c:
        records = drain(c, 8 * 50)
        assert nothing_more(c)
        threads = [t for t in threading.enumerate() if t.name not in before]
        assert len(threads) == 1
        brokers = {c.info.address_of(sl) for name in streams
                   for sl in range(c._infos[name].streamlets)}
        assert set(c._fetcher.conns) == brokers
    assert all(r.value.decode().split(":")[0] == r.stream for r in records)
    assert sorted(r.value for r in records) == sorted(
        f"{name}:{i}".encode() for name in streams for i in range(50))


def test_positions_of_many_streams_resume_exactly(cluster):
    streams = new_streams(cluster, 3)
    produce(cluster, streams, 40)
    with Consumer(cluster.bootstrap, streams) as c:
        first = drain(c, 55)
        saved = c.positions()
    assert {p.stream for p in saved} == set(streams)
    with Consumer(cluster.bootstrap, streams, start=saved) as c:
        rest = drain(c, 3 * 40 - 55)
        assert nothing_more(c)
    assert sorted(r.value for r in first + rest) == sorted(
        f"{name}:{i}".encode() for name in streams for i in range(40))


def test_seek_lands_on_the_exact_record_and_drops_what_was_fetched_before(cluster):
    (name,) = new_streams(cluster, 1, streamlets=1)
    produce(cluster, [name], 100)
    with Consumer(cluster.bootstrap, name) as c:
        drain(c, 10)
        mark = c.positions()
        after_mark = drain(c, 30)      # the cache now holds records past these too
        c.seek(name, 0, mark)
        assert drain(c, 30) == after_mark
        c.seek_to_beginning()
        assert drain(c, 1)[0].value == f"{name}:0".encode()
        c.seek_to_end()
        assert nothing_more(c)
        produce(cluster, [name], 5, start=100)
        assert [r.value for r in drain(c, 5)] == [f"{name}:{i}".encode() for i in range(100, 105)]
        c.seek(mark)                   # the list form: positions of any assigned part
        assert drain(c, 1)[0].value == f"{name}:10".encode()
        with pytest.raises(BadRequest):
            c.seek(name, 5, "earliest")   # not a part this consumer reads


def test_watermarks_and_lag_count_records_produced_minus_consumed(cluster):
    streams = new_streams(cluster, 2)
    produce(cluster, streams, 60)
    with Consumer(cluster.bootstrap, streams, streamlets=[0, 1, 2]) as c:
        assert sum(c.watermarks(streams[0], sl)[1] for sl in range(3)) == 60
        assert all(c.watermarks(streams[1], sl)[0] == 0 for sl in range(3))
        assert sum(c.lag().values()) == 120
        drain(c, 45)
        lag = c.lag()
        assert set(lag) == {(name, sl) for name in streams for sl in range(3)}
        assert sum(lag.values()) == 120 - 45
        detail = c.lag_detail()
        assert all((d.records > 0) == (d.bytes > 0) for d in detail.values()), detail
        drain(c, 75)
        assert sum(c.lag().values()) == 0
        assert sum(d.bytes for d in c.lag_detail().values()) == 0


def test_assign_and_unassign_hand_parts_over_without_a_gap_or_duplicate(cluster):
    streams = new_streams(cluster, 2, streamlets=2)
    produce(cluster, streams, 40)
    events = []
    parts = [(name, sl) for name in streams for sl in range(2)]
    with Consumer(cluster.bootstrap, streams, streamlets=[],
                  on_assigned=lambda ps: events.append(("assigned", ps)),
                  on_revoked=lambda ps: events.append(("revoked", ps))) as c:
        assert c.assignment() == [] and nothing_more(c, 0.3)
        c.assign(parts)
        first = drain(c, 30)
        handed = c.unassign(parts[:2])
        assert c.assignment() == parts[2:]
        rest_here = drain(c, 40 - len([r for r in first if r.stream == streams[1]]))
        assert nothing_more(c)
    assert events == [("assigned", parts), ("revoked", parts[:2])]
    with Consumer(cluster.bootstrap, streams, streamlets=[]) as other:
        other.assign(parts[:2], handed)
        kept = [r for r in first if r.stream == streams[0]]
        moved = drain(other, 40 - len(kept))
        assert nothing_more(other)
    values = [r.value for r in first + rest_here + moved]
    assert len(values) == len(set(values)) == 80


class OffsetsTask:
    """A task that asks a broker for a streamlet's group table once (the engine's hook), then
    runs `then()` in the request thread, as a membership task calls assign()."""

    def __init__(self, address, sid, then=lambda: None):
        self.address, self.sid, self.then = address, sid, then
        self.asked = False
        self.done = threading.Event()
        self.reply = None

    def next_request(self, now):
        if self.asked:
            return None
        self.asked = True
        return self.address, ("offsets", {"sid": self.sid, "sl": 0})

    def on_reply(self, reply, now):
        self.reply = reply[0]
        self.then()
        self.done.set()

    def on_error(self, err, now):
        self.reply = err
        self.done.set()

    def next_wake(self, now):
        return None


def test_a_task_rides_the_request_thread_and_its_connections(cluster):
    (name,) = new_streams(cluster, 1, streamlets=1)
    produce(cluster, [name], 10)
    with Consumer(cluster.bootstrap, name) as c:
        drain(c, 10)
        conns = dict(c._fetcher.conns)
        task = OffsetsTask(c.info.address_of(0), c.info.id)
        c.add_task(task)
        assert task.done.wait(10.0)
        assert task.reply["ok"] is True and task.reply["groups"][0][3] == 10
        assert c._fetcher.conns == conns      # the broker's one connection, no new one


def test_a_task_can_assign_parts_from_the_request_thread(cluster):
    (name,) = new_streams(cluster, 1, streamlets=2)
    produce(cluster, [name], 20)
    assigned = []
    with Consumer(cluster.bootstrap, name, streamlets=[], on_assigned=assigned.append) as c:
        task = OffsetsTask(c.info.address_of(0), c.info.id,
                           then=lambda: c.assign([(name, 0), (name, 1)]))
        c.add_task(task)
        assert task.done.wait(10.0)
        assert assigned == [[(name, 0), (name, 1)]]
        assert sorted(r.value for r in drain(c, 20)) == sorted(
            f"{name}:{i}".encode() for i in range(20))


IDLE_WINDOW_S = 1.0
HELD_MS = 200
WAKE_TRIES = 5


def broker_counters(cluster, *names):
    """Each counter summed over the brokers."""
    with cluster.admin() as admin:
        brokers = admin.stats()["brokers"].values()
    return [sum(b.get(name, 0) for b in brokers) for name in names]


def test_an_idle_consumer_of_many_streams_is_held_by_its_brokers_and_woken_by_records(cluster):
    names = new_streams(cluster, 40, streamlets=1)
    with Consumer(cluster.bootstrap, names, fetch_max_wait_ms=HELD_MS) as c:
        assert nothing_more(c), "the streams are empty"
        fetches, expired = broker_counters(cluster, "fetch_requests", "fetch_held_expired")
        time.sleep(IDLE_WINDOW_S)   # the window whose fetches are counted: no condition to wait for
        fetches_after, expired_after = broker_counters(cluster, "fetch_requests", "fetch_held_expired")
        # Held up to 200 ms, each of the two brokers is asked about 5 times a second (and the
        # stats requests' own reads count nothing here); answered after the 5 ms back-off
        # alone, a consumer at its streams' end asked each broker up to 200 times a second.
        assert fetches_after - fetches <= 2 * (IDLE_WINDOW_S * 1000 / HELD_MS + 2)
        assert expired_after > expired, "held until the deadline while nothing came"
        # A record that lands between a held reply and the next request is read by that
        # request at once, with nothing to wake: a few tries make that chance negligible.
        for i in range(WAKE_TRIES):
            [woken] = broker_counters(cluster, "fetch_held_woken")
            produce(cluster, names[-1:], 1, start=i)
            assert [r.value for r in drain(c, 1)] == [f"{names[-1]}:{i}".encode()]
            if broker_counters(cluster, "fetch_held_woken")[0] > woken:
                break
        else:
            pytest.fail("no held fetch was answered by a record, only by its deadline")
