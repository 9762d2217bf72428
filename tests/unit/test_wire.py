import msgpack
import pytest

from kera import errors

from kera.codec import wire
from kera.errors import BadRequest


def test_request_and_reply_round_trip():
    header = wire.unpack_header(wire.request("fetch", 42, {"reads": [[1, 2]]}))
    assert header == {"v": wire.PROTOCOL_VERSION, "op": "fetch", "id": 42, "reads": [[1, 2]]}
    ok = wire.unpack_header(wire.ok_reply(42, {"n": 1}))
    assert wire.raise_for_reply(ok)["n"] == 1


@pytest.mark.parametrize("cls", [errors.UnknownStream, errors.NotOwner, errors.Throttled, errors.CorruptChunk])
def test_error_reply_becomes_the_same_exception(cls):
    reply = wire.unpack_header(wire.error_reply(7, cls("boom")))
    with pytest.raises(cls) as info:
        wire.raise_for_reply(reply)
    assert str(info.value) == "boom"
    assert info.value.retriable == cls.retriable


def test_unknown_error_code_keeps_its_code():
    reply = {"ok": False, "code": "weird", "message": "m", "retriable": True}
    with pytest.raises(errors.KeraError) as info:
        wire.raise_for_reply(reply)
    assert info.value.code == "weird" and info.value.retriable


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb(5), b"\xde\xff\xff"])
def test_garbage_headers_are_bad_requests(frame):
    with pytest.raises(errors.BadRequest):
        wire.unpack_header(frame)


def test_fields_validate_types_and_ranges():
    f = wire.Fields({"a": 5, "b": "x", "c": True, "d": [1, 2], "e": -1})
    assert f.int("a") == 5 and f.str("b") == "x" and f.bool("c") is True
    assert f.int("missing", default=9) == 9
    for call in (lambda: f.int("b"), lambda: f.int("c"), lambda: f.int("e"), lambda: f.str("a"),
                 lambda: f.int("missing"), lambda: f.list("d", max_len=1), lambda: f.int("a", hi=4)):
        with pytest.raises(errors.BadRequest):
            call()
    assert wire.int_list([1, 2], "x", length=2) == [1, 2]
    with pytest.raises(errors.BadRequest):
        wire.int_list([1, "2"], "x")


def test_fields_may_not_overwrite_the_envelope():
    for name in ("v", "op", "id", "ok"):
        with pytest.raises(ValueError):
            wire.request("x", 1, {name: 2})
        with pytest.raises(ValueError):
            wire.ok_reply(1, {name: 2})


def test_header_length_limits_per_string_array_and_map():
    ok = wire.pack({"s": "x" * wire.HEADER_STR_LEN_MAX, "a": [0] * 1000})
    assert wire.unpack_header(ok)["a"] == [0] * 1000
    for huge in [{"s": "x" * (wire.HEADER_STR_LEN_MAX + 1)},
                 {"a": [0] * (wire.HEADER_ARRAY_LEN_MAX + 1)},
                 {"m": {i: 0 for i in range(wire.HEADER_MAP_LEN_MAX + 1)}}]:
        with pytest.raises(BadRequest, match="not valid msgpack"):
            wire.unpack_header(wire.pack(huge))


def test_header_container_budget_counts_every_nesting_level():
    nested = wire.pack({"stats": {"a": [{}] * 60_000, "b": [[]] * 60_000}})
    with pytest.raises(BadRequest, match="more than 100000 maps and arrays"):
        wire.unpack_header(nested, wire.REQUEST_CONTAINERS_MAX)
    assert len(wire.unpack_header(nested)["stats"]["a"]) == 60_000   # a reply may hold more


@pytest.mark.parametrize("budget", [8, 20, 100])
def test_header_container_budget_holds_for_frames_shorter_and_longer_than_it(budget):
    # A frame no longer than its budget is decoded without counting (each container takes a
    # byte); the bound must hold the same on both sides of that length.
    for inner in range(budget + 3):
        header = {"a": [[]] * inner}                      # inner + 2 maps and arrays
        frame = wire.pack(header)
        if inner + 2 <= budget:
            assert wire.unpack_header(frame, budget) == header
        else:
            with pytest.raises(BadRequest, match=f"more than {budget} maps and arrays"):
                wire.unpack_header(frame, budget)


def test_every_bound_is_consistent():
    assert wire.MAX_HEADER_BYTES < wire.MAX_FRAME_BYTES <= wire.MESSAGE_BYTES_MAX
    assert wire.REQUEST_CONTAINERS_MAX <= wire.REPLY_CONTAINERS_MAX
