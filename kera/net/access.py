"""Which principal may call which op, sans-IO: the rule table every daemon's shell enforces.

Three kinds of op:
- cluster ops (register, heartbeat, replicate, list/read/drop replica, recovered, ...): only
  principals in a member role (broker, backup, coordinator), and only the roles listed; the
  read-only ones (the replica maps, a replica's listing and bytes) also for `admin`, which an
  operator needs to see where data is (a fencing listing stays the brokers': kera.backup);
- ACL ops: allowed when the cluster's ACLs (kera.net.acl) grant the operation on the resource the
  request names (`field`), or, for ops whose resources are inside the request (produce's
  chunks, fetch's reads), when the handler's per-resource check passes;
- open ops: any authenticated principal (`cluster`, which clients need to find brokers).

An op missing from the table is refused to everyone but admins: a new op is closed until it is
classified here. A refusal is `not_authorized`, naming the principal, the op and what it lacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kera.net.acl import CLUSTER_NAME, Acls
from kera.errors import NotAuthorized
from kera.net.keys import MEMBER_ROLES, Principal
from kera.net.quota import Quotas


@dataclass(frozen=True)
class Rule:
    roles: frozenset = frozenset()        # roles allowed without consulting ACLs
    operation: str | None = None          # the ACL operation, for ACL ops
    resource_type: str | None = None
    field: str | None = None              # request field naming the resource; None: in-handler
    open: bool = False                    # any authenticated principal


def _cluster(*roles: str) -> Rule:
    return Rule(frozenset(roles))


def _acl(operation: str, resource_type: str, field: str | None = None) -> Rule:
    return Rule(operation=operation, resource_type=resource_type, field=field)


BROKERS = ("broker",)
MEMBERS = tuple(sorted(MEMBER_ROLES))
RULES: dict[str, Rule] = {
    # coordinator: cluster membership and metadata for daemons
    "register": _cluster("broker", "backup"),
    "heartbeat": _cluster("broker", "backup"),
    "broker_streams": _cluster("broker", "admin"),
    "replicas": _cluster("broker", "admin"),
    "recovered": _cluster(*BROKERS),
    "cluster": Rule(open=True),
    "recovery_status": _acl("describe", "cluster", None),
    "deregister": _acl("alter", "cluster", None),      # an operator forgetting a dead daemon
    "rebalance": _acl("alter", "cluster", None),       # an operator moving streamlets
    # coordinator: streams; brokers too, for their Kafka listeners' CreateTopics, DeleteTopics
    # and CreatePartitions, which check the Kafka user's own grants first
    # (kera.broker.kafka.authorize)
    "create_stream": Rule(frozenset({"broker"}), "create", "stream", "name"),
    # ...and for the coordinator's own lag exporter (kera.coordinator.group_lag), which reads
    # descriptors and offsets of every stream a group committed on
    "describe_stream": Rule(frozenset({"coordinator"}), "describe", "stream", "name"),
    "alter_stream": Rule(frozenset({"broker"}), "alter", "stream", "name"),
    "delete_stream": Rule(frozenset({"broker"}), "delete", "stream", "name"),
    "list_streams": Rule(open=True),      # the reply is filtered by describe (coordinator)
    # coordinator: consumer groups (the streams' read grants are checked where data is read)
    "group_heartbeat": _acl("read", "group", "group"),
    "group_commit": _acl("read", "group", "group"),
    "group_offsets": _acl("describe", "group", "group"),
    "group_describe": _acl("describe", "group", "group"),
    "group_reset": _acl("alter", "group", "group"),
    "group_delete": _acl("delete", "group", "group"),
    "group_list": _acl("describe", "cluster", None),
    # coordinator: Kafka-protocol groups' offsets, for brokers' Kafka listeners (which check the
    # Kafka client's own grants) and for operators
    "kafka_offset_commit": _cluster("broker", "admin"),
    "kafka_offset_fetch": _cluster("broker", "admin"),
    "kafka_offset_delete": _cluster("broker", "admin"),
    "kafka_group_list": _cluster("broker", "admin"),
    # coordinator: transactions (kera.coordinator.transactions), as Kafka's TransactionalId
    # resource: Write to use an id, Describe to see it. Brokers too, for their Kafka listeners,
    # which check the Kafka user's own grants. Positions also need the group's read grant, as
    # group_commit: checked in the handler (kera.coordinator.txn_positions).
    "txn_init": Rule(frozenset({"broker"}), "write", "transactional_id", "transactional_id"),
    "txn_add_parts": Rule(frozenset({"broker"}), "write", "transactional_id", "transactional_id"),
    "txn_add_positions": Rule(frozenset({"broker"}), "write", "transactional_id",
                              "transactional_id"),
    "txn_end": Rule(frozenset({"broker"}), "write", "transactional_id", "transactional_id"),
    "txn_describe": Rule(frozenset({"broker"}), "describe", "transactional_id",
                         "transactional_id"),
    "txn_list": Rule(frozenset({"broker"}), "describe", "cluster", None),
    # coordinator: brokers' questions about the transactions they hold
    "txn_verify": _cluster(*BROKERS),
    "txn_resolve": _cluster(*BROKERS),
    # coordinator: ACLs themselves
    "acl_add": _acl("alter", "cluster", None),
    "acl_remove": _acl("alter", "cluster", None),
    "acl_list": _acl("describe", "cluster", None),
    "quota_set": _acl("alter", "cluster", None),
    "quota_list": _acl("describe", "cluster", None),
    # broker: data (per stream, checked in the handler)
    "produce": _acl("write", "stream"),
    "fetch": _acl("read", "stream"),
    "offsets": Rule(frozenset({"coordinator"}), "describe", "stream"),
    "offsets_for_time": _acl("describe", "stream"),   # Kafka's ListOffsets needs Describe too
    "offsets_for_number": _acl("describe", "stream"),
    "numbers": _acl("describe", "stream"),
    # broker: transaction markers, from the coordinator only (its marker channel,
    # kera.coordinator.markers)
    "txn_markers": _cluster("coordinator"),
    # broker: Kafka groups it coordinates, for `kera group` (kera.broker.kafka.group_admin)
    "kafka_group_members": _acl("describe", "group", "group"),
    "kafka_group_reset": _acl("alter", "group", "group"),
    # every daemon
    "stats": Rule(frozenset(MEMBERS), "describe", "cluster", None),
    # backup: replicas, for brokers only (and bound to their broker id: kera.backup)
    "replicate": _cluster(*BROKERS),
    "drop_replica": _cluster(*BROKERS),
    "list_replicas": _cluster("broker", "admin"),
    "read_replica": _cluster("broker", "admin"),
}


class Guard:
    """The access policy of one daemon: RULES plus the cluster's ACLs as this daemon knows them."""

    def __init__(self, acls: Acls | None = None, daemon: str = "daemon"):
        self.acls = acls if acls is not None else Acls()
        self.quotas = Quotas()   # enforced by brokers (kera.net.quota)
        self.daemon = daemon

    def admit(self, principal: Principal | None, op: str, fields) -> None:
        """Raise NotAuthorized unless `principal` may call `op` (as far as can be told before
        the handler: per-resource checks inside a request happen there, through `require`)."""
        if principal is None:
            raise NotAuthorized(f"{op!r} refused: the connection has no authenticated principal")
        rule = RULES.get(op)
        if rule is None:
            if principal.role != "admin":
                raise NotAuthorized(f"principal {principal} may not call {op!r} on the "
                                    f"{self.daemon}: the op is not open to clients")
            return
        if rule.open or principal.role in rule.roles:
            return
        if rule.operation is None:
            raise NotAuthorized(
                f"principal {principal} may not call {op!r}: it is a cluster op, for "
                f"{' or '.join(sorted(rule.roles))} keys only")
        if rule.field is None:
            if rule.resource_type == "cluster":
                self.require(principal, rule.operation, "cluster", CLUSTER_NAME)
            return   # the handler checks each resource the request names
        name = fields.get(rule.field) if hasattr(fields, "get") else None
        if not isinstance(name, str):
            return   # malformed: the handler's own validation answers bad_request
        self.require(principal, rule.operation, rule.resource_type, name)

    def require(self, principal: Principal | None, operation: str, resource_type: str,
                name: str) -> None:
        if principal is None or self.acls.allowed(principal, operation, resource_type, name):
            return
        raise NotAuthorized(f"principal {principal} is not allowed to {operation} "
                            f"{resource_type} {name!r}: ask an admin for "
                            f"`kera acl add --principal {principal.name} --operation "
                            f"{operation} --{resource_type.replace('_', '-')} {name}`")

    def checker(self, principal: Principal | None, operation: str, op: str | None = None,
                resource_type: str = "stream") -> Callable[[str], None] | None:
        """A per-resource check for `op`'s handler, or None when nothing is to be checked
        (plaintext, a super user, or a role `op`'s rule admits without ACLs)."""
        if principal is None or principal.role == "admin" or \
                (op is not None and principal.role in RULES.get(op, Rule()).roles):
            return None
        return ResourceCheck(self, principal, operation, resource_type)


class ResourceCheck:
    """`check(name)`: NotAuthorized unless the principal may do the operation to the resource.
    `may_describe(name)` tells a daemon that knows resources by id whether the principal may
    even learn the name: a broker answers a stream it may not describe as an unknown id."""

    __slots__ = ("guard", "principal", "operation", "resource_type")

    def __init__(self, guard: "Guard", principal: Principal, operation: str, resource_type: str):
        self.guard = guard
        self.principal = principal
        self.operation = operation
        self.resource_type = resource_type

    def __call__(self, name: str) -> None:
        self.guard.require(self.principal, self.operation, self.resource_type, name)

    def may_describe(self, name: str) -> bool:
        return self.guard.acls.allowed(self.principal, "describe", self.resource_type, name)

