"""The control-plane fuzz's attacker in a secure cluster (issue 37): what its key may do, and the
checks that it did no more.

The attacker is a key of the cluster's keys directory: `client` (no cluster op, no grant) or a
broker's (`broker-0`: a broker's cluster ops for its own id, stream administration for its
Kafka listener). After the barrage:
  - every `ok` reply answered an op the key's role may call (kera.net.access.RULES: the cluster
    has no ACL grant, so an ACL op's `ok` is a role exceeding its rights), and no act on live
    state the key may not do (hostile.HostileMessages.aimed) was answered `ok`;
  - a client key was refused with `not_authorized` or `bad_request` only (or `unknown_stream`
    for a stream id no stream has, or an `ok` whose every chunk or read was refused);
  - what the coordinator shows (members, streams, ACLs, quotas, groups, transactions) changed
    only where the key's role may change it.
"""

from __future__ import annotations

import re

import faultkit as fk
import hostile
from kera.net.access import RULES

# A reply whose every resource (produce's chunks, fetch's reads) was refused, and which carries
# no record bytes: a refusal in an `ok` envelope (the per-resource ops answer each one).
REFUSED_INSIDE = "ok, every resource refused"
# What a client key may be answered by an op it may not call. `unknown_stream`: an op naming a
# stream by an id no stream has (there is nothing to authorize).
CLIENT_REFUSALS = {"not_authorized", "bad_request", "unknown_stream", REFUSED_INSIDE}
# Appended to an op's name for a message acting on live state (hostile.HostileMessages.aimed):
# the generator leaves out what the key may do there, so any `ok` to one is a finding.
AIMED = "@live"
BROKER_KEY = re.compile(r"broker-(\d+)")


def role_of(key: str) -> str:
    return "broker" if BROKER_KEY.fullmatch(key) else key


def rights_of(key: str | None) -> hostile.Rights:
    """What the generator leaves out for this key (None: anonymous, plaintext)."""
    if key is None:
        return hostile.Rights()
    if key == "client":
        return hostile.CLIENT_RIGHTS
    match = BROKER_KEY.fullmatch(key)
    assert match, f"no fuzz rights for key {key!r}: add them here"
    return hostile.broker_rights(int(match.group(1)))


def refused_inside(header: dict, frames: list) -> bool:
    """Whether an `ok` reply refused each resource it answers for and holds no payload: a
    result is refused when it is an error (`[code, message, retriable]`), or starts with one."""
    results = header.get("results")
    if frames or not isinstance(results, list):
        return False
    return all(isinstance(r, list) and r and
               (isinstance(r[0], str) or isinstance(r[0], list) and r[0] and isinstance(r[0][0], str))
               for r in results)


def ok_by_op(replies) -> dict:
    return {f"{kind} {op}": n for (kind, op, code), n in sorted(replies.items()) if code == "ok"}


def aimed_by_code(replies) -> dict:
    """Replies to acts on live state, by (daemon kind, op, code)."""
    return {f"{kind} {op} {code}": n for (kind, op, code), n in sorted(replies.items())
            if op.endswith(AIMED)}


def may_call(role: str, op: str) -> bool:
    """Whether `role` may call `op` without an ACL grant (none exist in the fuzzed cluster)."""
    rule = RULES.get(op)
    if rule is None:
        return role == "admin"
    return rule.open or role in rule.roles


def view(cluster) -> dict:
    """What the coordinator shows an admin (the test's own key) of state an attacker could
    change."""
    members = fk.call(cluster.bootstrap, "cluster")
    streams = fk.call(cluster.bootstrap, "list_streams")["streams"]
    return {
        "members": {(kind, m["id"]): m["address"] for kind in ("brokers", "backups")
                    for m in members[kind]},
        "streams": {s["name"]: s for s in streams},
        "acls": fk.call(cluster.bootstrap, "acl_list")["acls"],
        "quotas": fk.call(cluster.bootstrap, "quota_list")["quotas"],
        "groups": fk.call(cluster.bootstrap, "group_list")["groups"],
        "kafka_groups": fk.call(cluster.bootstrap, "kafka_group_list")["groups"],
        "transactions": fk.call(cluster.bootstrap, "txn_list")["transactions"],
    }


def exceeded(key: str, replies, samples: dict, before: dict, after: dict,
             protected: tuple[str, ...]) -> list[str]:
    """Findings: what the key did, or was answered, beyond its role. `replies`: counts by
    (daemon kind, op, code); `samples`: the first reply of each."""
    role = role_of(key)
    problems = []
    for (kind, op, code), n in sorted(replies.items()):
        sample = samples.get((kind, op, code))
        if op == "?":
            continue   # a broken envelope's reply: what it did shows in the view, compared below
        if code == "ok" and op.endswith(AIMED):
            problems.append(f"{key}: {n} `ok` replies from the {kind} to {op!r}, an act on live "
                            f"state its role may not do; the first: {sample}")
        elif code == "ok" and not may_call(role, op.removesuffix(AIMED)):
            problems.append(f"{key}: {n} `ok` replies from the {kind} to {op!r}, which a "
                            f"{role} key may not call; the first: {sample}")
        elif role == "client" and code != "ok" and code not in CLIENT_REFUSALS:
            problems.append(f"{key}: {n} replies from the {kind} to {op!r} with code {code!r}, "
                            f"not one of {sorted(CLIENT_REFUSALS)}; the first: {sample}")
    return problems + changed(key, before, after, protected)


def changed(key: str, before: dict, after: dict, protected: tuple[str, ...]) -> list[str]:
    """The view's changes the key's role could not make. A broker key may register new ids
    (docs/SECURITY.md: an id belongs to the key that first registered it), create and delete
    streams, and use Kafka groups' offsets and transactions: only the rest is compared."""
    if role_of(key) == "client":
        compared = {part: (before[part], after[part]) for part in before}
    else:
        compared = {part: (before[part], after[part]) for part in ("acls", "quotas")}
        compared.update({f"stream {name!r}": (before["streams"].get(name),
                                              after["streams"].get(name)) for name in protected})
        compared.update({f"the address of {kind[:-1]} {i}": (address, after["members"].get((kind, i)))
                         for (kind, i), address in before["members"].items()})
    return [f"{key}: {what} changed: before {old!r}, after {new!r}"
            for what, (old, new) in compared.items() if old != new]


def ids_beyond_own(key: str, before: dict, after: dict) -> list[str]:
    """Daemon ids a broker key registered besides its own broker's: none, since one daemon key
    is one daemon (kera.coordinator.acl_ops.check_one_id)."""
    if role_of(key) != "broker":
        return []
    new = sorted(m for m in after["members"] if m not in before["members"])
    if not new:
        return []
    return [f"{key} registered {len(new)} daemon ids besides its own (kind, id): {new[:10]}"]
