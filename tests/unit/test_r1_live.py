"""R=1 chunks reach their segment file before the ack (kera.broker.tier_files `.live`): the
core hands out LiveWrites, and a broker killed before tiering (no orderly stop) is reloaded
with every acknowledged chunk, its producers' sequences and its history epoch. Sealed R=1
segments whose chunks are all on file leave memory at once (settled, kera.broker.tier)."""

import os
from pathlib import Path

import pytest

from kera.broker import history_epoch, reload, tier_files
from kera.broker.core import Broker, BrokerConfig
from kera.broker.tier import TierConfig

from tests.unit.test_tier import KiB, ME, broker, desc, make, read_all, run_jobs

LIMIT = 1024 * KiB     # nothing tiers on its own


def produce_live(b, root, token, chunks):
    """What the shell does for a produce: append, record new histories, write the R=1 chunks."""
    results = b.produce(token, chunks, 0.0)
    for sid, sl, epoch in b.take_new_histories():
        history_epoch.write(root, sid, sl, epoch)
    for w in b.tier.take_live_writes():
        tier_files.write_live(Path(root), w)
        b.tier.live_written(w, None)
    return results


def restarted(root, streams):
    b2 = Broker("n", BrokerConfig(tier=TierConfig(root=root, memory_limit_bytes=LIMIT)),
                broker_id=ME)
    b2.reloaded = reload.load_dir(root)
    b2.apply_metadata(streams, 2)
    return b2


def test_kill_without_tiering_keeps_every_acknowledged_chunk(tmp_path):
    b = broker(tmp_path, LIMIT, desc(Q=2))
    b.set_epoch(7)
    for seq in range(60):
        produce_live(b, tmp_path, seq, [make(seq // 2, producer=seq % 2)])
    assert not list((tmp_path / "segments").rglob("*.meta"))     # nothing was tiered
    before, groups_before = read_all(b), b.reads.offsets(1, 0)

    b2 = restarted(tmp_path, [desc(Q=2)])     # no shutdown jobs: as after kill -9
    assert read_all(b2) == before
    assert [g[:4] for g in b2.reads.offsets(1, 0)] == [g[:4] for g in groups_before]
    assert b2.reads.history_epoch(1, 0) == b.reads.history_epoch(1, 0)    # saved positions stay valid
    last = b2.producers.get((1, 1, 0))
    assert last.sequence == 29
    dup = b2.produce("dup", [make(29, producer=1)], 0.0)
    assert dup[0][:3] == [last.group, last.segment, last.base_offset]


def test_tiered_segments_and_live_ones_reload_together(tmp_path):
    b = broker(tmp_path, 32 * KiB, desc())
    for seq in range(80):
        produce_live(b, tmp_path, seq, [make(seq)])
        run_jobs(b, tmp_path)
    for job in b.tier.shutdown_jobs():       # an orderly stop commits the open segment
        tier_files.run(Path(tmp_path), job)
    segs = tmp_path / "segments"
    assert len(list(segs.rglob("*.meta"))) == 1 and len(list(segs.rglob("*.live"))) > 1
    before = read_all(b)
    b2 = restarted(tmp_path, [desc()])
    assert read_all(b2) == before
    assert not any(p.with_suffix(".meta").exists() for p in segs.rglob("*.live"))


def test_a_torn_tail_keeps_the_last_whole_record(tmp_path):
    b = broker(tmp_path, LIMIT, desc())
    for seq in range(5):
        produce_live(b, tmp_path, seq, [make(seq)])
    before = read_all(b)
    [live] = (tmp_path / "segments").rglob("*.live")
    with open(live, "ab") as f:          # a record cut short by the kill
        f.write(b"\x01" * (tier_files.RECORD_SIZE // 2))
    with open(live.with_suffix(".seg"), "ab") as f:   # bytes of an unacknowledged chunk
        f.write(b"\x02" * 300)
    assert read_all(restarted(tmp_path, [desc()])) == before


def test_a_failed_write_is_written_again_before_the_next_ack(tmp_path):
    b = broker(tmp_path, LIMIT, desc())
    b.produce(0, [make(0)], 0.0)
    [w] = b.tier.take_live_writes()
    b.tier.live_written(w, OSError(28, "No space left on device"))
    produce_live(b, tmp_path, 1, [make(1)])      # writes chunk 0 and chunk 1
    assert read_all(restarted(tmp_path, [desc()])) == read_all(b)


def test_replicated_streams_write_nothing_before_the_ack(tmp_path):
    b = broker(tmp_path, LIMIT, desc(R=2))
    b.produce(0, [make(0)], 0.0)
    assert b.tier.take_live_writes() == []


def test_retention_deletes_the_live_files_of_the_groups_it_drops(tmp_path):
    b = broker(tmp_path, LIMIT, desc(G=1, retention_bytes=4 * KiB))
    for seq in range(60):
        produce_live(b, tmp_path, seq, [make(seq)])
    assert b.enforce_retention(10**12, 10**12) > 0
    run_jobs(b, tmp_path)
    live_groups = {int(p.name[:10]) for p in (tmp_path / "segments").rglob("*.live")}
    assert live_groups and min(live_groups) >= b.reads.first_group(1, 0)
    assert {int(p.name[:10]) for p in (tmp_path / "segments").rglob("*.seg")} == live_groups


# ---------------------------------------------------------------------- LiveFiles' open files

def live_write(stream_id: int, at: int, data: bytes) -> tier_files.LiveWrite:
    """A LiveWrite of `data` at byte `at` of segment 0 of group 0 of `stream_id`."""
    record = tier_files.SegmentRecord(stream_id, 0, 0, 0, 0, at + len(data), 1, 0, 1, 0, 0,
                                      64 * KiB, 0, False)
    return tier_files.LiveWrite(None, record, at, memoryview(data))


def seg_bytes(root: Path, stream_id: int) -> bytes:
    return tier_files.seg_path(root, (stream_id, 0, 0, 0)).read_bytes()


def test_live_files_keep_every_busy_segment_open_up_to_their_bound(tmp_path):
    files = tier_files.LiveFiles(tmp_path, open_max=300)
    try:
        for sid in range(1, 257):             # 256 busy R=1 streams, more than the old 64
            files.write(live_write(sid, 0, b"a" * 10), 0.0)
        fds = {key: entry[0] for key, entry in files.open.items()}
        for sid in range(1, 257):
            files.write(live_write(sid, 10, b"b" * 5), 1.0)
        assert {key: entry[0] for key, entry in files.open.items()} == fds   # none reopened
    finally:
        files.close()
    assert all(seg_bytes(tmp_path, sid) == b"a" * 10 + b"b" * 5 for sid in range(1, 257))
    assert tier_files.read_live(tier_files.live_path(tmp_path, (7, 0, 0, 0))).length == 15


def test_live_files_past_their_bound_close_the_oldest_and_reopen_it_when_written(tmp_path):
    files = tier_files.LiveFiles(tmp_path, open_max=4)
    try:
        for sid in range(1, 7):
            files.write(live_write(sid, 0, b"x" * 8), 0.0)
        assert sorted(key[0] for key in files.open) == [3, 4, 5, 6]
        files.write(live_write(1, 8, b"y" * 8), 0.0)   # closed above: reopened, appended after
        assert [key[0] for key in files.open] == [4, 5, 6, 1]
    finally:
        files.close()
    assert files.open == {}
    assert seg_bytes(tmp_path, 1) == b"x" * 8 + b"y" * 8


def test_live_files_bound_follows_the_open_file_limit(monkeypatch):
    def limit(soft):
        monkeypatch.setattr(tier_files.resource, "getrlimit", lambda _: (soft, soft))
        return tier_files.live_files_open_max()

    assert limit(1024) == 128                 # a quarter of the descriptors, two a pair
    assert limit(20_000) == 2_500
    assert limit(10 ** 7) == tier_files.LIVE_FILES_OPEN_MAX
    assert limit(tier_files.resource.RLIM_INFINITY) == tier_files.LIVE_FILES_OPEN_MAX
    assert limit(40) == tier_files.LIVE_FILES_OPEN_MIN
    with pytest.raises(ValueError, match="open_max"):
        tier_files.LiveFiles(Path("."), open_max=0)


def test_live_files_close_the_files_of_segments_no_longer_written(tmp_path):
    """A sealed, tiered or deleted segment is written no more: its descriptors go, so a
    deleted file's disk space is not held."""
    idle_s = tier_files.LIVE_FILES_IDLE_S
    files = tier_files.LiveFiles(tmp_path, open_max=100)
    try:
        files.write(live_write(1, 0, b"a" * 8), 0.0)
        files.write(live_write(2, 0, b"b" * 8), 1.0)
        files.write(live_write(1, 8, b"c" * 8), 2.0)    # stream 1 written last
        files.close_idle(1.0 + idle_s - 0.1)
        assert sorted(key[0] for key in files.open) == [1, 2]
        tier_files.seg_path(tmp_path, (2, 0, 0, 0)).unlink()   # deleted (retention) meanwhile
        files.close_idle(1.0 + idle_s)
        assert [key[0] for key in files.open] == [1]
        files.close_idle(2.0 + idle_s)
        assert files.open == {}
        files.write(live_write(1, 16, b"d" * 8), 3.0)   # written again: reopened
    finally:
        files.close()
    assert seg_bytes(tmp_path, 1) == b"a" * 8 + b"c" * 8 + b"d" * 8


def test_tiering_writes_only_what_the_live_writes_did_not(tmp_path):
    b = broker(tmp_path, 32 * KiB, desc())
    b.produce(0, [make(0)], 0.0)
    [w] = b.tier.take_live_writes()
    b.tier.live_written(w, OSError(28, "No space left on device"))   # chunk 0: not on file
    for seq in range(1, 80):
        produce_live(b, tmp_path, seq, [make(seq)])
        run_jobs(b, tmp_path)
    # Every acknowledged byte was on file: the first segment wrote its live bytes from chunk
    # 0 on, with chunk 1's produce, and settled like the others; the open one at the stop
    # is not written again.
    assert b.tier.counters.get("tier_r1_settled") >= 2
    [job] = b.tier.shutdown_jobs()
    assert job.on_file_bytes == job.record.length
    tier_files.run(Path(tmp_path), job)
    assert read_all(restarted(tmp_path, [desc()])) == read_all(b)


def test_a_segment_tiered_after_a_failed_live_write_writes_the_rest(tmp_path):
    b = broker(tmp_path, LIMIT, desc())
    produce_live(b, tmp_path, 0, [make(0)])
    b.produce(1, [make(1)], 0.0)
    [w] = b.tier.take_live_writes()
    b.tier.live_written(w, OSError(28, "No space left on device"))   # chunk 1: memory only
    [seg] = [s for s in b.tier.resident if len(s)]
    job = b.tier._write_job(seg, len(seg))
    assert 0 < job.on_file_bytes < job.record.length
    tier_files.run(Path(tmp_path), job)
    assert tier_files.seg_path(tmp_path, job.record.key).read_bytes() == bytes(job.data)


# ---------------------------------------------------------------------- settled R=1 segments

def produce_with_jobs(b, root, requests):
    """One-chunk requests (about 1 KiB each into 8 KiB segments), far below the memory limit,
    with the tier jobs run after each as the shell does."""
    for seq in range(requests):
        produce_live(b, root, seq, [make(seq)])
        run_jobs(b, root)


def test_sealed_r1_segments_leave_memory_below_its_limit(tmp_path):
    b = broker(tmp_path, LIMIT, desc(G=64))
    produce_with_jobs(b, tmp_path, 8 * 8)
    [open_segment] = [s for s in b.tier.resident if len(s)]          # only the open one stays
    assert open_segment is b.streams.get(1).streamlets[0].groups[-1].segments[-1]
    settled = b.tier.counters.get("tier_r1_settled")
    assert settled >= 5 and b.tier.memory_bytes < 2 * 8 * KiB
    segs = tmp_path / "segments"
    assert not list(segs.rglob("*.meta"))     # nothing written or synced: the live files stay
    assert len(list(segs.rglob("*.live"))) == settled + 1
    before = read_all(b)                       # the settled ones read through their files
    assert before and b.tier.counters.get("tier_maps") >= settled
    assert read_all(restarted(tmp_path, [desc(G=64)])) == before


def test_settled_segments_give_their_memory_to_the_next_ones(tmp_path):
    b = broker(tmp_path, LIMIT, desc(G=64))
    produce_with_jobs(b, tmp_path, 8 * 8)
    assert b.segment_pool.reused >= 3       # new segments took an earlier one's buffer


def test_retention_deletes_the_files_of_settled_segments(tmp_path):
    b = broker(tmp_path, LIMIT, desc(G=1, retention_bytes=4 * KiB))
    produce_with_jobs(b, tmp_path, 60)
    assert b.tier.counters.get("tier_r1_settled") > 0
    assert b.enforce_retention(10**12, 10**12) > 0
    run_jobs(b, tmp_path)
    left = {int(p.name[:10]) for p in (tmp_path / "segments").rglob("*.seg")}
    assert left and min(left) >= b.reads.first_group(1, 0)


def test_a_sealed_r1_segment_waits_for_its_chunks_to_reach_its_file(tmp_path):
    b = broker(tmp_path, LIMIT, desc(G=64))
    seq = 0
    while not b.tier.settling:     # every live write fails until the first segment is sealed
        assert b.produce(seq, [make(seq)], 0.0) is not None
        for w in b.tier.take_live_writes():
            b.tier.live_written(w, OSError(28, "No space left on device"))
        seq += 1
    [sealed] = b.tier.settling
    run_jobs(b, tmp_path)
    assert sealed in b.tier.resident and sealed.memory is not None
    produce_live(b, tmp_path, seq, [make(seq)])   # the next produce writes it first
    run_jobs(b, tmp_path)
    assert sealed not in b.tier.resident and sealed.tier is not None
    assert read_all(restarted(tmp_path, [desc(G=64)])) == read_all(b)


def test_replicated_segments_keep_their_memory_below_the_limit(tmp_path):
    b = broker(tmp_path, LIMIT, desc(R=2, G=64))
    for seq in range(40):
        b.produce(seq, [make(seq)], 0.0)
    assert not b.tier.settling and b.tier.take_jobs(0.0) == []
    assert len([s for s in b.tier.resident if len(s)]) > 1


def test_settled_segments_count_against_the_disk_limit(tmp_path):
    b = broker(tmp_path, LIMIT, desc(G=64), disk_limit_bytes=20 * KiB)
    produce_with_jobs(b, tmp_path, 8 * 8)
    settled = b.tier.counters.get("tier_r1_settled")
    assert settled == 2 and b.tier.disk_bytes <= 20 * KiB    # two 8 KiB segments fit
    assert len([s for s in b.tier.resident if len(s)]) > 1   # memory keeps the rest


def test_an_orderly_stop_syncs_the_settled_segments_files(tmp_path, monkeypatch):
    b = broker(tmp_path, LIMIT, desc(G=64))
    produce_with_jobs(b, tmp_path, 8 * 8)
    for job in b.tier.shutdown_jobs():       # the open segment: its .meta, its .live gone
        tier_files.run(Path(tmp_path), job)
    synced = []
    real = tier_files.os.fdatasync
    monkeypatch.setattr(tier_files.os, "fdatasync",
                        lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    settled = b.tier.counters.get("tier_r1_settled")
    assert tier_files.sync_live_segments(Path(tmp_path)) == settled
    lives = sorted((tmp_path / "segments").rglob("*.live"))
    assert len(lives) == settled
    assert sorted(synced) == sorted(str(p) for live in lives for p in (live, live.with_suffix(".seg")))
