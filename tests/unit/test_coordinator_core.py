"""The coordinator's state machine, driven directly with an injected clock."""

from collections import Counter

import pytest

from kera import config
from kera.coordinator.core import Coordinator
from kera.coordinator.validate import StreamSpec
from kera.errors import BadRequest, NotReady, StreamExists, UnknownStream

INTERVAL_S = 0.1
MISSED = 20
TOKEN = "0123456789abcdef0123456789abcdef"   # every incarnation's token (a fixed source)
DEAD_AFTER_S = INTERVAL_S * MISSED


def make(now=0.0, **kw) -> Coordinator:
    kw.setdefault("token_source", lambda: TOKEN)
    return Coordinator(now, heartbeat_interval_s=INTERVAL_S, heartbeat_missed_max=MISSED, **kw)


def join(c: Coordinator, kind: str, n: int, now=0.0) -> list[int]:
    return [c.handle("register", {"kind": kind, "address": f"127.0.0.1:{9000 + i}",
                                  "node": f"{kind}-node-{i}"}, now)["daemon_id"] for i in range(n)]


def create(c: Coordinator, name: str, now=0.0, **fields) -> dict:
    return c.handle("create_stream", {"name": name, **fields}, now)["stream"]


def applied_all(c: Coordinator, now=0.0):
    for b in c.members["broker"]:
        c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": b, "metadata_version": c.version}, now)


# ---------------------------------------------------------------------- membership

def test_register_assigns_distinct_ids_per_kind_and_reports_interval():
    c = make()
    assert join(c, "broker", 3) == [0, 1, 2]
    assert join(c, "backup", 2) == [0, 1]
    reply = c.handle("register", {"kind": "broker", "address": "h:1", "node": "n"}, 0.0)
    assert reply == {"daemon_id": 3, "heartbeat_interval_ms": 100, "token": TOKEN,
                     "cluster_id": TOKEN}
    cluster = c.handle("cluster", {}, 0.0)
    assert [m["id"] for m in cluster["brokers"]] == [0, 1, 2, 3]
    assert cluster["backups"][1] == {"id": 1, "address": "127.0.0.1:9001",
                                     "node": "backup-node-1", "alive": True,
                                     "registered_version": 5}


def test_reregister_keeps_identity_and_new_address():
    c = make()
    join(c, "broker", 2)
    reply = c.handle("register", {"kind": "broker", "address": "10.0.0.9:7001", "node": "x",
                                  "daemon_id": 1, "token": TOKEN}, 1.0)
    assert reply["daemon_id"] == 1
    brokers = c.cluster()["brokers"]
    assert len(brokers) == 2 and brokers[1]["address"] == "10.0.0.9:7001"
    assert brokers[1]["registered_version"] == c.version > brokers[0]["registered_version"]
    # A chosen id above the counter moves it, so a later anonymous register never collides.
    assert c.handle("register", {"kind": "broker", "address": "h:1", "node": "n", "daemon_id": 7}, 1.0)["daemon_id"] == 7
    assert c.handle("register", {"kind": "broker", "address": "h:2", "node": "n"}, 1.0)["daemon_id"] == 8


def test_a_coordinator_hearing_no_daemon_at_all_suspects_itself_before_declaring_them_dead():
    from kera.coordinator.liveness import ISOLATION_HOLD_DEAD_WINDOWS
    c = make()
    join(c, "broker", 2)
    join(c, "backup", 2)
    hold_s = DEAD_AFTER_S * ISOLATION_HOLD_DEAD_WINDOWS
    assert c.tick(DEAD_AFTER_S + 0.01) == [] and c.death_watch.isolation_suspected, "all four silent: held"

    def beat(kind, i, now):
        c.handle("heartbeat", {"token": TOKEN, "kind": kind, "daemon_id": i, "metadata_version": 0}, now)

    for b in (0, 1):   # heard again (the partition healed): nothing was declared
        beat("broker", b, 3.0)
    assert c.tick(3.0) == [] and not c.death_watch.isolation_suspected, \
        "the backups' connections may still be backing off: they get the hold again"
    beat("backup", 0, 3.0 + hold_s)        # its retransmission got through in time
    for b in (0, 1):
        beat("broker", b, 3.0 + hold_s)
    assert c.tick(3.0 + hold_s) == []
    dead = c.tick(3.0 + hold_s + 0.01)
    assert [(m.kind, m.id) for m in dead] == [("backup", 1)], "silent past the second hold"
    assert not c.death_watch.isolation_suspected, "one of four silent is an ordinary failure"
    c3 = make()   # heartbeats are staggered: the daemons cross the dead window in turn
    join(c3, "broker", 2)
    join(c3, "backup", 1, now=INTERVAL_S)
    assert c3.tick(DEAD_AFTER_S + 0.01) == [] and c3.death_watch.isolation_suspected, \
        "two past the window, the third about to be, none heard lately: held"
    c2 = make()
    join(c2, "broker", 3)
    assert c2.tick(hold_s) == [], "still held within the bound"
    assert len(c2.tick(hold_s + 0.01)) == 3, "a silence past the bound is declared after all"


def test_dead_after_missed_heartbeats_and_alive_again():
    c = make()
    join(c, "broker", 2)
    join(c, "backup", 1)
    version = c.version
    assert c.tick(DEAD_AFTER_S) == []          # exactly at the allowance: still alive
    for t in (0.5, 1.0, 1.5, 2.0, 2.5):         # broker 0 keeps beating, the others do not
        c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 0}, t)
    dead = c.tick(DEAD_AFTER_S + 0.01)
    assert sorted((m.kind, m.id) for m in dead) == [("backup", 0), ("broker", 1)]
    assert c.version == version + 1            # one change, one bump
    alive = {(k, m["id"]): m["alive"] for k in ("brokers", "backups") for m in c.cluster()[k]}
    assert alive == {("brokers", 0): True, ("brokers", 1): False, ("backups", 0): False}
    assert c.tick(10.0) == [c.members["broker"][0]]
    # A heartbeat brings a daemon back and is a change too.
    v = c.version
    c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 1, "metadata_version": 0}, 11.0)
    assert c.members["broker"][1].alive and c.version == v + 1


def test_heartbeat_from_unknown_id_asks_to_register():
    c = make()
    join(c, "broker", 1)
    with pytest.raises(NotReady, match="register"):
        c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 5, "metadata_version": 0}, 0.0)
    with pytest.raises(NotReady):
        c.handle("heartbeat", {"token": TOKEN, "kind": "backup", "daemon_id": 0, "metadata_version": 0}, 0.0)


def test_heartbeat_replies_current_version_and_keeps_only_the_stats_it_reads():
    c = make()
    join(c, "broker", 1)
    reply = c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 0,
                                   "stats": {"memory_bytes": 5, "replicas": {"x": [{}] * 100},
                                             "appends": 7}}, 0.1)
    assert reply == {"metadata_version": c.version}
    assert c.members["broker"][0].stats == {"memory_bytes": 5}


def test_heartbeat_with_a_version_never_issued_is_refused_and_changes_nothing():
    c = make()
    join(c, "broker", 1)
    before = (c.version, c.to_state())
    for forged in (c.version + 1, 500, 2**62 - 1):
        with pytest.raises(BadRequest, match="never issued"):
            c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0,
                                   "metadata_version": forged}, 0.1)
    assert (c.version, c.to_state()) == before
    assert c.members["broker"][0].applied_version == 0


# ---------------------------------------------------------------------- placement

def test_placement_round_robin_over_live_brokers():
    c = make()
    join(c, "broker", 3)
    s = create(c, "a", streamlets=7)
    assert s["placement"] == [0, 1, 2, 0, 1, 2, 0]
    assert s["brokers"] == {"0": "127.0.0.1:9000", "1": "127.0.0.1:9001", "2": "127.0.0.1:9002"}


def test_one_streamlet_streams_spread_evenly():
    c = make()
    join(c, "broker", 4)
    owners = Counter(create(c, f"s{i}")["placement"][0] for i in range(40))
    assert owners == {0: 10, 1: 10, 2: 10, 3: 10}


def test_placement_skips_dead_brokers():
    c = make()
    join(c, "broker", 3)
    c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 0}, 1.5)
    c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 2, "metadata_version": 0}, 1.5)
    c.tick(DEAD_AFTER_S + 0.5)                 # broker 1 is dead
    s = create(c, "a", DEAD_AFTER_S + 0.5, streamlets=6)
    assert set(s["placement"]) == {0, 2} and Counter(s["placement"]) == {0: 3, 2: 3}


def test_create_needs_live_brokers_and_backups():
    c = make()
    with pytest.raises(NotReady, match="no live broker"):
        create(c, "a")
    join(c, "broker", 1)
    join(c, "backup", 1)
    with pytest.raises(NotReady, match="2 live backups, 1 live"):
        create(c, "a", replication=3)
    assert create(c, "a", replication=2)["replication"] == 2
    c.tick(100.0)
    with pytest.raises(NotReady):
        create(c, "b")


# ---------------------------------------------------------------------- streams

def test_stream_ids_never_reused_and_names_unique():
    c = make()
    join(c, "broker", 1)
    a = create(c, "a")
    with pytest.raises(StreamExists):
        create(c, "a")
    c.handle("delete_stream", {"name": "a"}, 0.0)
    a2 = create(c, "a")
    b = create(c, "b")
    assert len({a["id"], a2["id"], b["id"]}) == 3 and a2["id"] > a["id"] and 0 not in (a["id"],)


def test_describe_list_delete():
    c = make()
    join(c, "broker", 2)
    create(c, "zeta", streamlets=2, active_groups=3, replication=1, group_segments=4,
           segment_size_bytes=65536, durability="disk", replication_capacity=2)
    create(c, "alpha")
    d = c.handle("describe_stream", {"name": "zeta"}, 0.0)["stream"]
    assert {k: d[k] for k in ("name", "streamlets", "active_groups", "replication",
                              "group_segments", "segment_size_bytes", "durability",
                              "replication_capacity")} == {
        "name": "zeta", "streamlets": 2, "active_groups": 3, "replication": 1,
        "group_segments": 4, "segment_size_bytes": 65536, "durability": "disk",
        "replication_capacity": 2}
    assert [s["name"] for s in c.handle("list_streams", {}, 0.0)["streams"]] == ["alpha", "zeta"]
    assert c.handle("delete_stream", {"name": "zeta"}, 0.0) == {}
    with pytest.raises(UnknownStream):
        c.handle("describe_stream", {"name": "zeta"}, 0.0)
    with pytest.raises(UnknownStream):
        c.handle("delete_stream", {"name": "zeta"}, 0.0)


def test_defaults_follow_config():
    c = make()
    join(c, "broker", 1)
    s = create(c, "d")
    assert (s["streamlets"], s["active_groups"], s["replication"], s["group_segments"],
            s["segment_size_bytes"], s["durability"], s["replication_capacity"]) == (
        config.DEFAULT_STREAMLETS, config.DEFAULT_ACTIVE_GROUPS, config.DEFAULT_REPLICATION,
        config.DEFAULT_GROUP_SEGMENTS, config.DEFAULT_SEGMENT_SIZE_BYTES,
        config.DEFAULT_DURABILITY, 0)


def test_broker_streams_lists_exactly_the_brokers_streams():
    c = make()
    join(c, "broker", 2)
    create(c, "one", streamlets=1)       # broker 0
    create(c, "two", streamlets=1)       # broker 1
    create(c, "both", streamlets=2)      # brokers 0 and 1
    names = lambda b: sorted(s["name"] for s in c.handle("broker_streams", {"broker_id": b}, 0.0)["streams"])
    assert names(0) == ["both", "one"] and names(1) == ["both", "two"] and names(9) == []
    c.handle("delete_stream", {"name": "both"}, 0.0)
    reply = c.handle("broker_streams", {"broker_id": 0}, 0.0)
    assert [s["name"] for s in reply["streams"]] == ["one"]
    assert reply["metadata_version"] == c.version


# ---------------------------------------------------------------------- versions and ready

def test_every_change_bumps_the_version():
    c = make()
    versions = [c.version]
    join(c, "broker", 1)
    versions.append(c.version)
    create(c, "a")
    versions.append(c.version)
    c.handle("delete_stream", {"name": "a"}, 0.0)
    versions.append(c.version)
    assert versions == sorted(set(versions))
    v = c.version
    c.handle("list_streams", {}, 0.0)
    c.handle("cluster", {}, 0.0)
    c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": v}, 0.1)
    assert c.version == v                # reads and routine heartbeats change nothing


def test_ready_once_every_owning_broker_applied_the_version():
    c = make()
    join(c, "broker", 3)
    s = create(c, "s", streamlets=2)     # brokers 0 and 1
    assert s["ready"] is False and s["version"] == c.version
    beat = lambda b, v: c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": b, "metadata_version": v}, 0.1)
    beat(0, s["version"])
    beat(2, s["version"])                 # not an owner: irrelevant
    assert c.describe_stream("s")["ready"] is False
    beat(1, s["version"] - 1)
    assert c.describe_stream("s")["ready"] is False
    beat(1, s["version"])
    assert c.describe_stream("s")["ready"] is True
    # Later changes do not make an existing stream unready.
    create(c, "t")
    assert c.describe_stream("s")["ready"] is True


def test_reregistered_broker_must_apply_again():
    c = make()
    join(c, "broker", 1)
    create(c, "s")
    applied_all(c)
    assert c.describe_stream("s")["ready"]
    c.handle("register", {"kind": "broker", "address": "127.0.0.1:9000", "node": "n", "daemon_id": 0,
                          "token": TOKEN}, 1.0)
    assert not c.describe_stream("s")["ready"]     # a restarted broker has applied nothing


# ---------------------------------------------------------------------- validation

@pytest.mark.parametrize("fields, message", [
    ({}, "missing field 'name'"),
    ({"name": ""}, "stream name"),
    ({"name": "a" * 256}, "name"),
    ({"name": "bad name"}, "stream name"),
    ({"name": "bad/name"}, "stream name"),
    ({"name": "ünï"}, "stream name"),
    ({"name": 5}, "must be a string"),
    ({"name": "s", "streamlets": 0}, "streamlets"),
    ({"name": "s", "streamlets": 4097}, "streamlets"),
    ({"name": "s", "streamlets": "4"}, "streamlets"),
    ({"name": "s", "streamlets": True}, "streamlets"),
    ({"name": "s", "active_groups": 0}, "active_groups"),
    ({"name": "s", "active_groups": 257}, "active_groups"),
    ({"name": "s", "replication": 0}, "replication"),
    ({"name": "s", "replication": 9}, "replication"),
    ({"name": "s", "group_segments": 0}, "group_segments"),
    ({"name": "s", "segment_size_bytes": 10}, "segment_size_bytes"),
    ({"name": "s", "segment_size_bytes": 2**40}, "segment_size_bytes"),
    ({"name": "s", "segment_size_bytes": -1}, "segment_size_bytes"),
    ({"name": "s", "durability": "tape"}, "durability"),
    ({"name": "s", "durability": None}, "durability"),
    ({"name": "s", "replication_capacity": -1}, "replication_capacity"),
    ({"name": "s", "replication_capacity": 5000}, "replication_capacity"),
])
def test_create_stream_validation(fields, message):
    c = make()
    join(c, "broker", 1)
    version = c.version
    with pytest.raises(BadRequest, match=message):
        c.handle("create_stream", fields, 0.0)
    assert c.version == version and not c.streams


def test_accepts_boundary_values_and_name_characters():
    c = make()
    join(c, "broker", 1)
    join(c, "backup", 7)
    s = create(c, "A-z_0.9" + "x" * 248, streamlets=4096, active_groups=256, replication=8,
               segment_size_bytes=1024)
    assert len(s["placement"]) == 4096 and len(s["name"]) == 255


@pytest.mark.parametrize("op, fields", [
    ("register", {}),
    ("register", {"kind": "consumer", "address": "h:1", "node": "n"}),
    ("register", {"kind": "broker", "address": "nohost", "node": "n"}),
    ("register", {"kind": "broker", "address": "h:0", "node": "n"}),
    ("register", {"kind": "broker", "address": "h:99999", "node": "n"}),
    ("register", {"kind": "broker", "address": ":7000", "node": "n"}),
    ("register", {"kind": "broker", "address": "h:7000", "node": ""}),
    ("register", {"kind": "broker", "address": "h:7000", "node": "n", "daemon_id": -1}),
    ("register", {"kind": "broker", "address": "h:7000", "node": "n", "daemon_id": "1"}),
    ("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0}),
    ("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": -1}),
    ("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 2**63 - 1}),
    ("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 2**64}),
    ("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 0, "stats": [1]}),
    ("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 0,
                   "stats": {str(i): i for i in range(1001)}}),
    ("describe_stream", {}),
    ("describe_stream", {"name": ["x"]}),
    ("delete_stream", {"name": None}),
    ("broker_streams", {}),
    ("broker_streams", {"broker_id": "0"}),
    ("no_such_op", {}),
])
def test_bad_requests_change_nothing(op, fields):
    c = make()
    join(c, "broker", 1)
    before = (c.version, c.to_state())
    with pytest.raises(BadRequest):
        c.handle(op, fields, 0.0)
    assert (c.version, c.to_state()) == before


def test_streamspec_is_validated_when_built_directly():
    with pytest.raises(BadRequest):
        StreamSpec(name="ok", streamlets=0)


# ---------------------------------------------------------------------- persistence

def test_state_round_trip_keeps_streams_members_and_counters():
    c = make()
    join(c, "broker", 3)
    join(c, "backup", 2)
    create(c, "a", streamlets=5, replication=3, durability="disk")
    create(c, "b")
    c.handle("delete_stream", {"name": "b"}, 0.0)
    state = c.to_state()

    r = make(now=100.0, state=state)
    assert r.version > c.version                       # the restart is a change
    assert r.to_state()["streams"] == state["streams"]
    # Each member's last registration is kept: brokers tell a backup's restart by it.
    assert r.cluster()["brokers"] == [dict(m, alive=False) for m in c.cluster()["brokers"]]
    assert {m["id"]: m["registered_version"] for m in r.cluster()["backups"]} == \
        {m["id"]: m["registered_version"] for m in c.cluster()["backups"]}
    # Members come back under their ids, alive once they heartbeat.
    r.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 2, "metadata_version": 0}, 100.1)
    assert r.members["broker"][2].alive
    # Counters survive: no id is reused, placement continues its rotation.
    new = create(r, "b", 100.1)
    assert new["id"] > max(s["id"] for s in state["streams"]) + 1  # "b"'s old id is skipped too
    assert r.handle("register", {"kind": "backup", "address": "h:1", "node": "n"}, 100.1)["daemon_id"] == 2
    # A stream whose brokers already applied its version before the restart is ready as soon
    # as they report it again.
    a = r.describe_stream("a")
    for b in set(a["placement"]):
        r.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": b, "metadata_version": a["version"]}, 100.2)
    assert r.describe_stream("a")["ready"]


@pytest.mark.parametrize("corrupt", [
    lambda s: s.update(format=99),
    lambda s: s.pop("streams"),
    lambda s: s["streams"][0].update(streamlets=0),
    lambda s: s["streams"][0].update(placement=[42]),
    lambda s: s["streams"][0].update(id=10**6),
    lambda s: s.update(metadata_version=-3),
    lambda s: s["members"]["broker"].append({"id": 0, "address": "h:1", "node": "n"}),
])
def test_inconsistent_state_is_refused(corrupt):
    c = make()
    join(c, "broker", 1)
    create(c, "a")
    state = c.to_state()
    corrupt(state)
    with pytest.raises(ValueError):
        make(state=state)


# ---------------------------------------------------------------------- bounds

def test_chosen_ids_leave_room_for_assigned_ones():
    c = make()
    with pytest.raises(BadRequest):
        c.handle("register", {"kind": "broker", "address": "h:1", "node": "n",
                              "daemon_id": 2**31}, 0.0)
    top = c.handle("register", {"kind": "broker", "address": "h:1", "node": "n",
                                "daemon_id": 2**31 - 1}, 0.0)["daemon_id"]
    nxt = c.handle("register", {"kind": "broker", "address": "h:2", "node": "n"}, 0.0)["daemon_id"]
    assert nxt == top + 1
    c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": nxt, "metadata_version": 0}, 0.1)


def test_metadata_is_bounded(monkeypatch):
    from kera.coordinator import validate
    monkeypatch.setattr(validate, "DAEMONS_MAX", 3)
    monkeypatch.setattr(validate, "STREAMS_MAX", 2)
    monkeypatch.setattr(validate, "STREAMLETS_TOTAL_MAX", 10)
    c = make()
    join(c, "broker", 3)
    with pytest.raises(NotReady, match="registered already"):
        join(c, "broker", 1)
    # Known daemons may still come back.
    c.handle("register", {"kind": "broker", "address": "h:9", "node": "n", "daemon_id": 1,
                          "token": TOKEN}, 0.0)
    create(c, "a", streamlets=8)
    with pytest.raises(BadRequest, match="exceed"):
        create(c, "b", streamlets=3)
    create(c, "b", streamlets=2)
    with pytest.raises(BadRequest, match="2 streams"):
        create(c, "c")
    c.handle("delete_stream", {"name": "a"}, 0.0)
    create(c, "c")


def test_describe_shows_each_streamlets_state():
    c = make()
    join(c, "broker", 2)
    s = create(c, "a", streamlets=4)
    assert s["states"] == ["serving"] * 4
    c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 0, "metadata_version": 0}, 1.5)
    c.tick(DEAD_AFTER_S + 0.5)                 # broker 1 dead; R=1: its streamlets stay put
    d = c.handle("describe_stream", {"name": "a"}, DEAD_AFTER_S + 0.5)["stream"]
    assert d["states"] == ["offline" if b == 1 else "serving" for b in d["placement"]]


def test_raising_the_streamlet_count_places_new_streamlets_on_the_least_loaded_live_brokers():
    c = make()
    join(c, "broker", 3)
    create(c, "busy", streamlets=4, replication=1)        # brokers 0,1,2,0
    d = create(c, "s", streamlets=1, replication=1)        # broker 1
    version = d["version"]
    d = c.handle("alter_stream", {"name": "s", "streamlets": 4}, 0.0)["stream"]
    assert d["streamlets"] == 4 and d["version"] > version and not d["ready"]
    # Loads before: 0 -> 2, 1 -> 2, 2 -> 1; each new streamlet goes to the least loaded.
    assert d["placement"] == [1, 2, 0, 1]
    assert c.handle("alter_stream", {"name": "s", "streamlets": 4}, 0.0)["stream"]["version"] \
        == d["version"]                                    # same count: nothing changes
    with pytest.raises(BadRequest, match="only be raised"):
        c.handle("alter_stream", {"name": "s", "streamlets": 2}, 0.0)
    assert c.describe_stream("s")["placement"] == [1, 2, 0, 1]
    # Dead brokers get none (all three silent at once is held as a suspected isolation,
    # and the two still silent once broker 2 is heard get the hold again: core.tick).
    from kera.coordinator.liveness import ISOLATION_HOLD_DEAD_WINDOWS
    heard_again = DEAD_AFTER_S + 1
    later = heard_again + DEAD_AFTER_S * ISOLATION_HOLD_DEAD_WINDOWS + 0.01
    assert c.tick(heard_again) == [] and c.death_watch.isolation_suspected
    for now in (heard_again, later):
        c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": 2,
                               "metadata_version": c.version}, now)
        c.tick(now)
    assert [b["alive"] for b in c.cluster()["brokers"]] == [False, False, True]
    d = c.handle("alter_stream", {"name": "s", "streamlets": 6}, later)["stream"]
    assert d["placement"][4:] == [2, 2]
    # Kept across a restart; groups see the new count.
    c2 = make(state=c.to_state())
    assert c2.describe_stream("s")["placement"] == d["placement"]
    assert c2._streamlets_of("s") == 6


def test_raising_the_streamlet_count_respects_the_cluster_bound(monkeypatch):
    from kera.coordinator import validate
    c = make()
    join(c, "broker", 1)
    create(c, "s", streamlets=2, replication=1)
    monkeypatch.setattr(validate, "STREAMLETS_TOTAL_MAX", 3)
    with pytest.raises(BadRequest, match="exceed"):
        c.handle("alter_stream", {"name": "s", "streamlets": 4}, 0.0)
    assert c.describe_stream("s")["streamlets"] == 2


# ---------------------------------------------------------------------- number floors

def beat(c: Coordinator, b: int, now: float, **fields) -> dict:
    return c.handle("heartbeat", {"token": TOKEN, "kind": "broker", "daemon_id": b,
                                  "metadata_version": 0, **fields}, now)


def test_an_owners_number_floor_is_kept_raised_only_persisted_and_handed_over():
    c = make()
    join(c, "broker", 2)
    s = create(c, "ledger", streamlets=2, active_groups=2)
    owner, other = s["placement"][0], 1 - s["placement"][0]
    before = c.version
    beat(c, owner, 0.1, floors=[[s["id"], 0, 4, [30, 12]]])
    assert c.version > before                       # persisted, and brokers refetch
    described = c.handle("describe_stream", {"name": "ledger"}, 0.1)["stream"]
    assert described["floors"] == [[0, 4, [30, 12]]]
    beat(c, owner, 0.2, floors=[[s["id"], 0, 3, [31, 2]]])   # an older report: only raises
    beat(c, other, 0.2, floors=[[s["id"], 0, 9, [99, 99]]])  # not its streamlet: ignored
    beat(c, owner, 0.2, floors=[[s["id"] + 100, 0, 9, [9]]])  # a deleted stream: skipped
    assert c.streams["ledger"].floors == {0: (4, (31, 12))}
    r = make(now=10.0, state=c.to_state())
    assert r.streams["ledger"].floors == {0: (4, (31, 12))}


def test_malformed_floors_are_refused_and_change_nothing():
    c = make()
    join(c, "broker", 1)
    join(c, "backup", 1)
    s = create(c, "ledger")
    before = (c.version, c.to_state())
    for bad in ([[s["id"], 0, 4]], [[s["id"], 5, 4, [1]]], [[s["id"], 0, 4, [1, 2]]],
                [[s["id"], 0, -1, [1]]], [[s["id"], 0, 4, [2**64]]], [["x", 0, 4, [1]]]):
        with pytest.raises(BadRequest):
            beat(c, 0, 0.1, floors=bad)
    with pytest.raises(BadRequest, match="only brokers"):
        c.handle("heartbeat", {"token": TOKEN, "kind": "backup", "daemon_id": 0,
                               "metadata_version": 0, "floors": [[s["id"], 0, 4, [1]]]}, 0.1)
    assert (c.version, c.to_state()) == before


def test_an_unknown_stream_name_suggests_the_closest_existing_one():
    from kera.errors import UnknownStream
    c = make()
    join(c, "broker", 1)
    create(c, "orders-eu")
    create(c, "payments")
    with pytest.raises(UnknownStream, match="did you mean 'orders-eu'"):
        c.handle("describe_stream", {"name": "orders-ue"}, 0.0)
    with pytest.raises(UnknownStream) as exc:
        c.handle("describe_stream", {"name": "zzz"}, 0.0)
    assert "did you mean" not in exc.value.message


def test_a_daemon_started_for_another_cluster_is_refused_and_nothing_halts():
    from kera.errors import WrongCluster
    c = make()
    fields = {"kind": "broker", "address": "127.0.0.1:9100", "node": "n"}
    with pytest.raises(WrongCluster, match="was started for cluster other"):
        c.handle("register", {**fields, "expect_cluster_id": "other"}, 0.0)
    assert not c.halted and not c.members["broker"]
    mine = c.handle("cluster", {}, 0.0)["cluster_id"]
    reply = c.handle("register", {**fields, "expect_cluster_id": mine}, 0.0)
    assert reply["cluster_id"] == mine
