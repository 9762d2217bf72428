"""The producer's request bookkeeping: request building, acks, retries, ordering. No sockets.

The last test drives the Pipeline against a model of the broker's produce rules (duplicates
acknowledged, gaps refused) through lost requests, lost replies and refusals, with a seed.
"""

import random

import pytest

from kera.codec import chunk
from kera.config import STALL_PROBE_INTERVAL_S, STALL_PROBE_S
from kera.producer.pipeline import FRONT_GAP_ATTEMPTS_MAX, IN_FLIGHT, UNSENT, Pipeline

PID = 1000
SID = 5
Q = 3
# A request size no chunk fits: each request then carries one chunk (the first always goes),
# for tests about what happens to separate requests.
ONE_CHUNK = 1


def make(request_size=1 << 20, window=2, retries=5, timeout_s=1.0):
    return Pipeline(request_size_bytes=request_size, in_flight_per_broker=window,
                    retries_max=retries, request_timeout_s=timeout_s)


def owners(mapping):
    return lambda sid, sl: mapping.get(sl)


def add(pipe, sl, n=1, records=10, size=100):
    lane = pipe.own_lane("s", SID, sl, PID, Q)
    out = []
    for _ in range(n):
        seq = lane.next_sequence
        data = chunk.encode(lane.producer_id, seq, SID, sl, [b"x" * size] * records)
        out.append(pipe.add(lane, data, seq, records))
    return out


def ok(out, req_id=1):
    return {"id": req_id, "ok": True, "results": [[0, 0, i] for i in range(len(out.chunks))]}


def send_all(pipe, now=0.0, mapping=None, first_id=1):
    outs = pipe.build(now, owners(mapping or {0: "b1", 1: "b1", 2: "b2", 3: "b2"}))
    for i, o in enumerate(outs):
        pipe.sent(o, first_id + i, now)
    return outs


def seq_of(c):
    return chunk.read_header(c.data).sequence


def test_one_request_per_broker_takes_each_lanes_next_chunk_then_runs_in_order():
    pipe = make(window=1)
    add(pipe, 0, 3)
    add(pipe, 1, 2)
    add(pipe, 2, 1)
    outs = send_all(pipe)
    by = {o.broker: [(chunk.read_header(c.data).streamlet, seq_of(c)) for c in o.chunks]
          for o in outs}
    # Every streamlet's next chunk first, then each lane's following chunks as a run.
    first, runs = by["b1"][:2], by["b1"][2:]
    assert sorted(first) == [(0, 0), (1, 0)]
    assert sorted(runs) == [(0, 1), (0, 2), (1, 1)]
    assert [sq for sl, sq in by["b1"] if sl == 0] == [0, 1, 2]   # a lane's chunks in order
    assert by["b2"] == [(2, 0)]
    assert all(c.state == IN_FLIGHT for o in outs for c in o.chunks)
    assert send_all(pipe, first_id=10) == []  # window of 1 request per broker is full


def test_runs_leave_room_for_every_streamlets_next_chunk_first():
    size = len(add(make(), 0, 1)[0].data)
    pipe = make(request_size=3 * size, window=1)
    add(pipe, 0, 4)
    add(pipe, 1, 4)
    add(pipe, 2, 4)
    (o,) = send_all(pipe, mapping={0: "b", 1: "b", 2: "b"})
    assert sorted(chunk.read_header(c.data).streamlet for c in o.chunks) == [0, 1, 2]
    pipe = make(request_size=5 * size, window=1)
    add(pipe, 0, 4)
    add(pipe, 1, 1)
    (o,) = send_all(pipe, mapping={0: "b", 1: "b"})
    assert sorted((chunk.read_header(c.data).streamlet, seq_of(c)) for c in o.chunks) == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert sum(len(c.data) for c in o.chunks) <= 5 * size


def test_a_refused_chunk_in_a_run_resends_the_run_from_it_in_order():
    pipe = make(window=1)
    chunks = add(pipe, 0, 3)
    (o,) = send_all(pipe)
    assert o.chunks == chunks
    # chunk 1 throttled; the broker then refuses chunk 2 with a gap (chunk 0 is stored)
    pipe.on_reply("b1", {"id": 1, "ok": True, "results": [
        [0, 0, 0], ["throttled", "busy", True], ["sequence_gap", "gap", True]]}, 0.0)
    assert chunks[0].serial not in pipe.incomplete
    (o,) = send_all(pipe, now=1.0, first_id=2)
    assert o.chunks == chunks[1:] and [c.attempts for c in chunks[1:]] == [2, 1]


def test_window_pipelines_a_lanes_chunks_in_order():
    pipe = make(request_size=ONE_CHUNK, window=3)
    add(pipe, 0, 5)
    outs = send_all(pipe)
    assert [[seq_of(c) for c in o.chunks] for o in outs] == [[0], [1], [2]]


def test_request_size_limit():
    pipe = make(request_size=2500, window=1)
    for sl in range(4):
        add(pipe, sl, 1, records=10, size=100)  # ~1.2 KB chunks
    outs = send_all(pipe, mapping={sl: "b" for sl in range(4)})
    assert len(outs) == 1 and len(outs[0].chunks) == 2


def test_acks_complete_chunks_and_flush_target():
    pipe = make(request_size=ONE_CHUNK)
    add(pipe, 0, 2)
    target = pipe.last_serial
    (o1, o2) = send_all(pipe)
    assert not pipe.done_through(target)
    pipe.on_reply("b1", ok(o2, 2), 0.1)  # out of order: chunk 1 acked before chunk 0
    assert not pipe.done_through(target)
    pipe.on_reply("b1", ok(o1, 1), 0.1)
    assert pipe.done_through(target)
    assert pipe.pending_bytes == 0
    assert pipe.stats["records_acked"] == 20
    assert not pipe.lanes[(SID, 0)].chunks


def test_retriable_error_pauses_lane_until_drained_then_resends_same_bytes_in_order():
    pipe = make(request_size=ONE_CHUNK, window=3)
    chunks = add(pipe, 0, 3)
    original = [c.data for c in chunks]
    o1, o2, o3 = send_all(pipe)
    # chunk 0 throttled; chunks 1 and 2 are then refused with a gap by the broker
    pipe.on_reply("b1", {"id": 1, "ok": True, "results": [["throttled", "busy", True]]}, 0.0)
    assert send_all(pipe, now=1.0, first_id=10) == []  # paused: 1 and 2 still in flight
    pipe.on_reply("b1", {"id": 2, "ok": True, "results": [["sequence_gap", "gap", True]]}, 0.0)
    pipe.on_reply("b1", {"id": 3, "ok": True, "results": [["sequence_gap", "gap", True]]}, 0.0)
    assert send_all(pipe, now=0.001, first_id=10) == []  # backing off
    outs = send_all(pipe, now=1.0, first_id=10)
    assert [[c.data for c in o.chunks] for o in outs] == [[original[0]], [original[1]], [original[2]]]
    # the gaps were collateral: only chunk 0 counts a failed attempt
    assert [c.attempts for c in chunks] == [2, 1, 1]
    assert pipe.stats["retries"] == 3


def test_timeout_resends_and_late_reply_is_ignored():
    pipe = make(timeout_s=1.0)
    (c,) = add(pipe, 0, 1)
    (o,) = send_all(pipe, now=0.0)
    assert pipe.expire(0.5) == set()
    refresh = pipe.expire(1.0)
    assert refresh == {("s", SID)}  # a timeout asks for fresh metadata
    assert c.state == UNSENT
    (o2,) = send_all(pipe, now=5.0, first_id=7)
    assert o2.chunks[0].data == c.data
    assert pipe.on_reply("b1", ok(o, 1), 5.0) == set()  # late reply to the timed-out request
    assert c.state == IN_FLIGHT
    pipe.on_reply("b1", ok(o2, 7), 5.0)
    assert pipe.done_through(c.serial)


def test_a_stalled_request_asks_for_its_streams_owners_now_and_then():
    pipe = make(window=2, timeout_s=10.0)
    add(pipe, 0, 1)
    add(pipe, 2, 1)
    send_all(pipe)
    same = owners({0: "b1", 2: "b2"})
    assert pipe.probe_stalled(STALL_PROBE_S / 2, same) == set(), "a healthy wait is not probed"
    assert pipe.probe_stalled(STALL_PROBE_S, same) == {("s", SID)}
    assert pipe.probe_stalled(STALL_PROBE_S + STALL_PROBE_INTERVAL_S / 2, same) == set()
    assert pipe.probe_stalled(STALL_PROBE_S + STALL_PROBE_INTERVAL_S, same) == {("s", SID)}
    assert pipe.next_deadline(STALL_PROBE_S) == STALL_PROBE_S + 2 * STALL_PROBE_INTERVAL_S
    assert pipe.stats["requests_rerouted"] == 0 and len(pipe.in_flight["b1"]) == 1


def test_a_stalled_request_whose_owner_moved_goes_to_the_new_owner_at_once():
    pipe = make(request_size=ONE_CHUNK, window=2, timeout_s=10.0)
    first = add(pipe, 0, 2)
    add(pipe, 2, 1)
    send_all(pipe)                                  # b1: chunk 0 of streamlet 0; b2: streamlet 2
    send_all(pipe, now=0.9, first_id=5)             # b1: chunk 1, younger than the probe age
    moved = owners({0: "b9", 2: "b2"})              # a failover moved streamlet 0 to b9
    assert pipe.probe_stalled(0.5, moved) == set(), "not stalled yet: no verdict"
    pipe.probe_stalled(STALL_PROBE_S, moved)
    assert pipe.in_flight["b1"] == {}, "both requests to b1, the younger too"
    assert len(pipe.in_flight["b2"]) == 1, "b2 still owns streamlet 2: its request waits"
    assert pipe.stats["requests_rerouted"] == 2
    outs = send_all(pipe, now=STALL_PROBE_S + 1.0, mapping={0: "b9", 2: "b2"}, first_id=9)
    assert [(o.broker, [c.data for c in o.chunks]) for o in outs] == [("b9", [first[0].data]),
                                                                       ("b9", [first[1].data])]
    assert first[0].attempts == 2, "the same bytes: the new owner acks a duplicate once"


def test_not_owner_asks_for_metadata_and_goes_to_the_new_owner():
    pipe = make()
    add(pipe, 0, 1)
    send_all(pipe)
    refresh = pipe.on_reply("b1", {"id": 1, "ok": True, "results": [["not_owner", "moved", True]]}, 0.0)
    assert refresh == {("s", SID)}
    (o,) = send_all(pipe, now=1.0, mapping={0: "b9"}, first_id=4)
    assert o.broker == "b9"


def test_no_owner_known_waits_and_wants_refresh():
    pipe = make()
    add(pipe, 0, 1)
    assert pipe.build(0.0, owners({})) == []
    assert pipe.want_refresh == {("s", SID)}


def test_non_retriable_failure_is_reported_and_lane_takes_a_new_identity():
    pipe = make(request_size=ONE_CHUNK, window=3)
    chunks = add(pipe, 0, 3)
    o1, o2, o3 = send_all(pipe)
    pipe.on_reply("b1", {"id": 1, "ok": True, "results": [["record_too_large", "big", False]]}, 0.0)
    pipe.on_reply("b1", {"id": 2, "ok": True, "results": [["sequence_gap", "gap", True]]}, 0.0)
    pipe.on_reply("b1", {"id": 3, "ok": True, "results": [["sequence_gap", "gap", True]]}, 0.0)
    (failure,) = pipe.take_failures()
    assert (failure.stream, failure.streamlet, failure.error.code, failure.records) == ("s", 0, "record_too_large", 10)
    lane = pipe.lanes[(SID, 0)]
    assert lane.producer_id == PID + Q  # same slot (mod Q) so the group order is kept
    hdrs = [chunk.verify(c.data) for c in lane.chunks]
    assert [(h.producer_id, h.sequence) for h in hdrs] == [(PID + Q, 0), (PID + Q, 1)]
    assert lane.next_sequence == 2
    assert chunks[0].serial not in pipe.incomplete
    # new chunks continue the new sequence space
    (c4,) = add(pipe, 0, 1)
    assert chunk.read_header(c4.data)[4:6] == (PID + Q, 2)


def test_retries_are_bounded():
    pipe = make(retries=2)
    (c,) = add(pipe, 0, 1)
    now = 0.0
    for attempt in range(3):
        now += 10
        (o,) = send_all(pipe, now=now, first_id=attempt * 10)
        pipe.on_reply("b1", {"id": attempt * 10, "ok": True, "results": [["throttled", "busy", True]]}, now)
    (failure,) = pipe.take_failures()
    assert failure.error.code == "throttled"
    assert pipe.done_through(c.serial)


def test_unknown_stream_for_good_fails_every_chunk_of_the_stream():
    pipe = make(window=1)
    add(pipe, 0, 3)
    add(pipe, 2, 1)
    outs = send_all(pipe)
    o = next(o for o in outs if o.broker == "b1")
    pipe.on_reply("b1", {"id": o.req_id, "ok": True,
                         "results": [["unknown_stream", "deleted", False]] * len(o.chunks)}, 0.0)
    failures = pipe.take_failures()
    assert sum(f.records for f in failures) == 30
    assert SID in pipe.dead_streams


def test_whole_request_error_reply_fails_each_chunk():
    pipe = make()
    add(pipe, 0, 1)
    add(pipe, 1, 1)
    (o,) = send_all(pipe, mapping={0: "b", 1: "b"})
    pipe.on_reply("b", {"id": 1, "ok": False, "code": "not_ready", "message": "x", "retriable": True}, 0.0)
    assert all(c.state == UNSENT for c in o.chunks)


def test_malformed_reply_is_retried():
    pipe = make()
    add(pipe, 0, 1)
    (o,) = send_all(pipe)
    pipe.on_reply("b1", {"id": 1, "ok": True, "results": [["x"]]}, 0.0)
    assert o.chunks[0].state == UNSENT and not pipe.take_failures()


def test_foreign_chunks_keep_their_identity_and_duplicates_are_fine():
    pipe = make(window=2)
    data = chunk.encode(777, 4, SID, 1, [b"a", b"b"])
    c1 = pipe.add_foreign("s", data)
    c2 = pipe.add_foreign("s", data)
    assert c1.lane is c2.lane and c1.lane.producer_id == 777
    outs = send_all(pipe)
    assert [c.data for o in outs for c in o.chunks] == [data, data]
    for o in outs:
        pipe.on_reply("b1", ok(o, o.req_id), 0.0)
    assert pipe.done_through(c2.serial) and not pipe.lanes.get((777, SID, 1))


# --------------------------------------------------------------------------- simulation

class BrokerModel:
    """The broker's produce rules: per (pid, sid, sl) the last sequence stored."""

    def __init__(self):
        self.last = {}
        self.stored = {}  # (sid, sl) -> list of (pid, seq, data)

    def produce(self, data):
        h = chunk.verify(data)
        key = (h.producer_id, h.stream_id, h.streamlet)
        last = self.last.get(key, -1)
        if h.sequence <= last:
            return [0, 0, 0]
        if h.sequence != last + 1:
            return ["sequence_gap", "gap", True]
        self.last[key] = h.sequence
        self.stored.setdefault((h.stream_id, h.streamlet), []).append((h.producer_id, h.sequence, bytes(data[chunk.HEADER_SIZE:])))
        return [0, 0, 0]


@pytest.mark.parametrize("seed", range(12))
def test_simulated_losses_never_store_twice_nor_out_of_order(seed):
    rng = random.Random(seed)
    print("seed", seed)
    pipe = make(window=3, retries=1000, timeout_s=1.0)
    broker = BrokerModel()
    bodies = {sl: [] for sl in range(4)}
    mapping = {0: "b1", 1: "b1", 2: "b2", 3: "b2"}
    now = 0.0
    req_ids = iter(range(1, 10**9))
    pending = []  # (deliver_at, broker, reply)
    for step in range(3000):
        now += rng.choice([0.001, 0.01, 0.1])
        if step < 2000 and rng.random() < 0.3:
            sl = rng.randrange(4)
            (c,) = add(pipe, sl, 1, records=rng.randint(1, 5), size=rng.randint(1, 50))
            bodies[sl].append(c.data[chunk.HEADER_SIZE:])
        pipe.expire(now)
        for o in pipe.build(now, owners(mapping)):
            rid = next(req_ids)
            pipe.sent(o, rid, now)
            if rng.random() < 0.05:
                continue  # request lost
            results = []
            for c in o.chunks:
                r = rng.random()
                if r < 0.05:
                    results.append(["throttled", "busy", True])
                elif r < 0.08:
                    results.append(["not_owner", "moving", True])
                else:
                    results.append(broker.produce(c.data))
            if rng.random() < 0.05:
                continue  # reply lost (the chunks may be stored)
            pending.append((now + rng.choice([0.0, 0.005, 0.05, 1.5]), o.broker, {"id": rid, "ok": True, "results": results}))
        keep = []
        for at, b, reply in pending:
            if at <= now:
                pipe.on_reply(b, reply, now)
            else:
                keep.append((at, b, reply))
        pending = keep
        if step >= 2000 and not pipe.incomplete:
            break
    assert not pipe.incomplete, "every chunk ends acknowledged (no failure injected is permanent)"
    assert not pipe.take_failures()
    for sl in range(4):
        stored = broker.stored.get((SID, sl), [])
        assert [body for _, _, body in stored] == bodies[sl]  # each once, in order


def test_new_identity_keeps_the_group_slot_even_at_the_top_of_the_id_space():
    from kera.producer.pipeline import next_identity
    for pid in (0, 5, 2**64 - 1, 2**64 - 2, 2**63 + 7):
        for q in (1, 2, 3, 7):
            new = next_identity(pid, q)
            assert 0 <= new < 2**64 and new != pid
            assert new % q == pid % q


def test_broker_that_forgot_the_producer_gets_the_lane_under_a_new_identity():
    pipe = make(request_size=ONE_CHUNK, window=1, retries=20)
    c0, c1, c2 = add(pipe, 0, 3)
    (o,) = send_all(pipe)
    pipe.on_reply("b1", ok(o, 1), 0.0)
    now = 0.0
    for attempt in range(FRONT_GAP_ATTEMPTS_MAX):  # chunk 1 is the lane's front: a gap means lost broker state
        now += 10
        (o,) = send_all(pipe, now=now, first_id=10 + attempt)
        assert seq_of(o.chunks[0]) == 1
        pipe.on_reply("b1", {"id": 10 + attempt, "ok": True, "results": [["sequence_gap", "gap", True]]}, now)
    lane = pipe.lanes[(SID, 0)]
    assert lane.producer_id == PID + Q
    (o,) = send_all(pipe, now=now + 10, first_id=20)
    h = chunk.verify(o.chunks[0].data)
    assert (h.producer_id, h.sequence) == (PID + Q, 0) and o.chunks[0] is c1
    assert not pipe.take_failures()


def test_flush_error_names_stream_streamlet_and_totals():
    from kera.errors import KeraError, UnknownStream
    from kera.producer.pipeline import Failure
    from kera.producer.producer import failure_error
    err = failure_error([Failure("clicks", 2, UnknownStream("gone"), 10), Failure("clicks", 3, UnknownStream("gone"), 5)])
    assert isinstance(err, UnknownStream) and not err.retriable
    assert str(err) == "15 records failed: stream 'clicks' streamlet 2 (and 1 more streamlets): [unknown_stream] gone"
    assert len(err.failures) == 2
    odd = KeraError("x")
    odd.code = "weird_code"
    assert failure_error([Failure("s", 0, odd, 1)]).code == "weird_code"


# --------------------------------------------------------------------------- foreign chunks
# Chunks encoded by the caller with their own (producer id, sequence), as the Spark sink's write
# tasks send them: several identities may share a streamlet, none is ever re-identified.

def add_foreign(pipe, pid, sl, seq, body=b"x"):
    return pipe.add_foreign("s", chunk.encode(pid, seq, SID, sl, [body]))


@pytest.mark.parametrize("seed", range(8))
def test_foreign_chunks_of_two_producers_stored_once_in_order_despite_losses(seed):
    rng = random.Random(seed)
    print("seed", seed)
    pipe = make(window=3, retries=1000, timeout_s=1.0)
    broker = BrokerModel()
    want = {}
    for i in range(300):
        pid, sl = rng.choice([7, 8]), rng.randrange(3)
        seq = len(want.setdefault((pid, sl), []))
        body = b"%d-%d-%d" % (pid, sl, seq)
        want[(pid, sl)].append(body)
        add_foreign(pipe, pid, sl, seq, body)
    mapping, now, req_ids = {0: "b1", 1: "b1", 2: "b2"}, 0.0, iter(range(1, 10**9))
    for _ in range(100_000):
        if not pipe.incomplete:
            break
        now += rng.choice([0.001, 0.01, 0.1])
        pipe.expire(now)
        for o in pipe.build(now, owners(mapping)):
            rid = next(req_ids)
            pipe.sent(o, rid, now)
            lanes = {}   # one lane per streamlet per request, its chunks in sequence order
            for c in o.chunks:
                lanes.setdefault((c.lane.stream_id, c.lane.streamlet), []).append(c)
            assert all(len({c.lane for c in cs}) == 1 for cs in lanes.values())
            assert all([c.sequence for c in cs] == sorted(c.sequence for c in cs)
                       for cs in lanes.values())
            results = [["throttled", "busy", True] if rng.random() < 0.05 else broker.produce(c.data)
                       for c in o.chunks]
            if rng.random() < 0.9:  # else the reply is lost (its chunks may be stored)
                pipe.on_reply(o.broker, {"id": rid, "ok": True, "results": results}, now)
    assert not pipe.incomplete and not pipe.take_failures() and not pipe.lanes
    got = {}
    for (sid, sl), stored in broker.stored.items():
        for pid, seq, _ in stored:
            got.setdefault((pid, sl), []).append(b"%d-%d-%d" % (pid, sl, seq))
    assert got == want  # every chunk once, each identity's in sequence order


def test_foreign_chunks_of_two_producers_on_one_streamlet_never_share_a_request():
    pipe = make(window=4)
    add_foreign(pipe, 1, 0, 3)   # a later part of producer 1's sequence
    add_foreign(pipe, 2, 0, 0)
    outs = send_all(pipe)
    assert sorted(len(o.chunks) for o in outs) == [1, 1]


def test_refused_foreign_chunk_fails_with_its_followers_and_keeps_its_identity():
    pipe = make(request_size=ONE_CHUNK, window=1)
    first, second = add_foreign(pipe, 9, 0, 0), add_foreign(pipe, 9, 0, 1)
    (o,) = send_all(pipe)
    pipe.on_reply("b1", {"id": 1, "ok": True, "results": [["corrupt_chunk", "bad", False]]}, 0.0)
    failures = pipe.take_failures()
    assert [f.error.code for f in failures] == ["corrupt_chunk", "internal"]
    assert pipe.done_through(second.serial) and first.lane.producer_id == 9


def test_stream_its_broker_does_not_know_yet_is_retried_not_failed():
    """A just-created stream: its broker answers unknown_stream (retriable) until it applied
    the creation. The chunk waits, the stream's metadata is refreshed, the chunk is resent."""
    pipe = make(window=1, retries=30)
    c = add_foreign(pipe, 9, 0, 0)
    now = 0.0
    for attempt in range(10):
        (o,) = send_all(pipe, now=now, first_id=attempt + 1)
        refresh = pipe.on_reply("b1", {"id": attempt + 1, "ok": True, "results": [
            ["unknown_stream", f"unknown stream id {SID}", True]]}, now)
        assert refresh == {("s", SID)}
        now += 10
    (o,) = send_all(pipe, now=now, first_id=100)
    pipe.on_reply("b1", ok(o, 100), now)
    assert pipe.done_through(c.serial) and not pipe.take_failures()
