"""Delivery futures settled from the Pipeline's outcomes (sans-IO: no sockets or threads):
a record's offset is its chunk's base offset plus its index; a chunk that fails for good
fails its futures with the error; callbacks get (err, metadata) and may not break settling."""

import pytest

from kera.codec import chunk
from kera.errors import BadRequest, Timeout
from kera.producer import delivery
from kera.producer.delivery import DeliveryFuture, RecordMetadata, on_delivery_callback
from kera.producer.pipeline import Pipeline


def _pipe():
    return Pipeline(request_size_bytes=1 << 20, in_flight_per_broker=1, retries_max=0,
                    request_timeout_s=1.0)


def _queue(pipe, sl, futures):
    lane = pipe.own_lane("s", 5, sl, 1000, 1)
    data = chunk.encode(lane.producer_id, lane.next_sequence, 5, sl, [b"v"] * 3)
    pipe.add(lane, data, lane.next_sequence, 3, futures)


def test_acked_chunk_settles_each_record_at_base_offset_plus_index():
    pipe = _pipe()
    futures = [DeliveryFuture() for _ in range(3)]
    calls = []
    futures[2].add_done_callback(on_delivery_callback(lambda err, md: calls.append((err, md))))
    _queue(pipe, 1, [(i, 1, f) for i, f in enumerate(futures)])
    out, = pipe.build(0.0, lambda sid, sl: "b1")
    pipe.sent(out, 7, 0.0)
    pipe.on_reply("b1", {"id": 7, "ok": True, "results": [[4, 0, 40]]}, 0.0)
    assert not futures[0].done()  # settled only by the IO thread, outside the lock
    delivery.settle(pipe.settled)
    assert [f.result(0) for f in futures] == [RecordMetadata("s", 1, 4, 40 + i) for i in range(3)]
    assert calls == [(None, RecordMetadata("s", 1, 4, 42))]


def test_a_chunk_acknowledged_without_a_position_settles_stored_with_no_offset():
    pipe = _pipe()
    futures = [DeliveryFuture() for _ in range(3)]
    _queue(pipe, 1, [(i, 1, f) for i, f in enumerate(futures)])
    out, = pipe.build(0.0, lambda sid, sl: "b1")
    pipe.sent(out, 7, 0.0)
    pipe.on_reply("b1", {"id": 7, "ok": True, "results": [[]]}, 0.0)   # a retry's answer
    delivery.settle(pipe.settled)
    assert [f.result(0) for f in futures] == [RecordMetadata("s", 1, None, None)] * 3
    assert pipe.stats["chunks_acked"] == 1 and not pipe.incomplete


def test_refused_chunk_fails_its_futures_and_a_raising_callback_is_contained():
    pipe = _pipe()
    fut = DeliveryFuture()
    fut.add_done_callback(lambda f: 1 / 0)
    _queue(pipe, 0, [(-1, 3, fut)])
    out, = pipe.build(0.0, lambda sid, sl: "b1")
    pipe.sent(out, 1, 0.0)
    pipe.on_reply("b1", {"id": 1, "ok": True, "results": [["bad_request", "no", False]]}, 0.0)
    delivery.settle(pipe.settled)
    assert isinstance(fut.exception(0), BadRequest)


def test_result_times_out_with_a_typed_error_while_unsettled():
    with pytest.raises(Timeout, match="flush"):
        DeliveryFuture().result(0.01)
