"""The broker core's transactions (R=1 unless said): verification of a producer's first
transactional chunk, markers (idempotent, in the data's slot), read isolation."""

from __future__ import annotations

import pytest

from kera.broker.core import Broker, BrokerConfig
from kera.codec import chunk, txn
from kera.codec.chunk import MARKER_PRODUCER_ID
from kera.errors import ProducerFenced

ME = 7
PID = 1000


def desc(sid=1, *, streamlets=1, Q=1, G=4, seg=64 * 1024, R=1):
    return {"name": f"s{sid}", "id": sid, "streamlets": streamlets, "active_groups": Q,
            "replication": R, "group_segments": G, "segment_size_bytes": seg,
            "durability": "memory", "replication_capacity": 0, "placement": [ME] * streamlets,
            "brokers": {str(ME): "127.0.0.1:1"}, "version": 1, "ready": True}


def broker(*streams):
    b = Broker("n1", BrokerConfig(), broker_id=ME)
    b.apply_metadata(list(streams) or [desc()], 1)
    return b


def tx_chunk(seq, pid=PID, epoch=0, n=2, value=b"t", sl=0):
    return chunk.encode(txn.kera_producer_id(pid, epoch), txn.txn_sequence(seq), 1, sl,
                        [value] * n)


def plain(seq, producer=5, n=1, value=b"p"):
    return chunk.encode(producer, seq, 1, 0, [value] * n)


def marker(number, commit, pid=PID, epoch=0, sl=0):
    return ["tid", pid, epoch, number, commit, "s1", sl]


def verify_all(b, number=1, error=None):
    """Answer every txn_verify asked, as the coordinator would; returns what was asked."""
    asked = b.take_txn_verifies()
    for key, _ in asked:
        b.txn_verified(key, None if error else {"txn": number}, error)
    return [f for _, f in asked]


def read(b, isolation="read_committed", cur=None):
    results, frames = b.reads.fetch([[1, 0, cur or {"low": 0, "offsets": {}}, 1 << 20]],
                              isolation=isolation)
    assert results[0][0] is None, results[0][0]
    return [chunk.Chunk(c) for f in frames for c in chunk.frame_chunks(f)]


def values(chunks):
    return [v for c in chunks for v in c.values()]


def test_first_transactional_chunk_waits_for_verification_then_appends_in_order():
    b = broker()
    assert b.produce("r1", [tx_chunk(0), tx_chunk(1)], 0.0) is None    # held, both
    assert b.produce("r2", [tx_chunk(2)], 0.0) is None                 # behind them
    asked = verify_all(b, number=4)
    assert asked == [{"producer_id": PID, "epoch": 0, "part": ["s1", 0], "add": True}]
    replies = dict(b.take_replies())
    assert replies["r1"] == [[0, 0, 0, 0], [0, 0, 2, 2]] and replies["r2"] == [[0, 0, 4, 4]]
    open_ = b.txn.indexes[(1, 0)].slots[0].open[PID]
    assert (open_.txn, open_.first_number) == (4, 0)
    # the transaction is open here now: later chunks append at once, unasked
    assert b.produce("r3", [tx_chunk(3)], 0.0) == [[0, 0, 6, 6]]
    assert b.take_txn_verifies() == []


def test_a_retried_transactional_chunk_is_a_duplicate_not_a_second_record():
    b = broker()
    b.produce("r1", [tx_chunk(0)], 0.0)
    verify_all(b)
    b.take_replies()
    assert b.produce("again", [tx_chunk(0)], 0.0) == [[0, 0, 0, 0]]
    assert b.stats()["chunks_appended"] == 1 and b.stats()["duplicates"] == 1


def test_a_refused_verification_answers_every_held_chunk_with_its_error():
    b = broker()
    b.produce("r1", [plain(0), tx_chunk(0)], 0.0)
    verify_all(b, error=ProducerFenced("producer 1000 epoch 0 is fenced"))
    [(token, results)] = b.take_replies()
    assert token == "r1" and results[0] == [0, 0, 0, 0]
    assert results[1][0] == ProducerFenced.code
    assert b.stats()["chunks_appended"] == 1


def test_reserved_producer_ids_are_refused_from_producers():
    b = broker()
    forged = txn.build_marker(txn.Marker(PID, 0, 1, True), 1, 0, 0)
    claims = chunk.encode(MARKER_PRODUCER_ID, 0, 1, 0, [b"v"])
    assert [r[0] for r in b.produce("r", [forged, claims], 0.0)] == ["corrupt_chunk",
                                                                     "bad_request"]
    assert b.stats()["chunks_appended"] == 0


def _open_txn(b, n_chunks=2, number=1, pid=PID, epoch=0):
    b.produce("open", [tx_chunk(i, pid, epoch) for i in range(n_chunks)], 0.0)
    verify_all(b, number)
    b.take_replies()


def test_read_committed_stops_at_the_open_transaction_until_its_commit_marker():
    b = broker()
    b.produce("a", [plain(0, value=b"before")], 0.0)
    _open_txn(b)
    b.produce("b", [plain(1, value=b"after")], 0.0)
    assert values(read(b)) == [b"before"]
    assert values(read(b, "read_uncommitted")) == [b"before", b"t", b"t", b"t", b"t", b"after"]
    reply = b.txn_markers("m", [marker(1, True)], 0.0)
    assert reply == {"written": [["s1", 0, PID, 1]], "not_owner": []}
    chunks = read(b)
    assert values(chunks) == [b"before", b"t", b"t", b"t", b"t", b"after"]
    # the control chunk is skipped, its record number stepped over by an empty gap chunk
    assert [(c.header.base_offset, c.span) for c in chunks] == [(0, 1), (1, 2), (3, 2), (5, 1),
                                                                (6, 1)]
    assert chunks[4].header.flags & chunk.FLAG_SPARSE and len(chunks[4]) == 0
    assert all(c.header.producer_id != MARKER_PRODUCER_ID for c in read(b, "read_uncommitted"))


def test_an_aborted_transaction_is_never_served_read_committed():
    b = broker()
    _open_txn(b)
    b.produce("b", [plain(0, value=b"after")], 0.0)
    b.txn_markers("m", [marker(1, False)], 0.0)
    chunks = read(b)
    assert values(chunks) == [b"after"]
    # a gap over the aborted chunks (records 0..3), the plain chunk, a gap over the marker
    assert [(c.header.base_offset, c.span, len(c)) for c in chunks] == [(0, 4, 0), (4, 1, 1),
                                                                        (5, 1, 0)]
    assert values(read(b, "read_uncommitted")) == [b"t"] * 4 + [b"after"]


def test_markers_are_idempotent():
    b = broker()
    _open_txn(b, number=3)
    first = b.txn_markers("m1", [marker(3, True)], 0.0)
    appended = b.stats()["chunks_appended"]
    again = b.txn_markers("m2", [marker(3, True)], 0.0)               # a retry
    late = b.txn_markers("m3", [marker(2, False)], 0.0)               # an earlier one, late
    nothing = b.txn_markers("m4", [marker(9, True, pid=PID + 1)], 0.0)   # nothing open here
    assert first["written"] == again["written"] == [["s1", 0, PID, 3]]
    assert late["written"] == [["s1", 0, PID, 2]] and nothing["written"] == [["s1", 0, PID + 1, 9]]
    assert b.stats()["chunks_appended"] == appended


def test_a_late_marker_of_the_previous_transaction_does_not_close_the_next():
    b = broker()
    _open_txn(b, number=1)
    b.txn_markers("m", [marker(1, True)], 0.0)
    b.produce("next", [tx_chunk(2)], 0.0)
    verify_all(b, number=2)
    b.take_replies()
    b.txn_markers("late", [marker(1, True)], 0.0)
    assert b.txn.indexes[(1, 0)].lso(0) is not None, "transaction 2 stays open"


def test_markers_fence_older_epochs_at_the_broker():
    b = broker()
    _open_txn(b)
    b.txn_markers("m", [marker(1, False, epoch=1)], 0.0)      # the fence's bumped epoch
    [res] = b.produce("zombie", [tx_chunk(2)], 0.0)
    assert res[0] == ProducerFenced.code
    assert b.take_txn_verifies() == []


def test_markers_go_to_the_slot_of_the_data_and_report_other_owners():
    b = broker(desc(Q=4, streamlets=2) | {"placement": [ME, ME + 1]})
    pid = 1001   # kera id (1001 << 8 | 0) % 4 = 0; the fence's epoch 1 would hash to slot 1
    _open_txn(b, pid=pid)
    reply = b.txn_markers("m", [marker(1, False, pid=pid, epoch=1),
                                marker(1, False, pid=pid, sl=1)], 0.0)
    assert reply["not_owner"] == [["s1", 1]]
    slots = b.txn.indexes[(1, 0)].slots
    assert slots[0].aborted and not slots[1].aborted
    assert b.txn.indexes[(1, 0)].lso(0) is None


def test_a_verified_chunk_after_its_transaction_ended_is_refused():
    b = broker()
    _open_txn(b, number=1)
    b.txn_markers("m", [marker(1, True)], 0.0)
    b.produce("stale", [tx_chunk(2)], 0.0)
    verify_all(b, number=1)      # an answer for the transaction that already ended
    [(_, [res])] = b.take_replies()
    assert res[0] == "invalid_txn_state"


def test_isolation_must_be_known():
    b = broker()
    with pytest.raises(Exception, match="isolation"):
        b.reads.fetch([[1, 0, {"low": 0, "offsets": {}}, 100]], isolation="dirty")


def test_a_marker_is_answered_only_once_durable_and_its_retry_waits_too():
    from tests.unit.test_broker_replication import FakeBackups, ack, backup_list
    b = Broker("n1", BrokerConfig(replication_timeout_s=2.0), broker_id=ME)
    b.apply_metadata([desc(R=2)], 1)
    b.placement.set_backups(backup_list(1), 0.0)
    fb = FakeBackups()
    b.produce("open", [tx_chunk(0)], 0.0)
    verify_all(b)
    ack(b, fb, b.sync(0.0))
    b.take_replies()
    assert b.txn_markers("m1", [marker(1, True)], 0.0) is None          # not durable yet
    assert b.txn_markers("m2", [marker(1, True)], 0.0) is None          # its retry: waits too
    assert b.take_replies() == []
    ack(b, fb, b.sync(0.0))
    written = {"written": [["s1", 0, PID, 1]], "not_owner": []}
    assert sorted(b.take_replies()) == [("m1", written), ("m2", written)]


def test_the_reader_steps_over_a_gap_chunk():
    from kera.consumer.cursor import FetchCursor
    b = broker()
    _open_txn(b)
    b.txn_markers("m", [marker(1, False)], 0.0)
    cur = FetchCursor(0)
    [gap] = read(b)
    assert cur.on_chunk(gap.header, gap) == 0 and cur.offsets == {0: 5}
    assert read(b, cur={"low": 0, "offsets": {0: 5}}) == []


def _stored_chunks(b, sid=1, sl=0):
    streamlet = b.streams[sid].streamlets[sl]
    return [bytes(seg.view(i)) for g in streamlet.groups for seg in g.segments
            for i in range(len(seg))]


def test_a_recovered_streamlet_rebuilds_the_index_and_producer_table_of_its_owner():
    from kera.broker.rebuild import StreamletRebuild, install
    from kera.codec.chunk import read_header
    b = broker(desc(Q=2, G=1, seg=1024))
    _open_txn(b, number=1, pid=1000, epoch=0)   # kera id (pid << 8 | epoch) in slot 0
    _open_txn(b, number=2, pid=1001, epoch=1)   # in slot 1
    b.produce("x", [plain(0)], 0.0)
    b.txn_markers("m", [marker(1, False, pid=1000, epoch=1)], 0.0)   # a fence's epoch: slot 0
    b.produce("more", [tx_chunk(i, pid=1001, epoch=1) for i in range(2, 5)], 0.0)
    live = b.txn.indexes[(1, 0)]
    assert live.slots[0].aborted and live.lso(1) is not None
    rb = StreamletRebuild(1, 0, 2, 1, 1024)
    for c in _stored_chunks(b):
        rb.add(c, read_header(c), True)
    heir = broker(desc(Q=2, G=1, seg=1024))
    install(heir, rb)
    slots = {g.id: g.slot for g in b.streams[1].streamlets[0].groups}
    assert {g.id: g.slot for g in heir.streams[1].streamlets[0].groups} == slots
    assert heir.txn.indexes[(1, 0)].snapshot() == live.snapshot()
    # the producer table continues from the plain sequences: the next chunk appends
    [res] = heir.produce("next", [tx_chunk(5, pid=1001, epoch=1)], 0.0)
    assert all(isinstance(x, int) for x in res), res   # stored, not sequence_gap
    assert (MARKER_PRODUCER_ID, 1, 0) not in heir.producers._entries


def test_a_rebuilt_group_that_begins_with_a_marker_keeps_the_marker_slot():
    from kera.broker.rebuild import StreamletRebuild
    from kera.codec.chunk import read_header, stamp
    buf = bytearray(txn.build_marker(txn.Marker(PID, 1, 1, False), 1, 0, 0, slot=3))
    stamp(buf, 5, 0, 0, 40)
    rb = StreamletRebuild(1, 0, 4, 1, 1024)
    rb.add(bytes(buf), read_header(buf), True)
    assert rb.groups[5].group.slot == 3


def test_without_an_isolation_every_chunk_is_served_as_stored():
    # The Kafka listener's reads: its clients skip control batches themselves.
    b = broker()
    _open_txn(b)
    b.txn_markers("m", [marker(1, False)], 0.0)
    results, frames = b.reads.fetch([[1, 0, {"low": 0, "offsets": {}}, 1 << 20]])
    pids = [chunk.read_header(c).producer_id for f in frames for c in chunk.frame_chunks(f)]
    assert pids[-1] == MARKER_PRODUCER_ID and len(pids) == 3


def test_a_broker_reloaded_from_its_disk_rebuilds_the_index(tmp_path):
    # kill -9 without tiering: the R=1 live files hold every acknowledged chunk
    from kera.broker import tier_files
    from tests.unit.test_r1_live import produce_live, restarted
    from tests.unit.test_tier import broker as tier_broker, desc as tier_desc
    b = tier_broker(tmp_path, 1024 * 1024, tier_desc(Q=2))
    produce_live(b, tmp_path, "open", [tx_chunk(0), tx_chunk(1)])
    verify_all(b)
    for w in b.tier.take_live_writes():
        tier_files.write_live(tmp_path, w)
        b.tier.live_written(w, None)
    b.txn_markers("m", [marker(1, False)], 0.0)
    produce_live(b, tmp_path, "open2", [tx_chunk(0, pid=PID + 1, epoch=1)])
    verify_all(b, 7)
    for w in b.tier.take_live_writes():
        tier_files.write_live(tmp_path, w)
        b.tier.live_written(w, None)
    live = b.txn.indexes[(1, 0)]
    b2 = restarted(tmp_path, [tier_desc(Q=2)])
    assert b2.txn.indexes[(1, 0)].snapshot() == live.snapshot()
    assert b2.txn.indexes[(1, 0)].lso(1) == live.lso(1) is not None
    assert (MARKER_PRODUCER_ID, 1, 0) not in b2.producers._entries
    assert b2.producers.get((txn.kera_producer_id(PID, 0), 1, 0)).sequence == 1


def test_a_transaction_held_open_past_the_longest_timeout_is_resolved():
    from kera.broker.txn_writes import RESOLVE_AFTER_S
    b = broker()
    _open_txn(b, number=4)
    assert b.take_txn_resolves(0.0) == []                     # first seen now
    assert b.take_txn_resolves(RESOLVE_AFTER_S / 2) == []
    [(key, fields)] = b.take_txn_resolves(RESOLVE_AFTER_S + 1)
    assert fields == {"producer_id": PID, "epoch": 0, "part": ["s1", 0]}
    assert b.take_txn_resolves(RESOLVE_AFTER_S + 100) == []   # asked once at a time
    b.txn_resolved(key, {"decision": "open", "txn": 4}, None, RESOLVE_AFTER_S + 101)
    assert b.txn.indexes[(1, 0)].lso(0) == 0
    [(key, _)] = b.take_txn_resolves(3 * RESOLVE_AFTER_S)
    # the coordinator no longer holds it open: the broker aborts it itself
    b.txn_resolved(key, {"decision": "abort", "txn": -1}, None, 3 * RESOLVE_AFTER_S)
    assert b.txn.indexes[(1, 0)].lso(0) is None
    assert values(read(b)) == []
    assert b.txn.indexes[(1, 0)].fence(PID).txn == 4
