"""The coordinator's ACL ops and its record of which principal holds which daemon id, sans-IO.

ACL entries (kera.net.acl) are stored with the rest of the metadata (section `acls` of the state)
and carry a version of their own: a broker reports the version it holds in its heartbeat and
the reply carries the whole list when it is behind (ACLS_MAX entries pack well under the 4 MiB
header limit), so a grant or a deny reaches every broker within a heartbeat.

In a secure cluster a daemon id belongs to the principal that first registered it: another key
cannot register, heartbeat or deregister as that id (`bindings`), and backups learn the broker
bindings from their heartbeat replies to refuse replica ops a broker key makes for another id.
"""

from __future__ import annotations

from kera.net.acl import Acl, Acls
from kera.errors import NotAuthorized
from kera.net.keys import Principal, check_principal
from kera.net.quota import KINDS, Quotas

PRINCIPAL_FIELD = "principal"


class AccessState:
    """ACLs plus their version; bindings of daemon ids to principals live on the members."""

    def __init__(self):
        self.acls = Acls()
        self.quotas = Quotas()   # per-principal byte rates (kera.net.quota), delivered alike
        self.version = 0

    def add(self, acls: list[Acl]) -> int:
        changed = sum(self.acls.add(a) for a in acls)
        self.version += bool(changed)
        return changed

    def remove(self, acls: list[Acl]) -> int:
        changed = sum(self.acls.remove(a) for a in acls)
        self.version += bool(changed)
        return changed

    def for_heartbeat(self, held_version: int | None) -> dict:
        """What a broker's heartbeat reply carries: the list, if the broker's is stale."""
        if held_version is None or held_version == self.version:
            return {}
        return {"acl_version": self.version, "acls": self.acls.to_state(),
                "quotas": self.quotas.rates}

    def set_quota(self, principal: str, kind: str, bytes_per_s: int | None) -> None:
        self.quotas.set(principal, kind, bytes_per_s)
        self.version += 1

    def to_state(self) -> dict:
        return {"version": self.version, "entries": self.acls.to_state(),
                "quotas": self.quotas.rates}

    def load(self, state: dict | None) -> None:
        if state:
            self.version = int(state["version"])
            self.acls.load(state["entries"])
            self.quotas.replace(state.get("quotas", {}))


def check_binding(kind: str, member_id: int, bound: str | None, caller: Principal | None) -> None:
    """Refuse a caller whose key is not the one `kind` `member_id` was registered with."""
    if caller is None:
        return
    if caller.role != kind:
        raise NotAuthorized(f"principal {caller} cannot act as a {kind}: its key's role is "
                            f"{caller.role}")
    if bound is not None and bound != caller.name:
        raise NotAuthorized(f"principal {caller} cannot act as {kind} {member_id}: that id is "
                            f"bound to principal {bound!r}")


def check_one_id(kind: str, member_id: int, table: dict, caller: Principal | None) -> None:
    """Refuse a key that is bound to another `kind` id already: one daemon key is one daemon
    (a broker key registering ids at will could take ids meant for other brokers)."""
    if caller is None:
        return
    for other_id, member in table.items():
        if other_id != member_id and member.principal == caller.name:
            raise NotAuthorized(f"principal {caller} is {kind} {other_id} already and cannot "
                                f"register as {kind} {member_id}: give each {kind} a key of "
                                f"its own (kera keys create NAME --role {kind})")


def bound_id(table: dict, caller: Principal | None, otherwise: int) -> int:
    """The id in `table` bound to the caller's key, else `otherwise`."""
    if caller is not None:
        for member_id, member in table.items():
            if member.principal == caller.name:
                return member_id
    return otherwise


def _acls(f) -> list[Acl]:
    return [Acl.parse(v) for v in f.list("acls", [], 1000)]


def ops(access: AccessState, bump) -> dict:
    """Request handlers of the ACL ops: (Fields, now) -> reply. `bump` marks the metadata
    changed (persisted before the reply goes)."""
    def add(f, now):
        changed = access.add(_acls(f))
        if changed:
            bump()
        return {"changed": changed, "acl_version": access.version}

    def remove(f, now):
        changed = access.remove(_acls(f))
        if changed:
            bump()
        return {"changed": changed, "acl_version": access.version}

    def listing(f, now):
        principal = f.str(PRINCIPAL_FIELD, None, hi=255)
        if principal is not None and principal != "*":
            check_principal(principal)
        return {"acls": access.acls.listing(principal, f.str("resource", None, hi=255)),
                "acl_version": access.version}

    def set_quota(f, now):
        principal = f.str(PRINCIPAL_FIELD, hi=255)
        for kind in KINDS:
            rate = f.int(f"{kind}_bytes_per_s", None, lo=0, hi=2**62)
            if rate is not None:
                access.set_quota(principal, kind, rate or None)   # 0: remove
        bump()
        return {"quotas": access.quotas.rates, "acl_version": access.version}

    return {"acl_add": add, "acl_remove": remove, "acl_list": listing, "quota_set": set_quota,
            "quota_list": lambda f, now: {"quotas": access.quotas.rates}}
