"""Tiering without sockets: a broker core with a small memory budget writes sealed durable
segments to its data dir, drops them from memory, and serves them back from disk; producers are
throttled when nothing can go; a restart reloads the files, verified."""

from pathlib import Path

import pytest

from kera.codec import chunk
from kera.broker import reload, tier_files
from kera.broker.core import Broker, BrokerConfig
from kera.broker.memory import parse_size
from kera.broker.tier import TierConfig
from kera.errors import Throttled

ME = 3
KiB = 1024


def desc(sid=1, *, R=1, streamlets=1, Q=1, G=4, seg=8 * KiB, retention_ms=0, retention_bytes=0):
    return {"name": f"s{sid}", "id": sid, "streamlets": streamlets, "active_groups": Q,
            "replication": R, "group_segments": G, "segment_size_bytes": seg,
            "durability": "memory", "placement": [ME] * streamlets, "brokers": {},
            "version": 1, "ready": True, "retention_ms": retention_ms,
            "retention_bytes": retention_bytes}


def broker(root, limit=64 * KiB, *streams, **tier):
    cfg = BrokerConfig(tier=TierConfig(root=root, memory_limit_bytes=limit, **tier))
    b = Broker("n", cfg, broker_id=ME)
    b.apply_metadata(list(streams) or [desc()], 1)
    return b


def make(seq, producer=1, sid=1, sl=0, n=8, size=100):
    return chunk.encode(producer, seq, sid, sl, [bytes([seq % 251]) * size] * n)


def run_jobs(b, root, now=0.0):
    """Run the tier jobs the core hands out, as the tier thread would; returns how many."""
    done = 0
    while True:
        jobs = b.tier.take_jobs(now)
        if not jobs:
            return done
        for job in jobs:
            tier_files.run(Path(root), job)
            b.tier.job_done(job, None, now)
            done += 1


def read_all(b, sid=1, sl=0, low=0, **cursor):
    """Every chunk the broker serves, following its group table."""
    out, offsets = [], {}
    for _ in range(10_000):
        results, frames = b.reads.fetch([[sid, sl, {"low": low, "offsets": dict(offsets), **cursor}, 1 << 20]])
        err, n, groups = results[0]
        assert err is None, err
        for f in (c for fr in frames for c in chunk.frame_chunks(fr)):
            h = chunk.read_header(f)
            chunk.verify(f)
            out.append(bytes(f))
            offsets[h.group] = h.base_offset + h.record_count
        moved = False
        for g, _slot, _start, end, closed in groups:
            if g == low and closed and offsets.get(g, 0) >= end:
                low += 1
                moved = True
        cursor.pop("earliest", None)
        if not frames and not moved:
            return out
    raise AssertionError("read did not finish")


def test_parse_size():
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("64mb") == 64_000_000 and parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")


def test_memory_stays_under_the_limit_and_everything_reads_back(tmp_path):
    b = broker(tmp_path, 64 * KiB)
    sent = []
    for seq in range(200):           # ~170 KiB of chunks, several times the budget
        c = make(seq)
        sent.append(c)
        [stored] = b.produce(seq, [c], 0.0)
        last = b.producers.get((1, 1, 0))
        assert stored == [last.group, last.segment, last.base_offset, 8 * seq]   # 8 records each
        run_jobs(b, tmp_path)
        assert b.tier.memory_bytes <= 64 * KiB
    stats = b.stats()
    assert stats["tiered_bytes"] > 100 * KiB and stats["tier_writes"] > 10
    files = sorted(p.name for p in (tmp_path / "segments").rglob("*.seg"))
    assert files and files == sorted(files)   # zero-padded: ls order is log order
    got = read_all(b)
    # Stamped in place, so compare everything but the stamps (header bytes 48..72 and the CRC).
    assert len(got) == len(sent)
    assert all(g[chunk.HEADER_SIZE:] == s[chunk.HEADER_SIZE:] and g[16:48] == s[16:48] for g, s in zip(got, sent))
    assert b.tier.maps and len(b.tier.maps) <= b.tier.cfg.maps_max


def test_maps_are_bounded(tmp_path):
    b = broker(tmp_path, 32 * KiB, maps_max=2)
    for seq in range(120):
        b.produce(seq, [make(seq)], 0.0)
        run_jobs(b, tmp_path)
    assert len(read_all(b)) == 120
    assert len(b.tier.maps) == 2
    tiered = [s for g in b.streams[1].streamlets[0].groups for s in g.segments if s.tier]
    assert sum(1 for s in tiered if s.mv is not None) == 2


def test_only_durable_segments_are_tiered(tmp_path):
    b = broker(tmp_path, 16 * KiB, desc(R=2))
    b.placement.set_backups([{"id": 1, "address": "127.0.0.1:9", "node": "x", "alive": True}], 0.0)
    for seq in range(15):
        b.produce(seq, [make(seq)], 0.0)
    assert b.tier.take_jobs(0.0) == []          # nothing acknowledged by the backup yet

    for w in b.sync(0.0):
        b.write_done(w, {"length": w.end_bytes}, None, 0.0)
    assert b.tier.take_jobs(1.0)                # now durable: sealed segments go



def test_throttled_when_memory_is_full_and_nothing_can_go(tmp_path):
    b = broker(None, 16 * KiB)                  # no data dir: nothing is tiered
    with pytest.raises(Throttled):
        for seq in range(100):
            b.produce(seq, [make(seq)], 0.0)
    assert b.tier.memory_bytes <= 16 * KiB
    assert b.stats()["produce_throttled_memory"] == 1


def test_a_disk_limit_stops_tiering(tmp_path):
    b = broker(tmp_path, 16 * KiB, disk_limit_bytes=16 * KiB)
    with pytest.raises(Throttled):
        for seq in range(200):
            b.produce(seq, [make(seq)], 0.0)
            run_jobs(b, tmp_path)
    assert b.tier.disk_bytes <= 16 * KiB and b.stats()["tier_disk_full"] >= 1


def test_memory_full_of_open_groups_closes_one(tmp_path):
    # Four slots, each with an open segment: nothing is sealed, yet memory must go somewhere.
    # (Memory counts each segment's mapped capacity: four 16 KiB segments fill 64 KiB.)
    b = broker(tmp_path, 64 * KiB, desc(Q=4, seg=16 * KiB), tier_at_fraction=0.5)
    seq = [0] * 4
    for i in range(24):
        p = i % 4
        b.produce(i, [make(seq[p], producer=p)], 0.0)
        seq[p] += 1
    run_jobs(b, tmp_path)
    assert b.stats()["groups_closed_for_memory"] >= 1
    assert b.stats()["tier_writes"] >= 1


def test_failed_write_is_retried_later(tmp_path):
    b = broker(tmp_path, 16 * KiB)
    for seq in range(15):
        b.produce(seq, [make(seq)], 0.0)
    jobs = b.tier.take_jobs(0.0)

    assert jobs
    for job in jobs:
        b.tier.job_done(job, OSError(28, "No space left on device"), 0.0)
    assert b.tier.take_jobs(0.5) == []          # backing off
    assert b.tier.take_jobs(2.0)                # and trying again
    assert b.stats()["tier_write_errors"] == len(jobs)


def test_restart_reloads_every_durable_chunk(tmp_path):
    b = broker(tmp_path, 32 * KiB, desc(Q=2))
    for seq in range(60):
        b.produce(seq, [make(seq // 2, producer=seq % 2)], 0.0)
        run_jobs(b, tmp_path)
    before = read_all(b)
    for job in b.tier.shutdown_jobs():           # an orderly stop writes the rest
        tier_files.run(tmp_path, job)
    groups_before = b.reads.offsets(1, 0)

    b2 = Broker("n", BrokerConfig(tier=TierConfig(root=tmp_path, memory_limit_bytes=32 * KiB)),
                broker_id=ME)
    b2.reloaded = reload.load_dir(tmp_path)
    b2.apply_metadata([desc(Q=2)], 2)
    assert b2.reloaded is None
    assert read_all(b2) == before
    assert [g[:4] for g in b2.reads.offsets(1, 0)] == [g[:4] for g in groups_before]
    assert all(g[4] for g in b2.reads.offsets(1, 0))   # every reloaded group is sealed
    # Producers are remembered: a retry of the last chunk is a duplicate, the next is appended
    # to a new group.
    last = b2.producers.get((1, 1, 0))
    assert last.sequence == 29
    assert b2.produce("dup", [make(29, producer=1)], 0.0)[0][:3] == [last.group, last.segment, last.base_offset]
    [[g, _, base, _]] = b2.produce("new", [make(30, producer=1)], 0.0)
    assert g == len(groups_before) and base == 0
    # Its records are numbered on from the reloaded ones of its slot (producer 1: slot 1).
    slot1 = [chunk.read_header(c) for c in before if chunk.read_header(c).producer_id == 1]
    new = chunk.read_header(b2.streams[1].streamlets[0].groups[-1].segments[0].view(0))
    assert new.number == sum(h.record_count for h in slot1) == slot1[-1].number + 8


def test_reload_skips_a_damaged_file(tmp_path):
    b = broker(tmp_path, 16 * KiB)
    for seq in range(40):
        b.produce(seq, [make(seq)], 0.0)
        run_jobs(b, tmp_path)
    seg = sorted((tmp_path / "segments").rglob("*.seg"))[-1]
    raw = bytearray(seg.read_bytes())
    raw[200] ^= 0xFF
    seg.write_bytes(bytes(raw))
    loaded = reload.load_dir(tmp_path)
    assert loaded.corrupt == 1
    assert sum(map(len, loaded.segments.values())) == len(list((tmp_path / "segments").rglob("*.seg"))) - 1


def test_orphan_segment_files_are_removed(tmp_path):
    d = tier_files.streamlet_dir(tmp_path, 1, 0)
    d.mkdir(parents=True)
    (d / "0000000000-000000.seg").write_bytes(b"x" * 100)    # a write cut before its record
    (d / "0000000000-000001.meta.tmp").write_bytes(b"y")
    assert tier_files.scan(tmp_path) == []
    assert list(d.iterdir()) == []


def test_record_round_trip_and_corruption():
    r = tier_files.SegmentRecord(1, 2, 3, 4, 0, 100, 2, 10, 30, 5, 6, 1024, 77, True)
    raw = tier_files.encode_record(r)
    assert tier_files.decode_record(raw) == r
    bad = bytearray(raw)
    bad[9] ^= 1
    with pytest.raises(tier_files.CorruptSegment):
        tier_files.decode_record(bytes(bad))


def test_stream_deletion_frees_memory_and_files(tmp_path):
    b = broker(tmp_path, 16 * KiB)
    for seq in range(40):
        b.produce(seq, [make(seq)], 0.0)
        run_jobs(b, tmp_path)
    assert b.tier.disk_bytes > 0
    b.apply_metadata([], 2)              # missing, not deleted: nothing goes
    run_jobs(b, tmp_path)
    assert b.tier.disk_bytes > 0 and list((tmp_path / "segments").rglob("*.seg"))
    b.apply_metadata([], 3, [[1, 3]])   # stream 1 deleted at version 3
    run_jobs(b, tmp_path)
    assert b.tier.memory_bytes == 0 and b.tier.disk_bytes == 0
    assert not list((tmp_path / "segments").rglob("*.seg"))
