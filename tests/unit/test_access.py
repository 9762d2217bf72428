"""ACL decisions (kera.net.acl) and the op rules every daemon enforces (kera.net.access): sans-IO."""

import pytest

from kera.net.access import RULES, Guard
from kera.net.acl import Acl, Acls
from kera.coordinator import acl_ops
from kera.errors import BadRequest, NotAuthorized
from kera.net.keys import Principal

ALICE = Principal("alice", "client")
BOB = Principal("bob", "client")
ADMIN = Principal("root", "admin")
BROKER0 = Principal("broker-0", "broker")


def acl(*fields):
    return Acl.parse(list(fields))


def test_allow_literal_and_prefixed_and_nothing_else():
    acls = Acls([acl("alice", "allow", "read", "stream", "clicks", "literal"),
                 acl("alice", "allow", "write", "stream", "logs-", "prefixed")])
    assert acls.allowed(ALICE, "read", "stream", "clicks")
    assert not acls.allowed(ALICE, "read", "stream", "clicks2")
    assert acls.allowed(ALICE, "write", "stream", "logs-a")
    assert not acls.allowed(ALICE, "write", "stream", "log")
    assert not acls.allowed(ALICE, "write", "stream", "clicks")
    assert not acls.allowed(BOB, "read", "stream", "clicks")
    assert not acls.allowed(ALICE, "read", "group", "clicks")


def test_deny_wins_over_allow_including_wildcard_and_all():
    acls = Acls([acl("*", "allow", "all", "stream", "s", "prefixed"),
                 acl("alice", "deny", "read", "stream", "secret", "literal")])
    assert acls.allowed(BOB, "read", "stream", "secret")
    assert not acls.allowed(ALICE, "read", "stream", "secret")
    assert acls.allowed(ALICE, "write", "stream", "secret")
    # a deny of read does not hide that the stream exists
    assert acls.allowed(ALICE, "describe", "stream", "secret")


def test_describe_is_implied_by_other_grants_and_admin_is_super_user():
    acls = Acls([acl("alice", "allow", "write", "stream", "s", "literal")])
    assert acls.allowed(ALICE, "describe", "stream", "s")
    assert not acls.allowed(ALICE, "read", "stream", "s")
    assert Acls().allowed(ADMIN, "delete", "stream", "anything")


def test_decisions_follow_changes():
    acls = Acls()
    entry = acl("alice", "allow", "read", "stream", "s", "literal")
    assert not acls.allowed(ALICE, "read", "stream", "s")
    acls.add(entry)
    assert acls.allowed(ALICE, "read", "stream", "s")
    acls.remove(entry)
    assert not acls.allowed(ALICE, "read", "stream", "s")


@pytest.mark.parametrize("bad", [
    ["alice", "maybe", "read", "stream", "s", "literal"],
    ["alice", "allow", "fly", "stream", "s", "literal"],
    ["alice", "allow", "read", "table", "s", "literal"],
    ["alice", "allow", "read", "stream", "", "literal"],
    ["al/ice", "allow", "read", "stream", "s", "literal"],
    ["alice", "allow", "read", "stream", "s"],
    "alice",
])
def test_malformed_entries_are_refused(bad):
    with pytest.raises(BadRequest):
        Acl.parse(bad)


def test_cluster_ops_only_for_their_member_roles():
    guard = Guard()
    for op in ("register", "heartbeat", "broker_streams", "replicas", "recovered",
               "replicate", "drop_replica", "list_replicas", "read_replica"):
        with pytest.raises(NotAuthorized, match=op):
            guard.admit(ALICE, op, {})
    for op in ("register", "heartbeat", "recovered", "replicate", "drop_replica"):
        with pytest.raises(NotAuthorized, match=op):
            guard.admit(ADMIN, op, {})   # an admin may look, not act as a daemon
    guard.admit(BROKER0, "replicate", {})
    guard.admit(ADMIN, "list_replicas", {})   # read-only: operators may look
    with pytest.raises(NotAuthorized):
        guard.admit(Principal("backup-0", "backup"), "replicate", {})


def test_acl_ops_name_principal_operation_and_resource():
    guard = Guard(Acls([acl("alice", "allow", "create", "stream", "a", "prefixed")]))
    guard.admit(ALICE, "create_stream", {"name": "abc"})
    with pytest.raises(NotAuthorized) as exc:
        guard.admit(ALICE, "delete_stream", {"name": "abc"})
    assert "client:alice" in exc.value.message and "delete" in exc.value.message \
        and "'abc'" in exc.value.message
    guard.admit(ADMIN, "delete_stream", {"name": "abc"})


def test_unclassified_ops_are_closed_and_every_rule_is_well_formed():
    with pytest.raises(NotAuthorized):
        Guard().admit(ALICE, "some_new_op", {})
    Guard().admit(ADMIN, "some_new_op", {})
    for op, rule in RULES.items():
        assert rule.open or rule.roles or rule.operation, op


def test_handler_checker_is_none_for_plaintext_and_admins():
    guard = Guard()
    assert guard.checker(None, "read") is None
    assert guard.checker(ADMIN, "read") is None
    check = guard.checker(ALICE, "read")
    with pytest.raises(NotAuthorized):
        check("s")


def test_heartbeat_carries_acls_only_to_a_stale_broker_and_state_round_trips():
    access = acl_ops.AccessState()
    assert access.for_heartbeat(None) == {}
    access.add([acl("alice", "allow", "read", "stream", "s", "literal")])
    assert access.for_heartbeat(access.version) == {}
    sent = access.for_heartbeat(-1)
    assert sent["acl_version"] == access.version and len(sent["acls"]) == 1
    again = acl_ops.AccessState()
    again.load(access.to_state())
    assert again.version == access.version and again.acls.entries == access.acls.entries


def test_binding_refuses_another_key_for_a_bound_id():
    acl_ops.check_binding("broker", 0, None, BROKER0)            # first registration
    acl_ops.check_binding("broker", 0, "broker-0", BROKER0)
    with pytest.raises(NotAuthorized, match="bound to principal 'broker-0'"):
        acl_ops.check_binding("broker", 0, "broker-0", Principal("broker-1", "broker"))
    with pytest.raises(NotAuthorized, match="role is client"):
        acl_ops.check_binding("broker", 1, None, ALICE)
    acl_ops.check_binding("broker", 0, "broker-0", None)          # plaintext


def test_one_broker_key_registers_one_broker_id():
    from kera.coordinator.core import Coordinator

    def register(principal, member_id=None, port=1):
        fields = {"kind": "broker", "address": f"10.0.0.1:{port}", "node": "n"}
        if member_id is not None:
            fields["daemon_id"] = member_id
        return c.handle("register", fields, 0.0, principal)["daemon_id"]

    c = Coordinator(0.0)
    assert register(BROKER0, 0) == 0
    with pytest.raises(NotAuthorized, match="is broker 0 already.*kera keys create"):
        register(BROKER0, 7, port=2)                      # an id of its choosing
    assert register(BROKER0, port=1) == 0                 # no id given: its own again
    assert register(Principal("broker-1", "broker"), port=3) == 1
    assert register(None, 9, port=4) == 9                 # plaintext: ids are not bound


def test_a_bad_principal_name_in_a_request_is_a_bad_request_not_a_key_file_error():
    from kera.net.quota import Quotas
    with pytest.raises(BadRequest) as acl_err:
        Acl.parse(["a/b", "allow", "read", "stream", "s", "literal"])
    with pytest.raises(BadRequest) as quota_err:
        Quotas().set("a/b", "produce", 100)
    assert acl_err.value.code == quota_err.value.code == "bad_request"
