"""Conditional appends in the broker core and its lock table (kera.broker.locks), without
sockets: accepted only when no lock was written after the writer's high-water mark, refused
with nothing stored, retries answered once, the table bounded conservatively and rebuilt from
recovered chunks."""

import random

import pytest

from kera.codec import chunk
from kera.broker import locks as lockmod
from kera.broker.locks import LOCKS_PER_APPEND_MAX
from kera.broker.locks import LockTable
from kera.errors import CorruptChunk, LockConflict, from_reply
from tests.unit.test_broker_core import broker, desc, fetch_one
from tests.unit.test_record_numbers_core import rebuilt, stored

PID = iter(range(1000, 10**6))


def cond(locks, hwm, n=1, sl=0, pid=None, sid=1):
    return chunk.encode(next(PID) if pid is None else pid, 0, sid, sl,
                        [b"tx-%d" % i for i in range(n)], condition=(locks, hwm))


def answer(b, c):
    [r] = b.produce("t", [c], 0.0)
    return r


def test_a_lock_written_after_the_mark_refuses_the_append_and_stores_nothing():
    b = broker()
    assert answer(b, cond([1, 2], -1, n=3)) == [0, 0, 0, 0]      # records 0..2 wrote locks 1, 2
    assert answer(b, cond([3], -1)) == [0, 0, 3, 3]              # lock 3 never written: fine
    r = answer(b, cond([2, 3], 1))                               # lock 2 was written at 2 > 1
    assert r[0] == "lock_conflict" and r[2] is False
    err = from_reply(*r)
    assert isinstance(err, LockConflict) and (err.lock, err.number, err.high_water_mark) == (2, 2, 1)
    chunks, _ = fetch_one(b)
    assert sum(len(c) for c in chunks) == 4                      # nothing of it stored
    assert answer(b, cond([2, 3], 3))[3] == 4                    # read up to 3: accepted, number 4
    assert b.streams[1].streamlets[0].locks.entries == {1: 2, 2: 4, 3: 4}


def test_a_retried_conditional_append_is_answered_with_its_first_position_not_refused():
    b = broker()
    c = cond([9], -1, pid=77)
    first = answer(b, c)
    assert answer(b, c) == first              # its own lock write does not refuse the retry
    assert b.duplicates == 1


def test_locks_are_per_streamlet_and_records_carry_them_to_readers():
    b = broker()
    answer(b, cond([5], -1, sl=0))
    assert answer(b, cond([5], -1, sl=1))[3] == 0     # another streamlet: another table
    [c], _ = fetch_one(b)
    first = c.headers()[0]
    assert first[0][0] == chunk.CONDITION_LOCKS_HEADER and chunk.read_condition(c) == ((5,), -1)


def test_a_stream_with_several_active_groups_refuses_conditional_appends():
    b = broker(desc(Q=2))
    r = answer(b, cond([1], -1))
    assert r[0] == "bad_request" and "active_groups=1" in r[1] and r[2] is False


def test_too_many_locks_are_refused():
    b = broker()
    r = answer(b, cond(list(range(LOCKS_PER_APPEND_MAX + 1)), -1))
    assert r[0] == "bad_request" and "locks" in r[1]


def test_a_bounded_table_forgets_the_oldest_and_only_refuses_more(monkeypatch):
    monkeypatch.setattr(lockmod, "LOCK_ENTRIES_MAX", 3)
    t = LockTable()
    for n, lock in enumerate([10, 11, 12, 13]):
        t.record([lock], n)
    assert len(t) == 3 and t.floor == 0 and 10 not in t.entries
    assert t.conflict([10], 0) is None and t.conflict([10], -1) == (10, 0)   # taken as at floor
    t.record([11], 7)                  # rewritten: now the newest
    t.record([14], 8)
    assert 12 not in t.entries and t.floor == 2


@pytest.mark.parametrize("seed", range(3))
def test_the_lock_table_is_rebuilt_from_recovered_chunks(seed):
    rng = random.Random(seed)
    b = broker(desc(G=2, seg=4096, streamlets=1))
    for _ in range(120):
        locks = rng.sample(range(20), rng.randrange(1, 4))
        answer(b, cond(locks, rng.randrange(-1, 300), n=rng.randrange(1, 20)))
    want = b.streams[1].streamlets[0].locks.entries
    chunks = stored(b.streams[1].streamlets[0])
    rng.shuffle(chunks)
    _, got = rebuilt(chunks, Q=1)
    assert got.locks.entries == want and got.locks.floor == -1


@pytest.mark.parametrize("damage", ["undecodable_key", "missing_mark"])
def test_a_conditional_chunk_with_bad_condition_headers_is_refused_as_corrupt(damage):
    b = broker()
    good = cond([1], -1, pid=5)
    h = chunk.read_header(good)
    body = bytearray(good[chunk.HEADER_SIZE:])
    name = chunk.CONDITION_LOCKS_HEADER if damage == "undecodable_key" else chunk.CONDITION_HWM_HEADER
    at = bytes(body).index(name.encode())
    body[at] = 0xFF if damage == "undecodable_key" else ord("X")
    bad = chunk.seal(h.flags, bytes(body), 5, 0, 1, 0, h.record_count)
    r = answer(b, bad)
    assert r[0] == "corrupt_chunk" and r[2] is False
    streamlet = b.streams[1].streamlets.get(0)
    assert streamlet is None or sum(g.head for g in streamlet.groups) == 0      # nothing stored


def test_an_unknown_compression_code_is_refused():
    buf = bytearray(chunk.encode(1, 0, 1, 0, [b"a"]))
    buf[3] |= chunk.COMPRESSION_MASK
    buf[4:8] = chunk.header_crc(buf).to_bytes(4, "little")
    with pytest.raises(CorruptChunk, match="unknown compression"):
        chunk.read_header(buf)


def test_a_conflict_over_a_record_not_yet_durable_is_retriable_until_it_is():
    """The lock table takes a lock at append; a refusal is final only once the record that
    took it is durable (a failed-over broker's last appends may never be)."""
    from kera.broker.core import Broker, BrokerConfig
    from kera.errors import NotReady
    from tests.unit.test_broker_core import ME
    from tests.unit.test_broker_replication import FakeBackups, ack, backup_list
    b = Broker("n1", BrokerConfig(replication_timeout_s=2.0), broker_id=ME)
    b.apply_metadata([desc(R=2)], 1)
    b.placement.set_backups(backup_list(1), 0.0)
    fb = FakeBackups()
    b.produce("first", [cond([7], -1)], 0.0)           # record 0 takes lock 7, not durable yet
    r = answer(b, cond([7], -1))
    assert r[0] == "not_ready" and r[2] is True        # retriable: not a conflict yet
    ack(b, fb, b.sync(0.0))
    b.take_replies()
    err = from_reply(*answer(b, cond([7], -1)))
    assert isinstance(err, LockConflict) and (err.lock, err.number) == (7, 0)
    assert not isinstance(err, NotReady)
