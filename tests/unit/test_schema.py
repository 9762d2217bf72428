"""The wire schema's parsers: each takes what is valid and refuses, with BadRequest naming the
field, wrong types, huge numbers and huge counts."""

import pytest

from kera import errors

from kera.codec import schema

from kera.codec import wire
from kera.errors import BadRequest

REGISTER = {"kind": "backup", "address": "127.0.0.1:7001", "node": "n1"}
HEARTBEAT = {"kind": "broker", "daemon_id": 3, "metadata_version": 9,
             "stats": {"memory_bytes": 10, "replicas": 2}, "vsegs": [[0, 1, [2, 3]]]}
DESCRIPTOR = {"name": "s", "id": 4, "streamlets": 2, "active_groups": 1, "replication": 2,
              "placement": [0, None], "brokers": {"0": "127.0.0.1:9000"}, "version": 3,
              "ready": True}


@pytest.mark.parametrize("good", ["127.0.0.1:1", "[::1]:65535", "localhost:7000",
                                  "a-b.example.com:80", "HOST9:9"])
def test_addresses_zmq_takes_are_valid(good):
    assert schema.valid_address(good)


@pytest.mark.parametrize("bad", ["bad!host:1", "host", "host:", ":80", "host:0", "host:65536",
                                 "host:1x", "a b:1", "-a:1", "a-:1", "a..b:1", "a_b:1",
                                 "1.2.3.999:1", "[1.2.3.4]:1", "[host]:1", "::1:80",
                                 "x" * 254 + ":1", "é.com:1", "host:١"])
def test_addresses_zmq_rejects_are_refused(bad):
    assert not schema.valid_address(bad)
    with pytest.raises(BadRequest, match="'address'"):
        schema.register({**REGISTER, "address": bad})


def test_register_parses_and_refuses():
    assert schema.register(REGISTER) == schema.Register("backup", "127.0.0.1:7001", "n1", None)
    assert schema.register({**REGISTER, "daemon_id": 5}).daemon_id == 5
    for field, value in [("kind", "spy"), ("kind", 1), ("node", ""), ("node", "n" * 300),
                         ("daemon_id", 2**31), ("daemon_id", -1), ("daemon_id", True),
                         ("daemon_id", "1"), ("address", ["127.0.0.1:1"])]:
        with pytest.raises(BadRequest, match=field):
            schema.register({**REGISTER, field: value})
    with pytest.raises(BadRequest, match="not a map"):
        schema.register([REGISTER])


def test_register_reply():
    assert schema.register_reply({"daemon_id": 2, "heartbeat_interval_ms": 100}) == \
        schema.RegisterReply(2, 100, None, None)
    assert schema.register_reply({"daemon_id": 2, "token": "ab", "cluster_id": "cd"}) == \
        schema.RegisterReply(2, None, "ab", "cd")
    for bad in [{}, {"daemon_id": -1}, {"daemon_id": 2**40}, {"daemon_id": 1.0},
                {"daemon_id": 1, "token": 5}, {"daemon_id": 1, "cluster_id": "x" * 65},
                {"daemon_id": 1, "heartbeat_interval_ms": 0},
                {"daemon_id": 1, "heartbeat_interval_ms": 10**9}]:
        with pytest.raises(BadRequest):
            schema.register_reply(bad)


def test_heartbeat_parses_and_keeps_only_the_numeric_stats_it_reads():
    hb = schema.heartbeat({**HEARTBEAT, "stats": {"memory_bytes": 10, "replicas": "2",
                                                  "junk": [{}] * 1000, "unflushed_bytes": True}})
    assert hb.stats == {"memory_bytes": 10}
    assert hb.vsegs == [(0, 1, [2, 3])] and hb.metadata_version == 9
    assert schema.heartbeat({**HEARTBEAT, "stats": {"replicas": 2**70}}).stats == {}


@pytest.mark.parametrize("field,value,match", [
    ("daemon_id", 2**32, "daemon_id"), ("daemon_id", "3", "daemon_id"),
    ("metadata_version", 2**62 * 4, "metadata_version"), ("metadata_version", -1, "metadata_version"),
    ("metadata_version", None, "metadata_version"),
    ("stats", [], "stats"), ("stats", {f"k{i}": 0 for i in range(1001)}, "stats"),
    ("vsegs", [[0, 1, [2]]] * 4097, "vsegs"), ("vsegs", [[0, 1]], "vsegs"),
    ("vsegs", [[0, 2**64, []]], "vseg"), ("vsegs", [[0, 1, list(range(8))]], "vsegs"),
    ("vsegs", [[0, 1, [2**33]]], "backup id"), ("vsegs", "x", "vsegs"),
])
def test_heartbeat_refuses_wrong_types_huge_numbers_and_counts(field, value, match):
    with pytest.raises(BadRequest, match=match):
        schema.heartbeat({**HEARTBEAT, field: value})


def test_only_brokers_report_vsegs():
    with pytest.raises(BadRequest, match="only brokers"):
        schema.heartbeat({**HEARTBEAT, "kind": "backup"})


def test_stream_descriptor_parses_and_refuses():
    info = schema.stream_descriptor(DESCRIPTOR)
    assert info.placement == (0, None) and info.brokers == {0: "127.0.0.1:9000"}
    assert info.address_of(0) == "127.0.0.1:9000" and info.address_of(1) is None
    for field, value in [("streamlets", 0), ("streamlets", 2**21), ("placement", [0]),
                         ("placement", [0, "1"]), ("placement", [0, 2**40]),
                         ("brokers", {"x": "127.0.0.1:1"}), ("brokers", {"0": "bad!host:1"}),
                         ("brokers", {"0": 7}), ("id", 2**64), ("id", "4"), ("version", -1),
                         ("replication", 10**6), ("ready", 1), ("name", 5)]:
        with pytest.raises(BadRequest):
            schema.stream_descriptor({**DESCRIPTOR, field: value})


def test_error_reply_is_typed_and_never_crashes_the_client():
    err = schema.error_reply({"ok": False, "code": "not_owner", "message": "moved",
                              "retriable": True})
    assert isinstance(err, errors.NotOwner) and err.retriable and err.refresh_metadata
    for header in [{"ok": False}, {"ok": False, "code": 5, "message": ["x"], "retriable": "yes"},
                   {"ok": False, "code": "x" * 1000, "message": "m"}]:
        err = schema.error_reply(header)
        assert type(err) is errors.KeraError and err.code == "internal" and not err.retriable
    with pytest.raises(errors.Throttled):
        wire.raise_for_reply({"ok": False, "code": "throttled", "message": "slow down",
                              "retriable": True})


def test_error_classes_carry_their_behaviour():
    refresh = {cls.code for cls in errors._BY_CODE.values() if cls.refresh_metadata}
    assert refresh == {"not_owner", "unknown_stream", "not_ready", "timeout", "unreachable",
                       "fenced"}   # another coordinator took over: ask again
    assert errors.PeerUnreachable.retriable and not errors.BadRequest.refresh_metadata


def test_produce_result_is_a_position_or_an_error_never_a_false_ack():
    assert schema.produce_result([1, 2, 3]) == (1, 2, 3)
    assert schema.produce_result([1, 2, 3, 7]) == (1, 2, 3, 7)    # with the record number
    assert schema.produce_result([]) is None      # stored earlier, position not looked up
    err = schema.produce_result(["sequence_gap", "resend 4", True])
    assert isinstance(err, errors.SequenceGap) and err.retriable
    for bad in [[1, 2], [1, 2, True], [1, 2, -1], [1, 2, 2**64], [1.0, 2, 3], "x", None,
                [1, 2, 3, 4, 5], [1, 2, 3, -4], ["code", "m", True, 4], [5, "m", True]]:
        err = schema.produce_result(bad)
        assert isinstance(err, errors.KeraError) and err.retriable, bad


def test_fetch_result_refuses_wrong_types_and_huge_counts():
    err, n, groups = schema.fetch_result([None, 2, [[0, 0, 0, 5, False]]], 2)
    assert err is None and n == 2 and groups == [[0, 0, 0, 5, False]]
    err, n, _ = schema.fetch_result([["offset_out_of_range", "gone", False], 0, []], 0)
    assert isinstance(err, errors.OffsetOutOfRange) and n == 0
    for bad in [[None, 3, []], [None, -1, []], [None, True, []], [None, 2**70, []], [None, 1],
                "x", None]:
        with pytest.raises(BadRequest):
            schema.fetch_result(bad, 2)
    assert type(schema.fetch_result([[1, 2, 3], 0, []], 0)[0]) is errors.KeraError
