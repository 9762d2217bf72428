"""The sans-IO parts behind Kafka group tools and APIs: the consumer protocol's subscription and
assignment bytes (kera.broker.kafka.consumer_protocol), the topics a classic group subscribes
to (OffsetDelete's check), ListOffsets' max-timestamp search (kera.broker.kafka.offsets),
`kera group`'s Kafka reset targets and lag rows (kera.cli.kafka_groups), and OffsetDelete's
`found` in the coordinator's Kafka offsets (kera.coordinator.kafka_offsets)."""

import pytest

from kera.broker.kafka.classic_groups import ClassicGroups
from kera.broker.kafka.consumer_protocol import (
    assigned_partitions, encode_assignment, encode_subscription, subscribed_topics)
from kera.broker.kafka.offsets import latest_stamped
from kera.cli.kafka_groups import lag_rows, reset_offset
from kera.codec.wire import Fields
from kera.coordinator.kafka_offsets import KafkaOffsets, ops


# ---------------------------------------------------------------------- consumer protocol
def test_subscription_and_assignment_round_trip_in_every_version():
    for version in (0, 1, 3):
        assert subscribed_topics(encode_subscription(["a", "bé"], version)) == {"a", "bé"}
        raw = encode_assignment({"a": [0, 2], "b": [1]}, version)
        assert assigned_partitions(raw) == [("a", 0), ("a", 2), ("b", 1)]


@pytest.mark.parametrize("raw", [b"", None, b"\x00", b"\x00\x00\x00\x00\x00\x05\x00\x01a",
                                 b"\x00\x00\xff\xff\xff\xff", b"\x00\x00\x7f\xff\xff\xff"])
def test_malformed_bytes_read_as_nothing(raw):
    assert subscribed_topics(raw) == set()
    assert assigned_partitions(raw) == []


def test_a_truncated_assignment_reads_as_nothing_not_half():
    raw = encode_assignment({"a": [0, 1, 2]})
    assert assigned_partitions(raw[:-8]) == []


# ---------------------------------------------------------------------- OffsetDelete's check
def _join(g, member, topics, token, protocol_type="consumer"):
    return g.join("g", member, "c", "/h", 10_000, 30_000, protocol_type,
                  [("range", encode_subscription(topics))], False, token, 0.0)


def test_a_group_subscribes_to_its_members_topics_and_an_empty_one_to_none():
    g = ClassicGroups(initial_rebalance_delay_ms=0)
    assert g.subscribed("g") == set()
    _join(g, "", ["orders", "users"], "t1")
    assert g.subscribed("g") == {"orders", "users"}
    member = dict(g.take_ready(0.0))["t1"].member_id
    g.leave("g", [member], 0.0)
    assert g.subscribed("g") == set()


def test_members_of_another_protocol_type_make_topics_unknown():
    g = ClassicGroups(initial_rebalance_delay_ms=0)
    _join(g, "", ["orders"], "t1", protocol_type="connect")
    assert g.subscribed("g") is None


# ---------------------------------------------------------------------- ListOffsets -3
def _first_at(records):
    """first_at(us) over records [(number, timestamp_us)] in number order."""
    def first_at(us):
        return next(((n, t) for n, t in records if t >= us), None)
    return first_at


@pytest.mark.parametrize("stamps,expected", [
    ([5, 9, 3, 9, 1], (1, 9)),           # ties: the first record with the largest
    ([7], (0, 7)),
    ([0, 0], (0, 0)),
    ([1, 2**62, 3], (1, 2**62)),
    ([2**63 - 1, 5], (0, 2**63 - 1)),
    ([1_700_000_000_000_000, 1_700_000_000_000_001, 1_699_999_999_999_999],
     (1, 1_700_000_000_000_001)),
])
def test_latest_stamped_finds_the_first_record_with_the_largest_timestamp(stamps, expected):
    records = [(10 + i, t) for i, t in enumerate(stamps)]
    number, stamp = latest_stamped(_first_at(records))
    assert (number - 10, stamp) == expected


def test_latest_stamped_of_an_empty_partition_is_none():
    assert latest_stamped(lambda us: None) is None


# ---------------------------------------------------------------------- kera group, Kafka
@pytest.mark.parametrize("to,number,at,expected", [
    ("earliest", None, None, 10), ("latest", None, None, 50),
    (None, 30, None, 30), (None, 3, None, 10), (None, 99, None, 50),
    (None, None, 42, 42), (None, None, None, 50),
])
def test_reset_offsets_are_kafkas_targets_clamped_to_what_is_retained(to, number, at, expected):
    assert reset_offset((10, 50), to, number, at) == expected


def test_lag_rows_are_end_minus_committed_with_members_and_unknowns():
    committed = [["t", 0, 7, ""], ["t", 1, 20, ""], ["gone", 0, 3, ""]]
    spans = {("t", 0): (0, 10), ("t", 1): (5, 15), ("t", 2): (0, 4)}
    member = {"member_id": "m1", "assignment": [["t", 0], ["t", 2]]}
    rows = {(r["topic"], r["partition"]): r for r in lag_rows(committed, spans, [member])}
    assert (rows[("t", 0)]["lag"], rows[("t", 0)]["member"]) == (3, member)
    assert rows[("t", 1)]["lag"] == 0, "a commit past the end is no negative lag"
    assert (rows[("t", 2)]["committed"], rows[("t", 2)]["lag"], rows[("t", 2)]["end"]) == \
        (None, None, 4), "assigned, never committed"
    assert (rows[("gone", 0)]["end"], rows[("gone", 0)]["lag"]) == (None, None)
    assert list(rows) == sorted(rows)


def test_offset_delete_says_whether_the_group_held_offsets():
    offsets = KafkaOffsets()
    delete = ops(offsets)["kafka_offset_delete"]
    assert delete(Fields({"group": "g", "partitions": [["t", 0]]}), 0.0) == {"found": False}
    offsets.commit("g", [("t", 0, 5, ""), ("t", 1, 6, "")])
    assert delete(Fields({"group": "g", "partitions": [["t", 0]]}), 0.0) == {"found": True}
    assert offsets.fetch("g") == [["t", 1, 6, ""]]


# ---------------------------------------------------------------------- group_admin
def _ctx(node_id: int, groups, calls):
    """What kera.broker.kafka.group_admin reads of a Context: two Kafka brokers, 0 and 1."""
    from types import SimpleNamespace
    from kera.broker.kafka.catalog import KafkaBroker
    brokers = {i: KafkaBroker(i, "127.0.0.1", 9092 + i) for i in (0, 1)}
    return SimpleNamespace(node_id=node_id, groups=groups,
                           settings=SimpleNamespace(advertise=None),
                           catalog=SimpleNamespace(brokers=brokers, calls=SimpleNamespace(
                               call=lambda op, fields, done: calls.append((op, fields, done)))))


def test_group_admin_names_the_coordinator_refuses_a_reset_with_members_and_writes_one_without():
    from kera.broker.kafka import group_admin
    from kera.broker.kafka.groups import coordinator_of
    from kera.errors import GroupNotEmpty, NotOwner
    g, calls = ClassicGroups(initial_rebalance_delay_ms=0), []
    here = coordinator_of(_ctx(0, g, calls), "g")["node_id"]
    ctx, elsewhere = _ctx(here, g, calls), _ctx(1 - here, g, calls)
    offsets = [["t", 0, 5, ""]]
    assert group_admin.members(elsewhere, Fields({"group": "g"})) == {"coordinator": here}
    with pytest.raises(NotOwner):
        group_admin.reset(elsewhere, Fields({"group": "g", "offsets": offsets}), print)
    _join(g, "", ["t"], "t1")
    member = dict(g.take_ready(0.0))["t1"].member_id
    described = group_admin.members(ctx, Fields({"group": "g"}))
    assert (described["coordinator"], [m["member_id"] for m in described["members"]]) == \
        (here, [member])
    with pytest.raises(GroupNotEmpty, match="stop its consumers"):
        group_admin.reset(ctx, Fields({"group": "g", "offsets": offsets}), print)
    g.leave("g", [member], 0.0)
    done: list = []
    group_admin.reset(ctx, Fields({"group": "g", "offsets": offsets}), done.append)
    [(op, fields, reply)] = calls
    assert (op, fields) == ("kafka_offset_commit", {"group": "g", "offsets": offsets})
    reply({}, None)
    assert done == [None]


@pytest.mark.parametrize("committed,shift,expected", [
    (30, 5, 35), (30, -5, 25), (12, -5, 10), (48, 5, 50)])
def test_shift_by_moves_the_committed_offset_within_what_is_retained(committed, shift, expected):
    assert reset_offset((10, 50), None, None, None, committed, shift) == expected
