"""Metadata replies at the limits the coordinator admits are paginated and every page stays
under the header limit; deregister and member expiry forget dead daemons that hold nothing."""

import pytest

from kera.codec import wire
from kera.coordinator import core as core_module
from kera.coordinator import validate
from kera.coordinator.core import MEMBER_EXPIRY_S, Coordinator
from kera.coordinator.ops import REPLICAS_PAGE_MAX
from kera.coordinator.replica_map import REPLICA_ENTRIES_PER_BROKER_MAX
from kera.errors import BadRequest

LONG_HOST = ".".join(["a" * 63] * 3 + ["b" * 61])   # 253 characters, the DNS maximum


def register_many(c: Coordinator, kind: str, count: int, now: float = 0.0) -> None:
    for i in range(count):
        c.handle("register", {"kind": kind, "address": f"{LONG_HOST}:{10000 + i % 50000}",
                              "node": f"node-{i:0200d}"}, now)


def reply_size(fields: dict) -> int:
    return len(wire.ok_reply(2**63 - 1, fields))


def all_pages(c: Coordinator, op: str, key: str, fields: dict | None = None) -> tuple[list, int]:
    items, largest, after = [], 0, None
    for _ in range(100_000):
        reply = c.handle(op, {**(fields or {}), **({} if after is None else {"after": after})}, 1.0)
        largest = max(largest, reply_size(reply))
        items += reply[key]
        after = reply.get("next")
        if after is None:
            return items, largest
    raise AssertionError("the cursor never ended")


def test_list_streams_at_streams_max_is_paginated_under_the_header_limit():
    c = Coordinator(0.0)
    register_many(c, "broker", 100)
    per_stream = validate.STREAMLETS_TOTAL_MAX // validate.STREAMS_MAX
    for i in range(validate.STREAMS_MAX):
        name = f"{i:06d}" + "n" * (validate.NAME_CHARS_MAX - 6)
        c.handle("create_stream", {"name": name, "streamlets": per_stream, "replication": 1}, 0.0)
    streams, largest = all_pages(c, "list_streams", "streams")
    print(f"list_streams at {validate.STREAMS_MAX} streams / {validate.STREAMLETS_TOTAL_MAX} "
          f"streamlets: {len(streams)} descriptors, largest page {largest} bytes")
    assert [s["name"] for s in streams] == sorted(c.streams)
    assert streams == c.list_streams()
    assert largest < wire.MAX_HEADER_BYTES
    # Unpaginated, the same listing would not fit in one reply.
    assert reply_size({"streams": c.list_streams()}) > wire.MAX_HEADER_BYTES


def test_cluster_reply_at_daemons_max_fits_under_the_header_limit():
    c = Coordinator(0.0)
    for kind in ("broker", "backup"):
        for i in range(validate.DAEMONS_MAX):
            c.handle("register", {"kind": kind, "address": f"{LONG_HOST}:{10000 + i}",
                                  "node": "n" * validate.NODE_CHARS_MAX}, 0.0)
    size = reply_size(c.handle("cluster", {}, 0.0))
    print(f"cluster reply at {validate.DAEMONS_MAX} brokers and backups: {size} bytes")
    assert size < wire.MAX_HEADER_BYTES
    with pytest.raises(Exception, match="registered already"):
        c.handle("register", {"kind": "broker", "address": "127.0.0.1:1", "node": "n"}, 0.0)


def test_largest_single_descriptor_fits():
    c = Coordinator(0.0)
    register_many(c, "broker", min(validate.STREAMLETS_MAX, validate.DAEMONS_MAX))
    c.handle("create_stream", {"name": "x" * validate.NAME_CHARS_MAX,
                               "streamlets": validate.STREAMLETS_MAX, "replication": 1}, 0.0)
    reply = c.handle("list_streams", {}, 0.0)
    print(f"one stream of {validate.STREAMLETS_MAX} streamlets on as many brokers: "
          f"{reply_size(reply)} bytes")
    assert len(reply["streams"]) == 1 and "next" not in reply
    assert reply_size(reply) < wire.MAX_HEADER_BYTES


def test_list_streams_limit_and_cursor():
    c = Coordinator(0.0)
    register_many(c, "broker", 1)
    for name in ("d", "a", "c", "b", "e"):
        c.handle("create_stream", {"name": name, "streamlets": 1, "replication": 1}, 0.0)
    first = c.handle("list_streams", {"limit": 2}, 0.0)
    assert [s["name"] for s in first["streams"]] == ["a", "b"] and first["next"] == "b"
    rest = c.handle("list_streams", {"after": "b", "limit": 3}, 0.0)
    assert [s["name"] for s in rest["streams"]] == ["c", "d", "e"] and "next" not in rest
    assert c.handle("list_streams", {"after": "zz"}, 0.0) == {"streams": []}
    with pytest.raises(BadRequest):
        c.handle("list_streams", {"limit": 0}, 0.0)


def test_replicas_pages_walk_every_entry_under_the_header_limit():
    c = Coordinator(0.0)
    register_many(c, "broker", 2)
    backups = list(range(2**32 - validate.VSEG_BACKUPS_MAX, 2**32))   # the widest entries
    for b in range(2):
        c.replica_map.report(b, [[2**32 - 1, 2**64 - 1 - n, backups]
                              for n in range(REPLICA_ENTRIES_PER_BROKER_MAX)])
    entries, largest = all_pages(c, "replicas", "replicas")
    print(f"replicas of 2 brokers at the map limit: {len(entries)} entries, "
          f"largest page {largest} bytes")
    assert entries == c.replica_map.entries()
    assert len(entries) == 2 * REPLICA_ENTRIES_PER_BROKER_MAX
    assert largest < wire.MAX_HEADER_BYTES
    one, _ = all_pages(c, "replicas", "replicas", {"broker_id": 1})
    assert one == c.replica_map.entries(broker_id=1)
    page = c.handle("replicas", {"limit": 3, "after": [0, 2**32 - 1, 0]}, 0.0)
    assert len(page["replicas"]) == 3 and page["next"] == page["replicas"][-1][:3]
    assert len(c.handle("replicas", {}, 0.0)["replicas"]) == REPLICAS_PAGE_MAX


def test_deregister_refuses_live_and_owning_daemons_and_forgets_a_dead_one():
    c = Coordinator(0.0)
    register_many(c, "broker", 2)
    register_many(c, "backup", 1)
    c.handle("create_stream", {"name": "s", "streamlets": 1, "replication": 1}, 0.0)
    owner = c.streams["s"].placement[0]
    idle = 1 - owner
    c.replica_map.report(idle, [[0, 1, [0]]])
    with pytest.raises(BadRequest, match="alive"):
        c.handle("deregister", {"kind": "broker", "daemon_id": idle}, 0.0)
    c.tick(100.0)    # everyone silent: declared dead (R=1 streamlets stay with their broker)
    with pytest.raises(BadRequest, match="owns streamlets of 1 streams \\(s\\)"):
        c.handle("deregister", {"kind": "broker", "daemon_id": owner}, 100.0)
    with pytest.raises(BadRequest, match="no broker has id 9"):
        c.handle("deregister", {"kind": "broker", "daemon_id": 9}, 100.0)
    version = c.version
    c.handle("deregister", {"kind": "broker", "daemon_id": idle}, 100.0)
    c.handle("deregister", {"kind": "backup", "daemon_id": 0}, 100.0)
    assert idle not in c.members["broker"] and not c.members["backup"]
    assert idle not in c.replica_map.tables and c.version > version
    # Its id is never handed out again.
    c.handle("register", {"kind": "broker", "address": "127.0.0.1:1", "node": "n"}, 100.0)
    assert max(c.members["broker"]) == 2
    assert Coordinator(0.0, state=c.to_state()).members["broker"].keys() == {owner, 2}


def test_dead_members_holding_nothing_expire():
    c = Coordinator(0.0)
    register_many(c, "broker", 3)
    register_many(c, "backup", 2)
    c.handle("create_stream", {"name": "s", "streamlets": 1, "replication": 1}, 0.0)
    owner = c.streams["s"].placement[0]
    holder = next(b for b in range(3) if b != owner)
    c.replica_map.report(holder, [[0, 1, [1]]])          # backup 1 is named, broker holder has entries
    c.tick(30.0)     # everyone silent: declared once past the isolation hold (core.tick)
    assert not c.live("broker")
    assert c.tick(10.0 + MEMBER_EXPIRY_S - 100) == [] and len(c.members["broker"]) == 3
    c.tick(20.0 + MEMBER_EXPIRY_S)
    assert set(c.members["broker"]) == {owner, holder}   # the one holding nothing is forgotten
    assert set(c.members["backup"]) == {1}


def test_a_live_member_never_expires():
    c = Coordinator(0.0)
    register_many(c, "broker", 1)
    for step in range(1, 5):
        now = step * MEMBER_EXPIRY_S
        c.handle("heartbeat", {"kind": "broker", "daemon_id": 0, "metadata_version": 0,
                               "token": c.members["broker"][0].token}, now)
        c.tick(now)
    assert 0 in c.members["broker"]


def test_expiry_is_checked_at_most_every_check_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(Coordinator, "expire_members", lambda self, now: calls.append(now))
    c = Coordinator(0.0)
    for step in range(100):
        c.tick(step * 1.0)
    assert len(calls) == int(99 // core_module.MEMBER_EXPIRY_CHECK_S)


def test_broker_streams_at_the_limits_is_paginated_under_the_header_limit():
    """Every stream with a streamlet on broker 0, each placed on many brokers (long addresses
    in every descriptor): pages under the limit, together the whole set, tombstones on each."""
    c = Coordinator(0.0)
    register_many(c, "broker", 100)
    per_stream = validate.STREAMLETS_TOTAL_MAX // validate.STREAMS_MAX
    for i in range(validate.STREAMS_MAX):
        c.rotation = 0          # every stream starts its placement on broker 0
        c.handle("create_stream", {"name": f"{i:06d}" + "n" * (validate.NAME_CHARS_MAX - 6),
                                   "streamlets": per_stream, "replication": 1}, 0.0)
    c.handle("delete_stream", {"name": sorted(c.streams)[-1]}, 0.0)
    pages, after = [], None
    for _ in range(validate.STREAMS_MAX):
        reply = c.handle("broker_streams", {"broker_id": 0, **({} if after is None else
                                                               {"after": after})}, 0.0)
        pages.append(reply)
        after = reply.get("next")
        if after is None:
            break
    largest = max(reply_size(p) for p in pages)
    print(f"broker_streams at {validate.STREAMS_MAX} streams: {len(pages)} pages, "
          f"largest {largest} bytes")
    assert largest < wire.MAX_HEADER_BYTES and len(pages) > 1
    assert [d["name"] for p in pages for d in p["streams"]] == sorted(c.streams)
    assert all(p["deleted"] == pages[0]["deleted"] != [] for p in pages)
