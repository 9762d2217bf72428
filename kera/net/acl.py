"""Access control lists in Kafka's shape, sans-IO: who may do what to which stream or group.

An entry is (principal, allow|deny, operation, resource type, resource name, literal|prefixed).
A request is allowed when some entry allows it and none denies it: deny wins. `*` as the
principal matches every principal. Describe is implied by any other operation on the same
resource, as in Kafka (whoever may read a stream may see that it exists). Principals in the
`admin` role are super users: ACLs are not consulted for them.

The coordinator stores the entries with its metadata (`to_state`/`load`) and hands them to the
brokers, which enforce data ops (produce, fetch); the coordinator enforces metadata ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from kera.errors import BadRequest
from kera.net.keys import Principal, check_principal

OPERATIONS = ("read", "write", "describe", "create", "delete", "alter", "all")
# `transactional_id`: Kafka's TransactionalId (kera.coordinator.transactions): write to use one,
# describe to see it.
RESOURCE_TYPES = ("stream", "group", "cluster", "transactional_id")
PERMISSIONS = ("allow", "deny")
PATTERNS = ("literal", "prefixed")
ANY_PRINCIPAL = "*"
CLUSTER_NAME = "kera"          # the one cluster resource's name
SUPER_ROLE = "admin"
# Entries one cluster holds: they travel whole to every broker on change, and each is ~100 B.
ACLS_MAX = 10_000
RESOURCE_NAME_CHARS_MAX = 255
# Decisions remembered per distinct (principal, operation, resource) between ACL changes: the
# broker asks once per chunk, so the common case must not scan every entry.
DECISIONS_CACHED_MAX = 100_000


@dataclass(frozen=True, order=True)
class Acl:
    principal: str
    permission: str
    operation: str
    resource_type: str
    resource: str
    pattern: str = "literal"

    def matches(self, principal: str, operation: str, resource_type: str, name: str) -> bool:
        if self.resource_type != resource_type:
            return False
        if self.principal not in (ANY_PRINCIPAL, principal):
            return False
        if self.operation not in ("all", operation) and not (
                operation == "describe" and self.permission == "allow"):
            return False
        if self.pattern == "prefixed":
            return name.startswith(self.resource)
        return name == self.resource

    def to_list(self) -> list:
        return [self.principal, self.permission, self.operation, self.resource_type,
                self.resource, self.pattern]

    @classmethod
    def parse(cls, value) -> "Acl":
        if not isinstance(value, (list, tuple)) or len(value) != 6 or \
                not all(isinstance(v, str) for v in value):
            raise BadRequest("an ACL is [principal, permission, operation, resource_type, "
                             "resource, pattern], all strings")
        principal, permission, operation, rtype, resource, pattern = value
        if principal != ANY_PRINCIPAL:
            check_principal(principal)
        for what, got, allowed in (("permission", permission, PERMISSIONS),
                                   ("operation", operation, OPERATIONS),
                                   ("resource type", rtype, RESOURCE_TYPES),
                                   ("pattern", pattern, PATTERNS)):
            if got not in allowed:
                raise BadRequest(f"ACL {what} {got!r} is not one of {', '.join(allowed)}")
        if not resource or len(resource) > RESOURCE_NAME_CHARS_MAX:
            raise BadRequest(f"ACL resource name must be 1-{RESOURCE_NAME_CHARS_MAX} characters")
        return cls(principal, permission, operation, rtype, resource, pattern)


class Acls:
    """The cluster's ACL entries and the decisions they give."""

    def __init__(self, entries=()):
        self.entries: set[Acl] = set(entries)
        self._decisions: dict[tuple, bool] = {}

    def add(self, acl: Acl) -> bool:
        if acl in self.entries:
            return False
        if len(self.entries) >= ACLS_MAX:
            raise BadRequest(f"the cluster already holds {ACLS_MAX} ACL entries; remove some "
                             "(prefixed entries cover many streams with one)")
        self.entries.add(acl)
        self._decisions.clear()
        return True

    def remove(self, acl: Acl) -> bool:
        if acl not in self.entries:
            return False
        self.entries.discard(acl)
        self._decisions.clear()
        return True

    def replace(self, entries) -> None:
        self.entries = set(entries)
        self._decisions.clear()

    def allowed(self, principal: Principal, operation: str, resource_type: str, name: str) -> bool:
        if principal.role == SUPER_ROLE:
            return True
        key = (principal.name, operation, resource_type, name)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decide(*key)
            if len(self._decisions) >= DECISIONS_CACHED_MAX:
                self._decisions.clear()
            self._decisions[key] = decision
        return decision

    def _decide(self, principal: str, operation: str, resource_type: str, name: str) -> bool:
        allowed = False
        for acl in self.entries:
            if acl.matches(principal, operation, resource_type, name):
                if acl.permission == "deny":
                    return False
                allowed = True
        return allowed

    def listing(self, principal: str | None = None, resource: str | None = None) -> list[list]:
        return [a.to_list() for a in sorted(self.entries)
                if (principal is None or a.principal == principal)
                and (resource is None or a.resource == resource)]

    def to_state(self) -> list[list]:
        return self.listing()

    def load(self, state) -> None:
        self.replace(Acl.parse(v) for v in state or [])
