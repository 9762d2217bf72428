"""Damaged tiered chunks, sans-IO: a chunk of a segment file that fails its checksum is never
served; with R=2 the broker reads it back from the backup replica of its virtual segment and
serves that copy; with R=1 readers get a non-retriable corrupt_chunk naming the file, once per
fetch, instead of the damaged bytes again and again."""

from kera.codec import chunk
from kera.broker import tier_files

from tests.unit.test_tier import broker, desc, make, run_jobs

KiB = 1024


def fetch(b, low=0, offsets=None):
    results, frames = b.reads.fetch([[1, 0, {"low": low, "offsets": offsets or {}}, 1 << 20]])
    return results[0], frames


def tiered_segment(b):
    groups = b.streams[1].streamlets[0].groups
    return next(s for g in groups for s in g.segments if s.tier is not None)


def damage(root, seg, index=0):
    """Flip one body byte of chunk `index` in the segment's file on disk."""
    path = tier_files.seg_path(root, seg.tier.key)
    data = bytearray(path.read_bytes())
    data[seg.positions[index] + chunk.HEADER_SIZE + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def fill(b, tmp_path, n=30, replicated=None):
    for seq in range(n):
        b.produce(seq, [make(seq)], 0.0)
        for w in b.sync(0.0):
            if replicated is not None:
                replicated.setdefault((w.fields["vlog"], w.fields["vseg"]), bytearray()).extend(
                    b"".join(bytes(f) for f in w.frames))
            b.write_done(w, {"length": w.end_bytes}, None, 0.0)
        run_jobs(b, tmp_path)


def test_r1_damaged_chunk_is_reported_not_served(tmp_path):
    b = broker(tmp_path, 16 * KiB)
    fill(b, tmp_path)
    seg = tiered_segment(b)
    damage(tmp_path, seg)
    for _ in range(3):                          # every fetch: the same clear error, no bytes
        (err, n, _), frames = fetch(b, low=seg.group.id)
        assert n == 0 and not frames
        code, message, retriable = err
        assert code == "corrupt_chunk" and not retriable
        assert str(tier_files.seg_path(tmp_path, seg.tier.key)) in message
    assert b.stats()["tier_corrupt_chunks"] == 1
    assert b.repairs.take_requests() == []


def test_r2_damaged_chunk_is_read_back_from_the_replica(tmp_path):
    b = broker(tmp_path, 16 * KiB, desc(R=2))
    b.placement.set_backups([{"id": 1, "address": "127.0.0.1:9", "node": "x", "alive": True}], 0.0)
    replicated: dict = {}
    fill(b, tmp_path, replicated=replicated)
    seg = tiered_segment(b)
    original = bytes(seg.view(0))
    b.tier.maps.clear()
    seg.mv = seg.buf = None                     # unmapped: the next read maps and verifies
    damage(tmp_path, seg)
    (err, n, _), _ = fetch(b, low=seg.group.id)
    assert err[0] == "not_ready" and err[2] is True          # retriable while it is repaired
    [req] = b.repairs.take_requests()
    assert req.address == "127.0.0.1:9" and req.fields["max_bytes"] == len(original)
    # The backup answers with the replica's bytes at that offset.
    replica = replicated[(req.fields["vlog"], req.fields["vseg"])]
    at = req.fields["offset"]
    piece = bytes(replica[at:at + len(original)])
    assert piece == original
    b.repairs.done(req, {"end": at + len(piece), "length": len(replica), "closed": False},
                       [piece], None)
    (err, n, _), frames = fetch(b, low=seg.group.id)
    assert err is None and bytes(next(chunk.frame_chunks(frames[0]))) == original
    assert b.stats()["tier_chunks_repaired"] == 1


def test_r2_repair_that_no_replica_can_give_ends_in_corrupt_chunk(tmp_path):
    b = broker(tmp_path, 16 * KiB, desc(R=2))
    b.placement.set_backups([{"id": 1, "address": "127.0.0.1:9", "node": "x", "alive": True}], 0.0)
    fill(b, tmp_path)
    seg = tiered_segment(b)
    b.tier.maps.clear()
    seg.mv = seg.buf = None
    damage(tmp_path, seg)
    fetch(b, low=seg.group.id)
    [req] = b.repairs.take_requests()
    from kera.errors import CorruptChunk
    b.repairs.done(req, None, None, CorruptChunk("the copy on disk is damaged"))
    (err, n, _), _ = fetch(b, low=seg.group.id)
    assert err[0] == "corrupt_chunk" and err[2] is False
