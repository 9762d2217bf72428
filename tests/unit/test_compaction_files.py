"""Compaction of an R=1 stream on a broker with a data dir (docs/COMPACTION.md): its segments
are their files (written before each ack, settled out of memory once sealed), so a pass reads
them through maps and each rewrite replaces its file crash-safely (kera.broker.tier_files:
`.cleaned`, then the `.swap` record as the commit, then the rename over `.seg` and the new
`.meta`). A restart from the directory after a crash at each point of that sequence serves
each segment wholly as it was or wholly rewritten, with the same record numbers, and leaves no
temporary file; a failed write abandons the pass and removes what it wrote."""

import os
from pathlib import Path

import pytest

from kera.broker import compactor, tier_files
from kera.broker.tier_files import CleanJob, SwapJob
from kera.codec import chunk
from kera.consumer.cursor import FetchCursor

from tests.unit.test_consumer_gaps import drain, fetch_all
from tests.unit.test_r1_live import produce_live, restarted
from tests.unit.test_tier import KiB, broker, desc as tier_desc

KEYS = 30
CHUNKS = 60
MEMORY_LIMIT = 1024 * KiB    # nothing is tiered for memory: R=1 segments settle on their own
LEFTOVERS = (".cleaned", ".swap", ".tmp")


def desc():
    return {**tier_desc(G=2, seg=4 * KiB), "cleanup_policy": "compact",
            "min_cleanable_dirty_ratio": 0.01}


def produce(b, root):
    """CHUNKS chunks of 6 updates of KEYS keys, each written to its file before its ack; the
    sealed segments settle (leave memory for their files). Returns (number, key, value)s."""
    written, n = [], 0
    for seq in range(CHUNKS):
        keys = [b"k%02d" % ((seq * 6 + i) % KEYS) for i in range(6)]
        values = [b"%s=%d" % (k, seq) + b"." * 80 for k in keys]
        if seq == CHUNKS - 1:
            values[0] = None    # a tombstone
        produce_live(b, root, seq, [chunk.encode(1, seq, 1, 0, values, keys=keys)])
        written += [(n + i, keys[i], values[i]) for i in range(6)]
        n += 6
    run_tier(b, root)
    return written


def run_tier(b, root, upto=None):
    """Run the tier's jobs as its thread would, in order; stop before the first job for which
    `upto(job)` is true (a kill -9 there) and return it, or None once none is left."""
    while True:
        jobs = b.tier.take_jobs(0.0)
        if not jobs:
            return None
        for job in jobs:
            if upto is not None and upto(job):
                return job
            try:
                tier_files.run(Path(root), job)
                error = None
            except OSError as err:
                error = err
            b.tier.job_done(job, error, 0.0)


def rows(b):
    return [(r.number, r.key, r.value) for r in drain(fetch_all(b, FetchCursor(0, earliest=True)))]


def latest(written, below):
    last = {}
    for r in written:
        if r[0] < below:
            last[r[1]] = r
    return sorted(last.values()) + [r for r in written if r[0] >= below]


def settled_segments(b):
    return [s for g in b.streams[1].streamlets[0].groups for s in g.segments if s.tier]


def leftovers(root):
    return sorted(p.name for p in (Path(root) / "segments").rglob("*") if p.name.endswith(LEFTOVERS))


def start_pass(b, root):
    """A pass over the settled segments, built here (not on a thread) and handed back: its
    rewrites' CleanJobs are queued on the tier."""
    assert settled_segments(b), "the setup's sealed segments are read from their files"
    c = compactor.Compactor(b)
    job = c.next_pass(10_000)
    assert job is not None and job.on_file and not job.replicated
    built = compactor.run_pass(job)
    assert built.rewrites, "the setup's updates make rewrites"
    c.built(built, None)
    return c, built


def test_a_pass_replaces_the_files_and_releases_the_old_segments(tmp_path):
    b = broker(tmp_path, MEMORY_LIMIT, desc())
    written = produce(b, tmp_path)
    assert rows(b) == written
    c, built = start_pass(b, tmp_path)
    assert rows(b) == written and c.pending is not None    # not swapped before the commit
    run_tier(b, tmp_path)
    assert c.pending is None and c.passes == 1
    want = latest(written, built.clean_end)
    assert rows(b) == want and len(want) < len(written)
    for w in built.rewrites:
        assert w.old.released                             # memory and maps of the old go
        assert w.new.tier is not None and w.new.memory is None   # settled: read from its file
        assert w.new not in b.tier.resident and w.new not in b.tier.swapping
    assert leftovers(tmp_path) == []
    for w in built.rewrites:   # each file replaced: committed by its `.meta`, its log gone
        assert tier_files.meta_path(tmp_path, compactor_key(w)).exists()
        assert not tier_files.live_path(tmp_path, compactor_key(w)).exists()
    b2 = restarted(tmp_path, [desc()])
    assert rows(b2) == want                               # the numbers and gaps are kept
    c2 = compactor.Compactor(b2)      # the restart sealed the open group: it compacts too
    c2.built(compactor.run_pass(c2.next_pass(20_000)), None)
    run_tier(b2, tmp_path)
    assert c2.passes == 1 and c2.clean_ends[(1, 0)] == written[-1][0] + 1
    again = latest(written, c2.clean_ends[(1, 0)])
    assert rows(b2) == again and len(again) == KEYS
    assert rows(restarted(tmp_path, [desc()])) == again


def commit_unseen(b, root):
    """The CleanJobs run, but their outcome never reaches the compactor (a kill -9 first)."""
    b.tier.on_rewrite = lambda job, error: None
    assert run_tier(b, root) is None


def _committed(job):
    return isinstance(job, SwapJob)


def _cut_commit(root, built):
    """A kill -9 between the `.cleaned` fdatasync and the `.swap` rename: the record exists only
    as its temporary file."""
    for w in built.rewrites:
        swap = tier_files.swap_path(Path(root), compactor_key(w))
        os.replace(swap, swap.with_name(swap.name + ".tmp"))


def compactor_key(w):
    g = w.group
    return g.stream_id, g.streamlet, g.id, w.new.number


def _renamed_only(root, built):
    """The first step of finish_swap done, for every rewrite."""
    for w in built.rewrites:
        key = compactor_key(w)
        os.replace(tier_files.cleaned_path(Path(root), key), tier_files.seg_path(Path(root), key))


def _meta_written(root, built):
    """finish_swap's first two steps done: the rename, and the `.swap` record as `.meta`."""
    _renamed_only(root, built)
    for w in built.rewrites:
        key = compactor_key(w)
        record = tier_files.swap_path(Path(root), key).read_bytes()
        tier_files.write_atomic(tier_files.meta_path(Path(root), key), record)


# (where the kill lands, what the restart serves)
POINTS = {
    "before the rewrite is written": ("clean", None, "original"),
    "after .cleaned, before .swap": ("swap", _cut_commit, "original"),
    "after the commit, before the memory swap": ("swap", None, "compacted"),
    "after the memory swap, before the rename": ("swapjob", None, "compacted"),
    "after the rename, before the .meta": ("swapjob", _renamed_only, "compacted"),
    "after the .meta, before .live and .swap go": ("swapjob", _meta_written, "compacted"),
    "after the swap": ("end", None, "compacted"),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_kill_at_each_point_of_the_swap_serves_old_or_new_whole(tmp_path, point):
    stop, damage, serves = POINTS[point]
    b = broker(tmp_path, MEMORY_LIMIT, desc())
    written = produce(b, tmp_path)
    c, built = start_pass(b, tmp_path)
    want = {"original": written, "compacted": latest(written, built.clean_end)}[serves]
    if stop == "clean":
        assert isinstance(run_tier(b, tmp_path, lambda j: isinstance(j, CleanJob)), CleanJob)
    elif stop == "swap":
        commit_unseen(b, tmp_path)
        assert rows(b) == written
    elif stop == "swapjob":
        assert isinstance(run_tier(b, tmp_path, _committed), SwapJob)
        assert rows(b) == latest(written, built.clean_end)   # swapped in memory
    else:
        assert run_tier(b, tmp_path) is None
    if damage is not None:
        damage(tmp_path, built)
    b2 = restarted(tmp_path, [desc()])                      # as after kill -9: no shutdown
    assert rows(b2) == want
    assert leftovers(tmp_path) == []
    assert b2.stats().get("reload_corrupt_segments", 0) == 0


def test_a_failed_write_abandons_the_pass_and_removes_its_files(tmp_path, monkeypatch):
    b = broker(tmp_path, MEMORY_LIMIT, desc())
    written = produce(b, tmp_path)
    c, built = start_pass(b, tmp_path)
    real = tier_files.write_cleaned

    def full_disk(root, record, data):
        real(root, record, data)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tier_files, "write_cleaned", full_disk)
    run_tier(b, tmp_path)
    assert c.pending is None and c.passes == 0
    assert all(w.new.released and not w.old.released for w in built.rewrites)
    assert rows(b) == written and leftovers(tmp_path) == []
    monkeypatch.setattr(tier_files, "write_cleaned", real)
    job = c.next_pass(10_000)                               # a later pass does it
    c.built(compactor.run_pass(job), None)
    run_tier(b, tmp_path)
    assert c.passes == 1 and rows(b) == latest(written, c.clean_ends[(1, 0)])


def test_a_rewrite_of_a_deleted_segment_is_not_finished_at_restart(tmp_path):
    """Its segment's files went (retention, the stream deleted) after the commit: the `.swap`
    must not bring the segment back."""
    b = broker(tmp_path, MEMORY_LIMIT, desc())
    produce(b, tmp_path)
    c, built = start_pass(b, tmp_path)
    commit_unseen(b, tmp_path)
    key = compactor_key(built.rewrites[0])
    root = Path(tmp_path)
    for path in (tier_files.meta_path(root, key), tier_files.live_path(root, key),
                 tier_files.seg_path(root, key)):
        path.unlink(missing_ok=True)
    assert tier_files.swap_path(root, key).exists()
    found = tier_files.scan(root)
    assert key not in [r.key for r in found]
    assert not tier_files.swap_path(root, key).exists()
    assert not tier_files.cleaned_path(root, key).exists()


def test_deleting_a_segment_removes_its_committed_rewrite_first(tmp_path):
    b = broker(tmp_path, MEMORY_LIMIT, desc())
    produce(b, tmp_path)
    c, built = start_pass(b, tmp_path)
    commit_unseen(b, tmp_path)
    key = compactor_key(built.rewrites[0])
    tier_files.delete_segment(Path(tmp_path), key)
    assert not any(p.name.startswith(tier_files.segment_base(key[2], key[3]))
                   for p in tier_files.streamlet_dir(Path(tmp_path), 1, 0).iterdir())


def test_a_damaged_commit_record_keeps_the_segment_as_it_was(tmp_path):
    b = broker(tmp_path, MEMORY_LIMIT, desc())
    written = produce(b, tmp_path)
    c, built = start_pass(b, tmp_path)
    commit_unseen(b, tmp_path)
    for w in built.rewrites:
        swap = tier_files.swap_path(Path(tmp_path), compactor_key(w))
        data = bytearray(swap.read_bytes())
        data[10] ^= 0xFF                                    # its checksum no longer holds
        swap.write_bytes(bytes(data))
    b2 = restarted(tmp_path, [desc()])
    assert rows(b2) == written and leftovers(tmp_path) == []
