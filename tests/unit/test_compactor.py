"""The broker's compaction passes (kera.broker.compactor), driven without sockets or threads: an
R=2 compacted stream's finished groups are compacted by a pass, the new chunks replicated
through the group's virtual log to (fake) backups, and swapped in only once durable; readers
before, during and after see every key's latest value with its number; a pass whose segment
went meanwhile swaps nothing; bounds (dirty segments per pass, min.compaction.lag.ms) hold; and
what the backups hold after a kill -9 before, during or after the swap recovers compacted or,
segment by segment, as appended."""

import pytest

from kera.broker import compactor
from kera.broker.rebuild import StreamletRebuild
from kera.broker.tier import TierConfig
from kera.codec import chunk
from kera.consumer.cursor import FetchCursor, cursors_with_epochs

from tests.unit.test_broker_replication import FakeBackups, ack, broker
from tests.unit.test_compaction_recovery import records_of
from tests.unit.test_consumer_gaps import drain, fetch_all

KiB = 1024
KEYS = 40


def desc(**kw):
    return {"name": "s1", "id": 1, "streamlets": 1, "active_groups": 1, "replication": 2,
            "group_segments": 2, "segment_size_bytes": 8 * KiB, "durability": "memory",
            "placement": [7], "brokers": {}, "version": 1, "ready": True,
            "cleanup_policy": "compact", **kw}


def produce(b, backups, chunks=60, deleted=(b"k03", b"k17")):
    """`chunks` chunks of 8 updates of KEYS keys (tombstones for `deleted` at the end), each
    acknowledged; returns every record as (number, key, value)."""
    written, n = [], 0
    for seq in range(chunks):
        keys = [b"k%02d" % ((seq * 8 + i) % KEYS) for i in range(8)]
        values = [b"%s=%d" % (k, seq) + b"." * 100 for k in keys]
        if seq == chunks - 1:
            keys[:len(deleted)] = deleted
            values[:len(deleted)] = [None] * len(deleted)
        b.produce(seq, [chunk.encode(1, seq, 1, 0, values, keys=keys)], 0.0)
        ack(b, backups, b.sync(0.0))
        written += [(n + i, keys[i], values[i]) for i in range(8)]
        n += 8
    return written


def latest(written, below):
    """What compaction of the records below `below` keeps, and every record from it on."""
    last = {}
    for r in written:
        if r[0] < below:
            last[r[1]] = r
    return sorted(last.values()) + [r for r in written if r[0] >= below]


def rows(b):
    return [(r.number, r.key, r.value) for r in drain(fetch_all(b, FetchCursor(0, earliest=True)))]


def finished_end(b):
    groups = b.streams[1].streamlets[0].groups
    return max(g.number_base + g.head for g in groups if g.finished)


def run(b, c, backups, now_ms=1000):
    """One pass: chosen, run (here, not on a thread), replicated, swapped."""
    job = c.next_pass(now_ms)
    assert job is not None
    c.built(compactor.run_pass(job), None)
    before = rows(b)
    ack(b, backups, b.sync(1.0), 1.0)
    c.on_durable()
    return before


def test_a_pass_replicates_then_swaps_and_readers_see_the_latest_of_each_key():
    backups = FakeBackups()
    b = broker(desc())
    written = produce(b, backups)
    assert rows(b) == written
    c = compactor.Compactor(b)
    end = finished_end(b)
    job = c.next_pass(1000)
    c.built(compactor.run_pass(job), None)
    assert c.pending is not None and not c.pending.durable()
    c.on_durable()
    assert rows(b) == written            # not swapped before its chunks are durable
    ack(b, backups, b.sync(1.0), 1.0)
    c.on_durable()
    assert c.pending is None and c.passes == 1 and c.clean_ends[(1, 0)] == end
    got = rows(b)
    assert got == latest(written, end) and len(got) < len(written)
    assert c.bytes_after < c.bytes_before
    assert c.next_pass(1000) is None      # nothing dirty is left


def test_backups_hold_the_rewrite_and_a_second_pass_goes_on_from_the_clean_end():
    backups = FakeBackups()
    b = broker(desc(min_cleanable_dirty_ratio=0.01))
    written = produce(b, backups, chunks=30)
    c = compactor.Compactor(b)
    run(b, c, backups)
    first_end = c.clean_ends[(1, 0)]
    more = produce_more(b, backups, start=30, n=len(written))
    written += more
    run(b, c, backups, now_ms=2000)
    assert c.clean_ends[(1, 0)] > first_end
    assert rows(b) == latest(written, c.clean_ends[(1, 0)])
    sparse = [k for rep in backups.replicas.values() for k in _flags(rep)
              if k & chunk.FLAG_SPARSE]
    assert sparse   # the compacted chunks were replicated like appended ones


def produce_more(b, backups, start, n):
    out = []
    for seq in range(start, start + 30):
        keys = [b"k%02d" % ((seq * 8 + i) % KEYS) for i in range(8)]
        values = [b"%s=%d" % (k, seq) + b"." * 100 for k in keys]
        b.produce(seq, [chunk.encode(1, seq, 1, 0, values, keys=keys)], 0.0)
        ack(b, backups, b.sync(0.0))
        out += [(n + i, keys[i], values[i]) for i in range(8)]
        n += 8
    return out


def _flags(rep):
    pos = 0
    while pos < len(rep):
        h = chunk.read_header(memoryview(rep)[pos:])
        yield h.flags
        pos += h.size


def test_a_reader_mid_pass_sees_every_key_latest_value():
    backups = FakeBackups()
    b = broker(desc())
    written = produce(b, backups)
    c = compactor.Compactor(b)
    reader = fetch_all(b, FetchCursor(0, earliest=True))
    first = [reader.poll(0) for _ in range(len(written) // 3)]
    positions = reader.positions()
    run(b, c, backups)
    (low, offsets, epoch), = cursors_with_epochs(positions, "s1").values()
    rest = drain(fetch_all(b, FetchCursor(0, low, offsets, epoch=epoch)))
    seen = {}
    for r in first + rest:
        seen[r.key] = r.value
    assert seen == {k: v for _, k, v in written}
    numbers = [r.number for r in first + rest]
    assert numbers == sorted(set(numbers))


@pytest.mark.parametrize("when", ["built", "replicated"])
def test_a_segment_released_meanwhile_is_not_swapped(when):
    backups = FakeBackups()
    b = broker(desc())
    produce(b, backups)
    c = compactor.Compactor(b)
    built = compactor.run_pass(c.next_pass(1000))
    gone, kept = built.rewrites[0], built.rewrites[1:]
    assert kept
    if when == "built":
        gone.old.release()                  # as retention deleting its group does
    c.built(built, None)
    if when == "replicated":
        gone.old.release()
    ack(b, backups, b.sync(1.0), 1.0)
    c.on_durable()
    assert c.pending is None and gone.group.segments[gone.index] is gone.old
    assert all(w.group.segments[w.index] is w.new for w in kept)
    assert gone.new.released == (when == "replicated")


def test_a_failed_pass_changes_nothing():
    b = broker(desc())
    produce(b, FakeBackups())
    c = compactor.Compactor(b)
    c.next_pass(1000)
    c.built(None, RuntimeError("boom"))
    assert not c.busy and c.clean_ends == {}


def test_a_pass_maps_a_bounded_number_of_dirty_segments_and_the_next_goes_on(monkeypatch):
    monkeypatch.setattr(compactor, "PASS_SEGMENTS_MAX", 2)
    backups = FakeBackups()
    b = broker(desc(min_cleanable_dirty_ratio=0.01))
    written = produce(b, backups)
    c = compactor.Compactor(b)
    ends = []
    while (job := c.next_pass(1000)) is not None:
        assert sum(1 for g, si, _, _ in job.segments
                   if compactor.segment_end(g, si) > job.clean_end) <= 2
        c.built(compactor.run_pass(job), None)
        ack(b, backups, b.sync(1.0), 1.0)
        c.on_durable()
        ends.append(c.clean_ends[(1, 0)])
    assert len(ends) > 1 and ends == sorted(set(ends)) and ends[-1] == finished_end(b)
    assert rows(b) == latest(written, ends[-1])


def test_min_compaction_lag_and_policy_choose_what_is_compacted(tmp_path):
    backups = FakeBackups()
    b = broker(desc(min_compaction_lag_ms=5000))
    b.set_wall_clock(1000)
    produce(b, backups)
    c = compactor.Compactor(b)
    assert c.next_pass(3000) is None          # every group appended to less than 5 s ago
    assert c.next_pass(7000) is not None
    b = broker(desc(cleanup_policy="delete"))   # not compacted: a delete-policy stream
    produce(b, backups)
    assert compactor.Compactor(b).next_pass(10**9) is None
    # An R=1 stream of a broker with a data dir: its segments' files are rewritten
    # (tests/unit/test_compaction_files.py).
    b = broker({**desc(), "replication": 1}, tier=TierConfig(root=tmp_path))
    produce(b, backups)
    job = compactor.Compactor(b).next_pass(10**9)
    assert job is not None and job.on_file and not job.replicated


def test_an_r1_stream_without_a_data_dir_is_swapped_as_soon_as_built():
    backups = FakeBackups()
    b = broker({**desc(), "replication": 1})
    written = produce(b, backups)
    c = compactor.Compactor(b)
    end = finished_end(b)
    job = c.next_pass(1000)
    assert job is not None and not job.replicated
    c.built(compactor.run_pass(job), None)
    assert c.pending is None and c.passes == 1   # nothing to wait for
    got = rows(b)
    assert got == latest(written, end) and len(got) < len(written)
    assert not backups.replicas                  # no virtual log carried the rewrite


def test_the_pass_reads_the_memory_it_was_given_even_once_its_segment_lets_it_go():
    backups = FakeBackups()
    b = broker(desc())
    produce(b, backups)
    job = compactor.Compactor(b).next_pass(1000)
    expected = compactor.run_pass(job)
    for _, _, seg, _ in job.segments:
        seg.drop_memory()   # as tiering does mid-pass: the thread never maps its file
    again = compactor.run_pass(job)
    assert [(w.index, bytes(w.new.mv[:w.new.used_bytes])) for w in again.rewrites] == \
        [(w.index, bytes(w.new.mv[:w.new.used_bytes])) for w in expected.rewrites]


def replica_chunks(backups) -> list[bytes]:
    """Every chunk the backups hold, as recovery reads them."""
    out = []
    for rep in backups.replicas.values():
        pos = 0
        while pos < len(rep):
            size = chunk.chunk_size(rep, pos)
            out.append(bytes(rep[pos:pos + size]))
            pos += size
    return out


@pytest.mark.parametrize("swapped", [False, True])
def test_a_broker_killed_after_replicating_a_pass_is_recovered_compacted(swapped):
    """kill -9 before or after the swap, once the pass's chunks are durable: the backups hold
    originals and whole rewrites; recovery (kera.broker.rebuild) serves the rewrites."""
    backups = FakeBackups()
    b = broker(desc())
    written = produce(b, backups)
    c = compactor.Compactor(b)
    c.built(compactor.run_pass(c.next_pass(1000)), None)
    end = c.pending.built.clean_end
    ack(b, backups, b.sync(1.0), 1.0)
    if swapped:
        c.on_durable()
    rb = StreamletRebuild(1, 0, 1, 2, 8 * KiB)
    for buf in replica_chunks(backups):
        rb.add(memoryview(buf), chunk.read_header(buf), True)
    assert records_of(rb.finish()) == latest(written, end)


def test_a_partly_replicated_pass_recovers_each_segment_whole():
    """kill -9 while a pass's chunks are half replicated: a segment whose rewrite is partial on
    the backups comes back as it was appended, the others compacted; either way every key's
    latest value is there, once, in number order."""
    backups = FakeBackups()
    b = broker(desc())
    written = produce(b, backups)
    c = compactor.Compactor(b)
    c.built(compactor.run_pass(c.next_pass(1000)), None)
    held = replica_chunks(backups)
    ack(b, backups, b.sync(1.0), 1.0)
    rewritten = [buf for buf in replica_chunks(backups)
                 if chunk.compacted(chunk.read_header(buf))]
    last = [buf for buf in rewritten if chunk.compacted(chunk.read_header(buf)).last]
    rb = StreamletRebuild(1, 0, 1, 2, 8 * KiB)
    for buf in held + [r for r in rewritten if r is not last[0]]:   # one rewrite lacks its end
        rb.add(memoryview(buf), chunk.read_header(buf), True)
    got = records_of(rb.finish())
    assert [r[0] for r in got] == sorted({r[0] for r in got})
    assert {k: v for _, k, v in got} == {k: v for _, k, v in written}
    assert latest(written, c.pending.built.clean_end) != got != written   # mixed, by segment
