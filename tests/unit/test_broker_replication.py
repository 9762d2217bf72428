"""Replication through shared virtual logs, driven without sockets: batching, durable heads,
backup failures and re-replication, and never an acknowledgement on fewer than R copies."""

import struct

import pytest

from kera.codec import chunk
from kera.codec import frame_pack
from kera.broker.core import Broker, BrokerConfig
from kera.codec.chunk import crc32c
from kera.errors import BadRequest, StorageError, Throttled
from kera.net.server import ZERO_COPY_MIN_BYTES

ME = 7
TIMEOUT = 2.0


def desc(sid=1, *, R=2, streamlets=1, Q=1, G=16, seg=1 << 20, durability="memory", capacity=0):
    return {"name": f"s{sid}", "id": sid, "streamlets": streamlets, "active_groups": Q,
            "replication": R, "group_segments": G, "segment_size_bytes": seg,
            "durability": durability, "replication_capacity": capacity,
            "placement": [ME] * streamlets, "brokers": {}, "version": 1, "ready": True}


def backup_list(*ids, node_of=lambda i: f"node{i}"):
    return [{"id": i, "address": f"127.0.0.1:{9000 + i}", "node": node_of(i), "alive": True} for i in ids]


def broker(*streams, backups=(1, 2), **cfg):
    cfg.setdefault("replication_timeout_s", TIMEOUT)
    b = Broker("node0", BrokerConfig(**cfg), broker_id=ME)
    b.apply_metadata(list(streams) or [desc()], 1)
    b.placement.set_backups(backup_list(*backups), 0.0)
    return b


def make(producer=1, seq=0, sid=1, sl=0, n=4):
    return chunk.encode(producer, seq, sid, sl, [b"r%d" % seq] * n)


def split(frame):
    """The chunks of a payload frame (whole chunks back to back)."""
    out, pos = [], 0
    while pos < len(frame):
        size = chunk.chunk_size(frame, pos)
        out.append(frame[pos:pos + size])
        pos += size
    return out


def chunks_of(w):
    return [c for f in w.frames for c in split(f)]


class FakeBackups:
    """Backups as the protocol describes them: a write appends at exactly `offset`."""

    def __init__(self):
        self.replicas: dict[tuple, bytearray] = {}
        self.closed: set = set()

    def apply(self, w):
        f = w.fields
        key = (w.backup_id, f["vlog"], f["vseg"])
        rep = self.replicas.get(key)
        if f["offset"] == 0:
            rep = self.replicas[key] = bytearray()
        elif rep is None or len(rep) != f["offset"]:
            return None, BadRequest("offset mismatch")
        for c in chunks_of(w):
            chunk.verify(c)
            rep += c
        if f["close"]:
            self.closed.add(key)
        return {"length": len(rep)}, None

    def holders(self, sid, group, base):
        """Backups holding the chunk stamped (group, base) of stream `sid`."""
        found = set()
        for (bid, _, _), rep in self.replicas.items():
            pos = 0
            while pos < len(rep):
                h = chunk.read_header(memoryview(rep)[pos:])
                if (h.stream_id, h.group, h.base_offset) == (sid, group, base):
                    found.add(bid)
                pos += h.size
        return found


def ack(b, backups, writes, now=0.0):
    for w in writes:
        header, err = backups.apply(w)
        b.write_done(w, header, err, now)


def fetched(b, sid=1, sl=0):
    results, frames = b.reads.fetch([[sid, sl, {"low": 0, "offsets": {}}, 1 << 30]])
    return [chunk.read_header(c).sequence for f in frames for c in chunk.frame_chunks(f)]


def test_reply_only_once_every_backup_has_the_chunk():
    b = broker(desc(R=3), backups=(1, 2, 3))
    fb = FakeBackups()
    assert b.produce("req", [make(seq=0)], 0.0) is None
    writes = b.sync(0.0)
    assert len(writes) == 2 and len({w.backup_id for w in writes}) == 2
    assert fetched(b) == [] and b.stats()["durable_lag_bytes"] > 0
    ack(b, fb, writes[:1])
    assert b.take_replies() == [] and fetched(b) == []
    ack(b, fb, writes[1:])
    assert b.take_replies() == [("req", [[0, 0, 0, 0]])]
    assert fetched(b) == [0]
    assert b.stats()["durable_lag_bytes"] == 0


def big(producer=1, seq=0, sid=1):
    """A chunk of at least PACK_RUN_BYTES_MAX: sent as a view of its segment."""
    records = frame_pack.PACK_RUN_BYTES_MAX // 1000 + 1
    return chunk.encode(producer, seq, sid, 0, [b"v" * 1000] * records)


def test_long_runs_are_views_of_the_segments_not_copies():
    b = broker(desc(1), desc(2))
    b.produce("a", [big(seq=0), big(seq=0, producer=2)], 0.0)
    b.produce("b", [big(sid=2)], 0.0)
    b.produce("c", [big(seq=1)], 0.0)
    [w] = b.sync(0.0)
    seg1 = b.streams[1].streamlets[0].groups[0].segments[0]
    seg2 = b.streams[2].streamlets[0].groups[0].segments[0]
    # Chunks adjacent in one physical segment share a frame; another segment starts a new one.
    assert [f.obj for f in w.frames] == [seg1.buf, seg2.buf, seg1.buf]
    assert all(isinstance(f, memoryview) for f in w.frames)
    assert [len(split(f)) for f in w.frames] == [2, 1, 1] and w.chunks == 4
    assert [chunk.read_header(c).sequence for c in chunks_of(w)] == [0, 0, 0, 1]
    assert w.fields == {"broker_id": ME, "vlog": 0, "vseg": 0, "offset": 0,
                        "durability": "memory", "close": False, "reset": True}


def test_short_runs_are_packed_in_order_into_one_frame():
    b = broker(desc(1), desc(2))
    b.produce("a", [make(seq=0), make(seq=0, producer=2)], 0.0)
    b.produce("b", [make(sid=2)], 0.0)
    b.produce("c", [big(seq=1)], 0.0)           # a long run ends the packed frame
    b.produce("d", [make(seq=1, sid=2)], 0.0)   # a lone short run: a view
    [w] = b.sync(0.0)
    assert [type(f) for f in w.frames] == [bytes, memoryview, memoryview]
    assert [len(split(f)) for f in w.frames] == [3, 1, 1] and w.chunks == 5
    assert [(chunk.read_header(c).producer_id, chunk.read_header(c).sequence)
            for c in chunks_of(w)] == [(1, 0), (2, 0), (1, 0), (1, 1), (1, 1)]


def test_level_replicas_share_one_packed_payload_and_one_behind_gets_its_own():
    b = broker(desc(1, R=3), desc(2, R=3), backups=(1, 2, 3))
    fb = FakeBackups()
    b.produce("a", [make(seq=0), make(sid=2), make(seq=1)], 0.0)   # 3 runs: packed
    w1, w2 = b.sync(0.0)
    assert w1.backup_id != w2.backup_id
    assert w1.frames is w2.frames and [type(f) for f in w1.frames] == [bytes]   # packed once
    ack(b, fb, [w1])            # the second replica's write is still in flight
    b.produce("b", [make(seq=2), make(seq=1, sid=2)], 0.0)
    [w3] = b.sync(0.0)          # only the first replica has room: what came since
    assert w3.backup_id == w1.backup_id and len(chunks_of(w3)) == 2
    ack(b, fb, [w2])
    [w4] = b.sync(0.0)          # the second one catches up with the same references
    assert w4.backup_id == w2.backup_id and w4.frames is not w3.frames
    assert [bytes(f) for f in w4.frames] == [bytes(f) for f in w3.frames]
    ack(b, fb, [w3, w4])
    assert [t for t, _ in b.take_replies()] == ["a", "b"]


def test_runs_long_enough_for_zero_copy_but_short_of_the_pack_bound_are_packed():
    """~64 KiB chunks of different segments (as in the throughput preset): one frame, not three."""
    def mid(seq=0, sid=1):
        return chunk.encode(1, seq, sid, 0, [b"m" * 1000] * 64)
    assert ZERO_COPY_MIN_BYTES <= len(mid()) < frame_pack.PACK_RUN_BYTES_MAX
    b = broker(desc(1), desc(2))
    b.produce("a", [mid(seq=0)], 0.0)
    b.produce("b", [mid(sid=2)], 0.0)
    b.produce("c", [mid(seq=1)], 0.0)
    [w] = b.sync(0.0)
    assert [type(f) for f in w.frames] == [bytes] and w.chunks == 3
    assert [(chunk.read_header(c).stream_id, chunk.read_header(c).sequence)
            for c in chunks_of(w)] == [(1, 0), (2, 0), (1, 1)]


def test_packed_frames_are_bounded_and_a_lone_short_run_is_not_copied(monkeypatch):
    runs = [memoryview(bytes([i]) * 100) for i in range(7)]
    monkeypatch.setattr(frame_pack, "PACKED_FRAME_BYTES_MAX", 250)
    frames = frame_pack.pack(runs)
    assert [len(f) for f in frames] == [200, 200, 200, 100]
    assert b"".join(frames) == b"".join(runs)
    assert frames[-1] is runs[-1]
    assert frame_pack.pack([]) == []


def test_a_write_after_an_error_packs_the_same_bytes_again():
    b = broker(desc(1), desc(2))
    fb = FakeBackups()
    b.produce("a", [make(seq=0), make(sid=2), make(seq=1)], 0.0)
    [w1] = b.sync(0.0)
    b.write_done(w1, None, StorageError("disk full"), 0.0)
    for _ in range(50):
        writes = b.sync(10.0)
        if writes:
            break
    [w2] = writes
    assert w2.fields["offset"] == 0
    assert [bytes(f) for f in w2.frames] == [bytes(f) for f in w1.frames]
    ack(b, fb, [w2])


def test_chunks_accumulate_while_a_write_is_in_flight():
    b = broker()
    fb = FakeBackups()
    for seq in range(5):
        b.produce(f"a{seq}", [make(seq=seq)], 0.0)
    [w1] = b.sync(0.0)
    assert len(chunks_of(w1)) == 5
    for seq in range(5, 8):
        b.produce(f"a{seq}", [make(seq=seq)], 0.0)
    assert b.sync(0.0) == []                       # REPLICATION_IN_FLIGHT_MAX = 1
    ack(b, fb, [w1])
    assert [t for t, _ in b.take_replies()] == [f"a{i}" for i in range(5)]
    [w2] = b.sync(0.0)
    assert len(chunks_of(w2)) == 3 and w2.fields["offset"] == sum(len(f) for f in w1.frames)
    ack(b, fb, [w2])
    assert len(b.take_replies()) == 3
    assert b.stats()["chunks_per_replication_write"] == 4.0
    assert fetched(b) == list(range(8))


def test_in_flight_window_of_two():
    b = broker(replication_in_flight_max=2)
    fb = FakeBackups()
    b.produce("a", [make(seq=0)], 0.0)
    [w1] = b.sync(0.0)
    b.produce("b", [make(seq=1)], 0.0)
    [w2] = b.sync(0.0)
    assert w2.fields["offset"] == w1.end_bytes
    assert b.sync(0.0) == []
    ack(b, fb, [w1, w2])
    assert [t for t, _ in b.take_replies()] == ["a", "b"]


def test_backup_timeout_rereplicates_everything_from_offset_zero_without_early_ack():
    b = broker()
    fb = FakeBackups()
    b.produce("a", [make(seq=0)], 0.0)
    [w1] = b.sync(0.0)
    ack(b, fb, [w1])
    assert b.take_replies()
    b.produce("b", [make(seq=1)], 1.0)
    [w2] = b.sync(1.0)
    assert w2.backup_id == w1.backup_id and w2.fields["offset"] > 0
    b.tick(1.0 + TIMEOUT - 0.01)
    assert b.sync(1.5) == []                       # not timed out yet
    b.tick(1.0 + TIMEOUT)                          # now it has
    assert b.take_replies() == [] and fetched(b) == [0]
    [w3] = b.sync(3.1)
    assert w3.backup_id != w1.backup_id
    assert w3.fields["offset"] == 0 and len(chunks_of(w3)) == 2   # the replacement starts empty
    ack(b, fb, [w2])                               # the late answer of the replaced backup
    assert b.take_replies() == [] and fetched(b) == [0]
    ack(b, fb, [w3])
    assert b.take_replies() == [("b", [[0, 0, 4, 4]])]
    assert fetched(b) == [0, 1]
    assert b.stats()["replica_failures"] == 1


@pytest.mark.parametrize("error", [StorageError("disk full"), BadRequest("offset mismatch")])
def test_backup_error_replaces_it(error):
    b = broker()
    b.produce("a", [make(seq=0)], 0.0)
    [w1] = b.sync(0.0)
    b.write_done(w1, None, error, 0.1)
    [w2] = b.sync(0.1)
    assert w2.backup_id != w1.backup_id and w2.fields["offset"] == 0
    ack(b, FakeBackups(), [w2])
    assert b.take_replies() == [("a", [[0, 0, 0, 0]])]


def test_a_lone_backup_that_times_out_is_retried_from_what_it_acknowledged():
    b = broker(backups=(1,))
    fb = FakeBackups()
    b.produce("a", [make(seq=0)], 0.0)
    [w1] = b.sync(0.0)
    ack(b, fb, [w1])
    assert len(b.take_replies()) == 1
    b.produce("b", [make(seq=1)], 1.0)
    [w2] = b.sync(1.0)
    b.tick(1.0 + TIMEOUT)                          # no other backup to move to
    assert b.sync(1.0 + TIMEOUT) == []             # a pause first
    [w3] = b.sync(1.5 + TIMEOUT)
    assert w3.backup_id == 1 and w3.fields["offset"] == w1.end_bytes
    ack(b, fb, [w3])
    assert b.take_replies() == [("b", [[0, 0, 4, 4]])]


def test_a_lone_backup_that_lost_its_replica_is_restarted_from_zero():
    b = broker(backups=(1,))
    fb = FakeBackups()
    b.produce("a", [make(seq=0)], 0.0)
    ack(b, fb, b.sync(0.0))
    b.produce("b", [make(seq=1)], 0.0)
    [w2] = b.sync(0.0)
    b.write_done(w2, None, BadRequest("unknown replica at offset > 0"), 0.1)
    [w3] = b.sync(1.0)
    assert w3.backup_id == 1 and w3.fields["offset"] == 0 and w3.chunks == 2
    ack(b, fb, [w3])
    assert b.take_replies()[-1] == ("b", [[0, 0, 4, 4]])


def test_wrong_length_in_the_reply_is_a_failure():
    b = broker()
    b.produce("a", [make(seq=0)], 0.0)
    [w1] = b.sync(0.0)
    b.write_done(w1, {"length": 3}, None, 0.1)
    assert b.take_replies() == []
    [w2] = b.sync(0.1)
    assert w2.backup_id != w1.backup_id


def test_throttled_backup_is_retried_from_what_it_acknowledged():
    b = broker()
    fb = FakeBackups()
    b.produce("a", [make(seq=0)], 0.0)
    [w1] = b.sync(0.0)
    ack(b, fb, [w1])
    assert len(b.take_replies()) == 1
    b.produce("b", [make(seq=1)], 0.0)
    [w2] = b.sync(0.0)
    b.write_done(w2, None, Throttled("busy"), 0.0)
    assert b.sync(0.01) == []                      # backing off
    [w3] = b.sync(0.1)
    assert w3.backup_id == w1.backup_id and w3.fields["offset"] == w1.end_bytes
    ack(b, fb, [w3])
    assert b.take_replies() == [("b", [[0, 0, 4, 4]])]


def test_no_backup_fails_the_request_retriably_and_a_retry_waits_for_durability():
    b = broker(backups=())
    fb = FakeBackups()
    assert b.produce("a", [make(seq=0)], 0.0) is None
    assert b.sync(0.0) == []
    b.tick(b.cfg.produce_timeout_s - 0.1)
    assert b.take_replies() == []
    b.tick(b.cfg.produce_timeout_s)
    [(token, err)] = b.take_replies()
    assert token == "a" and err.code == "replication_failed" and err.retriable
    # The retry is a duplicate of a chunk not yet durable: it waits too.
    assert b.produce("a2", [make(seq=0)], 7.0) is None
    b.placement.set_backups(backup_list(1), 7.0)
    [w] = b.sync(7.0)
    ack(b, fb, [w], 7.1)
    assert b.take_replies() == [("a2", [[0, 0, 0, 0]])]
    assert b.stats()["chunks_appended"] == 1 and fetched(b) == [0]


def test_virtual_segment_rollover_closes_it_and_picks_new_backups():
    size = len(make())
    b = broker(virtual_segment_bytes=2 * size)
    fb = FakeBackups()
    for seq in range(3):
        b.produce(f"a{seq}", [make(seq=seq)], 0.0)
    writes = b.sync(0.0)
    assert [(w.fields["vseg"], w.chunks, w.fields["close"]) for w in writes] == [(0, 2, True), (1, 1, False)]
    assert writes[0].backup_id != writes[1].backup_id   # load spread over the two backups
    ack(b, fb, writes)
    assert len(b.take_replies()) == 3
    vlog = b.vlog_list[0]
    assert vlog.vsegs[0].finished and not vlog.vsegs[1].finished
    assert (writes[0].backup_id, 0, 0) in fb.closed


def test_backup_death_restores_redundancy_of_finished_segments():
    size = len(make())
    b = broker(virtual_segment_bytes=size)
    fb = FakeBackups()
    b.produce("a", [make(seq=0)], 0.0)
    b.produce("b", [make(seq=1)], 0.0)
    ack(b, fb, b.sync(0.0))
    vs0 = b.vlog_list[0].vsegs[0]
    assert vs0.finished
    holder = vs0.replicas[0].backup_id
    other = 3 - holder
    b.placement.set_backups(backup_list(other), 1.0)
    writes = b.sync(1.0)
    again = [w for w in writes if w.fields["vseg"] == 0]
    assert len(again) == 1 and again[0].backup_id == other
    assert again[0].fields["offset"] == 0 and again[0].fields["close"] is True
    ack(b, fb, writes, 1.0)
    assert vs0.finished


def test_groups_spread_over_virtual_logs():
    # V = number of groups: one log per group (the Kafka-like layout).
    b = broker(desc(1, Q=4), virtual_logs=4)
    for p in range(4):
        b.produce(p, [make(producer=p)], 0.0)
    groups = b.streams[1].streamlets[0].groups
    assert len({g.vlog.id for g in groups}) == 4
    assert len(b.sync(0.0)) == 4
    # replication_capacity 1: the stream uses one log whatever V is.
    b = broker(desc(1, Q=4, capacity=1), virtual_logs=4)
    for p in range(4):
        b.produce(p, [make(producer=p)], 0.0)
    assert len({g.vlog.id for g in b.streams[1].streamlets[0].groups}) == 1
    [w] = b.sync(0.0)
    assert w.chunks == 4


def test_one_virtual_log_batches_many_streams():
    b = broker(desc(1), desc(2), desc(3))
    fb = FakeBackups()
    for sid in (1, 2, 3):
        b.produce(sid, [make(sid=sid)], 0.0)
    [w] = b.sync(0.0)
    assert [chunk.read_header(c).stream_id for c in chunks_of(w)] == [1, 2, 3]
    ack(b, fb, [w])
    assert sorted(t for t, _ in b.take_replies()) == [1, 2, 3]


def test_replication_factor_and_durability_get_their_own_logs():
    b = broker(desc(1, R=2), desc(2, R=3, durability="disk"), backups=(1, 2, 3))
    b.produce("a", [make(sid=1)], 0.0)
    b.produce("b", [make(sid=2)], 0.0)
    writes = b.sync(0.0)
    by_log = {}
    for w in writes:
        by_log.setdefault(w.fields["vlog"], []).append(w)
    assert sorted(len(v) for v in by_log.values()) == [1, 2]
    disk = next(v for v in by_log.values() if len(v) == 2)
    assert all(w.fields["durability"] == "disk" for w in disk)
    assert len({w.backup_id for w in disk}) == 2


def test_backups_on_other_nodes_are_preferred():
    b = Broker("nodeA", BrokerConfig(), broker_id=ME)
    b.apply_metadata([desc()], 1)
    b.placement.set_backups(backup_list(1, 2, node_of=lambda i: "nodeA" if i == 1 else "nodeB"), 0.0)
    for seq in range(3):
        b.produce(seq, [make(seq=seq)], 0.0)
        assert b.sync(0.0)[0].backup_id == 2
        b.vlog_list[0].close_open()   # a new virtual segment each time
        for w in list(b._writes):
            b.write_done(w, {"length": w.end_bytes}, None, 0.0)


def test_virtual_segment_checksum_chains_the_chunk_header_checksums():
    b = broker()
    b.produce("a", [make(seq=0), make(seq=0, producer=2)], 0.0)
    [w] = b.sync(0.0)
    expected = 0
    for c in chunks_of(w):
        expected = crc32c(bytes(c[4:8]), expected)
        assert struct.unpack_from("<I", c, 4)[0] == chunk.verify(c).header_crc
    assert b.vlog_list[0].vsegs[0].checksum == expected


def test_deleting_a_stream_fails_its_waiting_requests():
    b = broker(desc(1), desc(2))
    b.produce("a", [make(sid=1)], 0.0)
    b.produce("b", [make(sid=2)], 0.0)
    b.apply_metadata([desc(2)], 2, [[1, 2]])
    [(token, err)] = b.take_replies()
    assert token == "a" and err.code == "unknown_stream"
    fb = FakeBackups()
    ack(b, fb, b.sync(0.0))           # the deleted stream's chunk is simply not sent
    assert b.take_replies() == [("b", [[0, 0, 0, 0]])]
    assert b.stats()["durable_lag_bytes"] == 0


def test_pending_requests_are_bounded():
    b = broker(backups=(), pending_produce_max=2)
    b.produce("a", [make(seq=0)], 0.0)
    b.produce("b", [make(seq=1)], 0.0)
    with pytest.raises(Throttled):
        b.produce("c", [make(seq=2)], 0.0)


def test_a_chunk_released_before_a_replacement_replica_got_it_goes_as_a_void_of_its_size():
    """Every copy of a virtual segment keeps one byte layout: a chunk released (compacted away,
    deleted) before a replacement replica was written goes there as a void chunk of its size,
    so an abandoned copy is a prefix of the current one (recovery reads the longest: simulation
    seed 566 lost acknowledged chunks of a compacted stream when the re-replicated copy came out
    shorter than the copy the broker had abandoned)."""
    b = broker(desc(seg=4096, G=2))
    fb = FakeBackups()
    b.produce("a", [make(seq=0, n=200)], 0.0)
    b.produce("b", [make(seq=1, n=200)], 0.0)
    writes = b.sync(0.0)
    ack(b, fb, writes)
    assert b.take_replies()
    [old] = fb.replicas.values()
    vs = b.vlog_list[0].vsegs[0]
    first = vs.segs[0]
    assert vs.segs[1] is not first, "the two chunks are in two segments"
    first.release()                                  # as a swap's release or retention does
    b.placement.set_backups(backup_list(2), 1.0)     # the holder is gone: re-replicate
    [w] = b.sync(1.0)
    assert w.fields["offset"] == 0 and w.fields.get("reset")
    ack(b, fb, [w], 1.0)
    new = fb.replicas[(2, w.fields["vlog"], w.fields["vseg"])]
    assert len(new) == len(old)
    voided, kept = split(bytes(new))
    h = chunk.verify(voided)
    assert (h.stream_id, h.record_count, h.size) == (chunk.VOID_STREAM_ID, 0, len(split(bytes(old))[0]))
    assert kept == split(bytes(old))[1]              # the live chunk at the same offset


def test_a_void_chunk_is_a_valid_chunk_of_exactly_its_size():
    for size in (chunk.VOID_SIZE_MIN, chunk.VOID_SIZE_MIN + 1, 5000):
        v = chunk.void(size)
        assert len(v) == size and chunk.verify(v).stream_id == chunk.VOID_STREAM_ID
    with pytest.raises(ValueError):
        chunk.void(chunk.VOID_SIZE_MIN - 1)
