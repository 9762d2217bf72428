"""A Kafka reply sent by reference (issue 35): encode_parts gives the same bytes as
encode_response, keeping a Fetch's large records as the very object, and the connection's
Outbox hands them out in order across partial sends."""

from __future__ import annotations

from kera.broker.kafka.connection import Outbox
from kera.broker.kafka.messages import BY_REFERENCE_BYTES, encode_parts, encode_response, response

FETCH_KEY, FETCH_VERSION = 1, 12


def _fetch_entity(records: list[bytes]):
    parts = [{"partition_index": i, "error_code": 0, "high_watermark": 0,
              "last_stable_offset": 0, "log_start_offset": 0, "aborted_transactions": None,
              "preferred_read_replica": -1, "records": r} for i, r in enumerate(records)]
    return response(FETCH_KEY, FETCH_VERSION, {"responses": [{"topic": "t", "partitions": parts}],
                                               "session_id": 0, "error_code": 0})


def test_encode_parts_is_the_response_with_large_records_by_reference():
    big = bytes(range(256)) * (BY_REFERENCE_BYTES // 256 + 1)
    small = b"s" * 100
    entity = _fetch_entity([big, small, big])
    parts = encode_parts(7, entity)
    assert b"".join(parts) == encode_response(7, entity)
    assert sum(p is big for p in parts) == 2          # not copied
    assert not any(p is small for p in parts)         # copied into the reply's own buffer


def test_outbox_sends_every_byte_in_order_across_partial_sends():
    out = Outbox()
    out.add([b"abc", b"", bytearray(b"defgh")])
    out.add(b"ij")
    out.add(b"")                                      # a silent reply: nothing
    assert len(out) == 10
    sent = bytearray()
    for n in (2, 1, 4, 3):                            # what a non-blocking socket took each time
        sent += b"".join(bytes(b) for b in out.head(64))[:n]
        out.sent(n)
    assert bytes(sent) == b"abcdefghij"
    assert len(out) == 0 and not out
    assert out.head(1) == []
