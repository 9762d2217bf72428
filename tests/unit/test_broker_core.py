"""The broker core without replication (R=1): produce rules, fetch rules, metadata."""

import struct

import pytest

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.errors import BadRequest, NotReady

ME = 7


def desc(sid=1, *, streamlets=2, Q=1, G=4, seg=64 * 1024, R=1, placement=None, name=None):
    return {"name": name or f"s{sid}", "id": sid, "streamlets": streamlets, "active_groups": Q,
            "replication": R, "group_segments": G, "segment_size_bytes": seg,
            "durability": "memory", "replication_capacity": 0,
            "placement": placement if placement is not None else [ME] * streamlets,
            "brokers": {str(ME): "127.0.0.1:1"}, "version": 1, "ready": True}


def broker(*streams, **cfg):
    b = Broker("n1", BrokerConfig(**cfg), broker_id=ME)
    b.apply_metadata(list(streams) or [desc()], 1)
    return b


def make(producer=1, seq=0, sid=1, sl=0, n=3, value=b"val"):
    return chunk.encode(producer, seq, sid, sl, [value] * n)


def cursor(low=0, **offsets):
    return {"low": low, "offsets": {int(g[1:]): o for g, o in offsets.items()}}


def fetch_one(b, sid=1, sl=0, cur=None, max_bytes=1 << 20):
    results, frames = b.reads.fetch([[sid, sl, cur or cursor(), max_bytes]])
    err, n, groups = results[0]
    assert err is None, err
    assert n == len(frames)
    return [chunk.Chunk(c) for f in frames for c in chunk.frame_chunks(f)], groups


def test_produce_then_fetch_round_trip():
    b = broker()
    assert b.produce("r1", [make(seq=0, n=3), make(seq=0, sl=1, n=2)], 0.0) == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert b.produce("r2", [make(seq=1, n=4)], 0.0) == [[0, 0, 3, 3]]
    chunks, groups = fetch_one(b)
    assert [(c.header.group, c.header.base_offset, len(c)) for c in chunks] == [(0, 0, 3), (0, 3, 4)]
    assert chunks[0].values() == [b"val"] * 3
    assert groups == [[0, 0, 0, 7, False]]
    assert b.reads.offsets(1, 1) == [[0, 0, 0, 2, False]]
    s = b.stats()
    assert s["chunks_appended"] == 3 and s["bytes_appended"] > 0 and s["durable_lag_bytes"] == 0


def test_duplicate_is_acknowledged_with_its_position_and_not_stored():
    b = broker()
    first = b.produce("a", [make(seq=0)], 0.0)
    b.produce("b", [make(seq=1)], 0.0)
    assert b.produce("c", [make(seq=1)], 0.0) == [[0, 0, 3, 3]]     # the last one again
    assert b.produce("d", [make(seq=0)], 0.0) == first           # an older one: found by scan
    assert b.stats()["chunks_appended"] == 2 and b.stats()["duplicates"] == 2
    assert len(fetch_one(b)[0]) == 2


def test_a_retry_older_than_the_duplicate_scan_is_acknowledged_without_a_position():
    # Seed 2002: a retry held back behind the scan was answered with the newest chunk's
    # position, which holds another chunk. It is stored: say so, and say no position.
    b = broker(duplicate_scan_chunks_max=2)
    for seq in range(4):
        b.produce(f"p{seq}", [make(seq=seq)], 0.0)
    assert b.produce("r2", [make(seq=2)], 0.0) == [[0, 0, 6, 6]]   # within the scan
    assert b.produce("r0", [make(seq=0)], 0.0) == [[]]             # beyond it
    assert b.stats()["chunks_appended"] == 4 and b.counters.get("duplicates_unplaced") == 1


def test_sequence_gap_and_new_producer_must_start_at_zero():
    b = broker()
    [res] = b.produce("a", [make(producer=5, seq=3)], 0.0)
    assert res[0] == "sequence_gap" and res[2] is True
    b.produce("b", [make(producer=5, seq=0)], 0.0)
    [res] = b.produce("c", [make(producer=5, seq=2)], 0.0)
    assert res[0] == "sequence_gap"
    assert b.produce("d", [make(producer=5, seq=1)], 0.0) == [[0, 0, 3, 3]]
    assert b.stats()["chunks_appended"] == 2


def reseal_header(buf):
    struct.pack_into("<I", buf, 4, chunk.header_crc(buf))
    return buf


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "trailing", "empty", "magic", "short",
                                    "count", "keyed_count", "flags"])
def test_corrupt_chunk_is_refused_with_nothing_appended(damage):
    b = broker()
    good = make(seq=0)
    bad = bytearray(good)
    if damage == "bitflip":
        bad[100] ^= 0x10
    elif damage == "truncate":
        bad = bad[:-1]
    elif damage == "trailing":
        bad += b"\0"
    elif damage == "empty":
        bad = bytearray(chunk.encode(1, 0, 1, 0, []))
    elif damage == "magic":
        bad[0] ^= 1
    elif damage == "short":
        bad = bad[:10]
    elif damage == "count":        # checksums valid, columns inconsistent
        struct.pack_into("<I", bad, 44, 2)
        bad = reseal_header(bad)
    elif damage == "keyed_count":
        bad = bytearray(chunk.encode(1, 0, 1, 0, [b"a", b"bb", b"c"], keys=[b"k", None, b"kk"]))
        struct.pack_into("<I", bad, 44, 2)
        bad = reseal_header(bad)
    elif damage == "flags":        # claims keys it does not have
        bad[3] |= chunk.FLAG_KEYS
        bad = reseal_header(bad)
    [res] = b.produce("a", [bytes(bad)], 0.0)
    assert res[0] == "corrupt_chunk" and res[2] is False
    assert b.stats()["chunks_appended"] == 0 and b.reads.offsets(1, 0) == []
    # The producer's sequence was not consumed: the good chunk is still sequence 0.
    assert b.produce("b", [good], 0.0) == [[0, 0, 0, 0]]


def test_keyed_chunks_are_stored():
    b = broker()
    c = chunk.encode(1, 0, 1, 0, [b"a", b"bb"], keys=[b"k", None])
    assert b.produce("a", [c], 0.0) == [[0, 0, 0, 0]]
    [got], _ = fetch_one(b)
    assert got.keys() == [b"k", None] and got.values() == [b"a", b"bb"]


def test_refusals_do_not_affect_other_chunks_of_the_request():
    b = broker(desc(1, placement=[ME, 99]))
    huge = chunk.encode(1, 0, 1, 0, [b"x" * 70_000])
    results = b.produce("a", [make(sid=42), make(sl=1), huge, make(sl=5), make(seq=0)], 0.0)
    codes = [r[0] for r in results]
    # Streamlet 5 is beyond the count this broker knows: maybe raised since, so retriable.
    assert codes == ["unknown_stream", "not_owner", "record_too_large", "not_ready", 0]
    assert results[0][2] is True and results[1][2] is True and results[3][2] is True
    assert b.stats()["chunks_appended"] == 1


def test_unregistered_broker_is_not_ready():
    b = Broker("n1")
    b.apply_metadata([desc()], 1)
    with pytest.raises(NotReady):
        b.produce("a", [make()], 0.0)


def test_group_rollover_and_fetch_serves_lowest_unfinished_group_per_slot():
    big = b"v" * 300
    size = len(make(value=big))
    b = broker(desc(1, streamlets=1, Q=2, G=1, seg=2 * size))
    # Producer 0 has slot 0, producer 1 slot 1; two chunks fill a group.
    for seq in range(3):
        b.produce("a", [make(producer=0, seq=seq, value=big)], 0.0)
        b.produce("b", [make(producer=1, seq=seq, value=big)], 0.0)
    groups = b.reads.offsets(1, 0)
    # slot 0: group 0 (closed, 2 chunks) then group 2; slot 1: group 1 then group 3.
    assert [(g[0], g[1], g[3], g[4]) for g in groups] == [
        (0, 0, 6, True), (1, 1, 6, True), (2, 0, 3, False), (3, 1, 3, False)]
    chunks, described = fetch_one(b)
    assert sorted({c.header.group for c in chunks}) == [0, 1]   # not 2 or 3 yet
    assert len(described) == 4
    # Finished groups (closed and read to their end) are skipped; the next of the slot served.
    chunks, _ = fetch_one(b, cur=cursor(0, g0=6, g1=6))
    assert sorted({c.header.group for c in chunks}) == [2, 3]
    chunks, described = fetch_one(b, cur=cursor(2, g3=3))
    assert [c.header.group for c in chunks] == [2] and [g[0] for g in described] == [2, 3]


def test_fetch_budget_is_shared_fairly_and_at_least_one_chunk():
    b = broker(desc(1, streamlets=1, Q=2, G=8, seg=64 * 1024))
    for seq in range(10):
        b.produce("a", [make(producer=0, seq=seq)], 0.0)
        b.produce("b", [make(producer=1, seq=seq)], 0.0)
    size = len(make())
    chunks, _ = fetch_one(b, max_bytes=4 * size)
    assert len(chunks) == 4 and {c.header.group for c in chunks} == {0, 1}
    assert len(fetch_one(b, max_bytes=1)[0]) == 1


def test_fetch_errors_are_per_read():
    b = broker(desc(1, placement=[ME, 99]))
    b.produce("a", [make()], 0.0)
    results, frames = b.reads.fetch([
        [1, 0, cursor(), 1000], [1, 1, cursor(), 1000], [77, 0, cursor(), 1000],
        [1, 0, {"low": "x"}, 1000], "junk", [1, 0, cursor(0, g0=999), 1000],
        [1, 0, {"offsets": {"0": 1}}, 1000]])
    codes = [r[0] and r[0][0] for r in results]
    assert codes == [None, "not_owner", "unknown_stream", "bad_request", "bad_request",
                     "offset_out_of_range", None]
    assert [r[1] for r in results] == [1, 0, 0, 0, 0, 0, 1]
    assert len(frames) == 2
    with pytest.raises(BadRequest):
        b.reads.fetch("not a list")


@pytest.mark.parametrize("read, field", [
    ([True, 0, {}, 1000], "'sid'"), ([-1, 0, {}, 1000], "'sid'"), ([2**64, 0, {}, 1000], "'sid'"),
    ([1, False, {}, 1000], "'sl'"), ([1, 2**32, {}, 1000], "'sl'"), ([1, 0.0, {}, 1000], "'sl'"),
    ([1, 0, {}, True], "'max_bytes'"), ([1, 0, {}, -5], "'max_bytes'"),
    ([1, 0, {"offsets": {0: True}}, 1000], "'cursor offset'"),
    ([1, 0, {"offsets": {0: -1}}, 1000], "'cursor offset'"),
    ([1, 0, {"offsets": {0: 2**64}}, 1000], "'cursor offset'"),
    ([1, 0, {"offsets": {2**32: 0}}, 1000], "'cursor group'"),
    ([1, 0, {"offsets": {False: 0}}, 1000], "'cursor group'"),
    ([1, 0, {"offsets": {"x": 0}}, 1000], "'cursor group'"),
])
def test_each_bad_field_of_a_read_is_refused_by_name(read, field):
    b = broker()
    b.produce("a", [make()], 0.0)
    results, frames = b.reads.fetch([read, [1, 0, cursor(), 1000]])
    assert results[0][0][0] == "bad_request" and field in results[0][0][1]
    assert results[1][0] is None and results[1][1] == 1 and len(frames) == 1


def test_reads_at_the_bounds_of_each_field_are_parsed():
    b = broker()
    b.produce("a", [make()], 0.0)
    results, _ = b.reads.fetch([[2**64 - 1, 0, cursor(), 2**64 - 1], [1, 2**32 - 1, cursor(), 0],
                          [1, 0, {"offsets": {"0": 1, 2**32 - 1: 1}}, 1000]])
    assert [r[0] and r[0][0] for r in results] == ["unknown_stream", "not_ready",
                                                   "offset_out_of_range"]


def test_metadata_adds_moves_and_deletes_streams():
    b = broker(desc(1), desc(2))
    b.produce("a", [make(sid=2)], 0.0)
    # Missing from the list but not deleted: kept (data and all), served by no streamlet here.
    assert b.apply_metadata([desc(1, placement=[99, ME])], 4) == 1
    assert set(b.streams) == {1, 2}
    [res] = b.produce("x", [make(sid=2)], 0.0)
    assert res[0] == "not_owner"
    assert b.streams[2].streamlets[0].groups    # its record is still held
    # Dropped only on an explicit, versioned delete (a tombstone).
    b.apply_metadata([desc(1, placement=[99, ME]), {"id": "garbage"}, 17], 5, [[2, 5]])
    assert b.metadata_version == 5 and set(b.streams) == {1}
    [res] = b.produce("b", [make(sid=2)], 0.0)
    assert res[0] == "unknown_stream"
    [res] = b.produce("c", [make(sid=1, sl=0)], 0.0)
    assert res[0] == "not_owner"
    assert b.produce("d", [make(sid=1, sl=1)], 0.0) == [[0, 0, 0, 0]]


def test_forgotten_producer_is_found_in_the_stored_chunks():
    b = broker(producer_table_max=2)
    for p in range(4):                       # producers 0 and 1 are evicted
        b.produce("a", [make(producer=p, seq=0)], 0.0)
        b.produce("a", [make(producer=p, seq=1)], 0.0)
    assert len(b.producers) == 2 and b.producers.evictions > 0
    assert b.produce("b", [make(producer=0, seq=1)], 0.0)[0][0] == 0    # duplicate, recognised
    assert b.produce("c", [make(producer=0, seq=2)], 0.0) == [[0, 0, 24, 24]]
    [res] = b.produce("d", [make(producer=55, seq=4)], 0.0)              # truly unknown
    assert res[0] == "sequence_gap"
    assert b.stats()["chunks_appended"] == 9


def test_acks_false_answers_at_once():
    b = broker(desc(1, R=2))
    assert b.produce("a", [make()], 0.0, acks=False) == [[0, 0, 0, 0]]
    assert b.stats()["pending_produce"] == 0


def test_bytes_behind_counts_durable_chunks_past_a_cursor_across_groups_and_segments():
    # Chunks of ~300 bytes, 3 per 1 KiB segment, 2 segments per group: 6 chunks a group.
    size = len(make(n=3, value=b"v" * 70))
    assert 3 * size <= 1024 < 4 * size
    b = broker(desc(G=2, seg=1024))
    for seq in range(9):            # 6 chunks fill group 0 (2 segments), 3 go to group 1
        b.produce("p", [make(seq=seq, value=b"v" * 70)], 0.0)
    assert [g[0] for g in b.reads.offsets(1, 0)] == [0, 1]
    assert b.reads.bytes_behind(1, 0, 0, {}) == 9 * size
    assert b.reads.bytes_behind(1, 0, 0, {0: 3}) == 8 * size     # at a chunk boundary
    assert b.reads.bytes_behind(1, 0, 0, {0: 4}) == 8 * size     # inside a chunk: it counts whole
    assert b.reads.bytes_behind(1, 0, 0, {0: 9}) == 6 * size     # in the second segment
    assert b.reads.bytes_behind(1, 0, 1, {1: 3}) == 2 * size     # group 0 finished
    assert b.reads.bytes_behind(1, 0, 1, {1: 9}) == 0
    assert b.reads.bytes_behind(1, 1, 0, {}) == 0                # a streamlet with no data


def test_bytes_behind_stops_at_the_durable_head():
    from kera.broker.group import Group
    data = make(n=3)
    g = Group(0, 0, max_segments=4, segment_size_bytes=2 * len(data))
    for _ in range(4):
        g.append(bytearray(data), len(data), 3)
    g.set_durable(9)    # 3 of 4 chunks: the second segment's last one is not durable
    assert g.durable_bytes_from(0) == 3 * len(data) and g.durable_bytes_from(7) == len(data)
    assert g.durable_bytes_from(9) == 0
    g.set_durable(12)
    assert g.durable_bytes_from(0) == 4 * len(data)


def test_a_raised_streamlet_count_is_applied_and_a_lowered_one_ignored():
    b = broker(desc(1, streamlets=2))
    [res] = b.produce("a", [make(sl=3)], 0.0)
    assert res[0] == "not_ready" and res[2] is True   # not known here yet
    b.apply_metadata([desc(1, streamlets=4)], 2)
    assert b.produce("a", [make(sl=3), make(sl=0)], 0.0) == [[0, 0, 0, 0], [0, 0, 0, 0]]
    [got], _ = fetch_one(b, sl=3)
    assert got.values() == [b"val"] * 3
    b.apply_metadata([desc(1, streamlets=2)], 3)      # never lowered: streamlet 3 stays
    assert b.streams[1].info.streamlets == 4
    assert len(fetch_one(b, sl=3)[0]) == 1
