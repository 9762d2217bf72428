"""Who may call which Kafka API on what: kera's ACLs and quotas applied to a SASL user.

Each API maps to kera's ACL operation on the resources it names (kera.net.acl: a topic is a
`stream`, a group a `group`, the cluster `cluster`), decided by the broker's own Guard, the
one that guards kera's protocol, so `kera acl` rules apply to both doors alike. As in Kafka,
a request naming several topics or groups is answered per entry: the refused ones get
TOPIC_AUTHORIZATION_FAILED or GROUP_AUTHORIZATION_FAILED (CLUSTER_AUTHORIZATION_FAILED for
the cluster) and the handler runs on the rest; listings (Metadata of every topic, ListGroups)
leave out what the user may not describe. The handler never sees a refused entry: the
request is narrowed before it runs and the refusals are added to its answer (`Call.amend`).

Quotas are Kafka's shape too: a Produce or Fetch over the user's byte rate is served, and its
answer carries throttle_time_ms, the wait until the user is back under its rate, which Kafka
clients honour before their next request to this broker (KIP-219).

An API missing from RULES is refused to all but admins (the connection is closed): a new API
is closed until it is classified here, as kera.net.access does for kera's ops.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from kio.schema.errors import ErrorCode

from kera.broker.kafka import sasl
from kera.broker.kafka.context import Call, Context
from kera.errors import NotAuthorized
from kera.net.acl import CLUSTER_NAME

log = logging.getLogger(__name__)

TOPIC_DENIED = ErrorCode.topic_authorization_failed
TXN_DENIED = ErrorCode.transactional_id_authorization_failed
GROUP_DENIED = ErrorCode.group_authorization_failed
CLUSTER_DENIED = ErrorCode.cluster_authorization_failed
# DescribeConfigs resource types (Kafka's ConfigResource.Type).
TOPIC_RESOURCE, BROKER_RESOURCE, BROKER_LOGGER_RESOURCE = 2, 4, 8
GROUP_KEY_TYPE = 0                  # FindCoordinator's key_type for a consumer group
TXN_KEY_TYPE = 1                    # ... for a transactional id


class Check:
    """One request's authorization: its principal, and how to narrow and amend it."""

    def __init__(self, ctx: Context, call: Call):
        self.ctx, self.call = ctx, call
        self.security = ctx.settings.security
        self.who = sasl.principal(call.conn)

    def allowed(self, operation: str, resource_type: str, name) -> bool:
        return isinstance(name, str) and \
            self.security.guard.acls.allowed(self.who, operation, resource_type, name)

    def why(self, operation: str, resource_type: str, name) -> str:
        try:
            self.security.guard.require(self.who, operation, resource_type, str(name))
        except NotAuthorized as err:
            return err.message
        return f"principal {self.who} may not {operation} {resource_type} {name!r}"

    def amend(self, fn: Callable[[dict], dict]) -> None:
        before = self.call.amend
        self.call.amend = fn if before is None else (lambda data: fn(before(data)))

    def narrow(self, field: str, keep: list, out: str, refused: list,
               run_empty: bool = False) -> bool:
        """Run the handler on `keep` only, and add `refused` to its answer's `out` list;
        when nothing is kept, answer now with the refusals (False: do not dispatch), unless
        the handler has more to say (`run_empty`: Metadata's brokers)."""
        self.amend(lambda data: {**data, out: [*(data.get(out) or ()), *refused]})
        if not keep and not run_empty:
            self.call.answer({})
            return False
        body = dataclasses.replace(self.call.body, **{field: tuple(keep)})
        self.call.req = dataclasses.replace(self.call.req, body=body)
        return True

    def split(self, field: str, name_of, permitted, out: str, refusal,
              run_empty: bool = False) -> bool:
        """Keep the entries of `field` whose name is `permitted`; the others get `refusal(entry)`
        in the answer's `out` list."""
        entries = getattr(self.call.body, field)
        if entries is None:
            return True
        keep, refused = [], []
        for entry in entries:
            if permitted(name_of(entry)):
                keep.append(entry)
            else:
                refused.append(refusal(entry))
        return True if not refused else self.narrow(field, keep, out, refused, run_empty)

    def refuse(self, code: ErrorCode, message: str, data: dict | None = None) -> bool:
        self.call.answer({"error_code": code, "error_message": message, **(data or {})})
        return False


def admit(ctx: Context, call: Call) -> bool:
    """Whether to dispatch `call` (perhaps narrowed); False when it is answered or closed."""
    if ctx.settings.security is None or sasl.principal(call.conn) is None:
        return True   # plaintext, or a login request (kera.broker.kafka.sasl.admit)
    rule = RULES.get(call.req.api_key)
    check = Check(ctx, call)
    if rule is None:
        if check.who.role == "admin":
            return True
        why = f"api key {call.req.api_key} is not open to Kafka clients"
        log.warning("kafka listener: closing %s (%s): %s", call.conn.peer, check.who, why)
        call.conn.close(why)
        return False
    return rule(check)


def may_create(ctx: Context, call: Call, topic: str) -> bool:
    """Whether the caller may create `topic` (a Metadata request's auto-creation)."""
    if ctx.settings.security is None or sasl.principal(call.conn) is None:
        return True
    return _may_create(Check(ctx, call), topic)


def _may_create(check: Check, topic) -> bool:
    return check.allowed("create", "cluster", CLUSTER_NAME) or \
        check.allowed("create", "stream", topic)


# ---------------------------------------------------------------------- topics and partitions
@dataclass(frozen=True)
class Partitioned:
    """Where a request lists its topics' partitions, and where its answer does."""
    operation: str
    field: str
    name: str
    parts: str
    index: str
    out: str
    out_name: str
    out_parts: str
    out_index: str


PRODUCE = Partitioned("write", "topic_data", "name", "partition_data", "index",
                      "responses", "name", "partition_responses", "index")
FETCH = Partitioned("read", "topics", "topic", "partitions", "partition",
                    "responses", "topic", "partitions", "partition_index")
LIST_OFFSETS = Partitioned("describe", "topics", "name", "partitions", "partition_index",
                           "topics", "name", "partitions", "partition_index")
OFFSET_COMMIT = Partitioned("read", "topics", "name", "partitions", "partition_index",
                            "topics", "name", "partitions", "partition_index")
DELETE_RECORDS = dataclasses.replace(LIST_OFFSETS, operation="delete")
OFFSET_DELETE = OFFSET_COMMIT    # Kafka: delete on the group, read on each topic


def _partitions(check: Check, spec: Partitioned, code: ErrorCode = TOPIC_DENIED,
                permitted=None, message: str | None = None) -> bool:
    def refusal(topic) -> dict:
        name = getattr(topic, spec.name)
        why = message or check.why(spec.operation, "stream", name)
        return {spec.out_name: name, spec.out_parts: [
            {spec.out_index: getattr(p, spec.index), "error_code": code, "error_message": why}
            for p in getattr(topic, spec.parts)]}
    permitted = permitted or (lambda name: check.allowed(spec.operation, "stream", name))
    return check.split(spec.field, lambda t: getattr(t, spec.name), permitted, spec.out, refusal)


def _produce(check: Check) -> bool:
    if check.call.body.acks == 0 and not all(
            check.allowed("write", "stream", t.name) for t in check.call.body.topic_data):
        why = "acks=0 Produce to a topic this user may not write (no answer to carry the error)"
        check.call.conn.close(why)   # as Kafka does: the client sees the connection go
        return False
    if not _partitions(check, PRODUCE):
        return False
    nbytes = sum(len(p.records or b"") for t in check.call.body.topic_data
                 for p in t.partition_data)
    # charged now: an acks=0 Produce has no answer to charge it in
    check.security.guard.quotas.charge(check.who.name, "produce", nbytes,
                                       check.ctx.clock.monotonic())
    _meter(check, "produce")
    return True


def _fetch(check: Check) -> bool:
    if not _partitions(check, FETCH):
        return False
    _meter(check, "fetch", lambda data: sum(
        len(p.get("records") or b"") for t in data.get("responses", ()) if isinstance(t, dict)
        for p in t.get("partitions", ()) if isinstance(p, dict)))
    return True


def _meter(check: Check, kind: str, size_of=None) -> None:
    """Charge the user's `kind` quota (`size_of(answer)` bytes, when the answer is what is
    metered); the answer's throttle_time_ms is then the user's debt at its rate."""
    quotas, name, clock = check.security.guard.quotas, check.who.name, check.ctx.clock

    def throttle(data: dict) -> dict:
        now = clock.monotonic()
        if size_of is not None:
            quotas.charge(name, kind, size_of(data), now)
        delay_ms = quotas.delay_ms(name, kind, now)
        if delay_ms:
            check.ctx.core.counters.add(f"quota_throttled_{kind}")
        return {**data, "throttle_time": delay_ms}
    check.amend(throttle)


def _list_offsets(check: Check) -> bool:
    return _partitions(check, LIST_OFFSETS)


def _delete_records(check: Check) -> bool:
    return _partitions(check, DELETE_RECORDS)


# ---------------------------------------------------------------------- groups
def _group(operation: str):
    def rule(check: Check) -> bool:
        group = check.call.body.group_id
        if check.allowed(operation, "group", group):
            return True
        return check.refuse(GROUP_DENIED, check.why(operation, "group", group))
    return rule


def _offset_commit(check: Check) -> bool:
    group = check.call.body.group_id
    if not check.allowed("read", "group", group):
        return _partitions(check, OFFSET_COMMIT, GROUP_DENIED, permitted=lambda name: False,
                           message=check.why("read", "group", group))
    return _partitions(check, OFFSET_COMMIT)


def _offset_delete(check: Check) -> bool:
    group = check.call.body.group_id
    if not check.allowed("delete", "group", group):
        return check.refuse(GROUP_DENIED, check.why("delete", "group", group))
    return _partitions(check, OFFSET_DELETE)


def _offset_fetch(check: Check) -> bool:
    body = check.call.body
    if hasattr(body, "groups"):   # v8: several groups
        return check.split("groups", lambda g: g.group_id,
                           lambda name: check.allowed("describe", "group", name), "groups",
                           lambda g: {"group_id": g.group_id, "error_code": GROUP_DENIED,
                                      "topics": []})
    if check.allowed("describe", "group", body.group_id):
        return True
    topics = [{"name": t.name, "partitions": [{"partition_index": i, "error_code": GROUP_DENIED}
                                              for i in t.partition_indexes]}
              for t in body.topics or ()]
    return check.refuse(GROUP_DENIED, check.why("describe", "group", body.group_id),
                        {"topics": topics})


def _find_coordinator(check: Check) -> bool:
    body = check.call.body
    key_type = getattr(body, "key_type", GROUP_KEY_TYPE)
    if key_type not in (GROUP_KEY_TYPE, TXN_KEY_TYPE):
        return True   # answered COORDINATOR_NOT_AVAILABLE by the handler
    kind, code = ("group", GROUP_DENIED) if key_type == GROUP_KEY_TYPE else \
        ("transactional_id", TXN_DENIED)
    denied = {"error_code": code, "node_id": -1, "host": "", "port": -1}
    if hasattr(body, "coordinator_keys"):   # v4
        return check.split("coordinator_keys", lambda k: k,
                           lambda k: check.allowed("describe", kind, k), "coordinators",
                           lambda k: {"key": k, **denied})
    if check.allowed("describe", kind, body.key):
        return True
    return check.refuse(code, check.why("describe", kind, body.key), denied)


# ---------------------------------------------------------------------- transactions
# Kafka's TransactionalId resource is kera's `transactional_id` ACL kind: write to use one
# (InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn), describe to
# see it (FindCoordinator, DescribeTransactions, ListTransactions).
def _may_use(check: Check, tid) -> bool:
    return check.allowed("write", "transactional_id", tid)


def _init_producer_id(check: Check) -> bool:
    tid = check.call.body.transactional_id
    if tid is None or _may_use(check, tid):
        return True
    return check.refuse(TXN_DENIED, check.why("write", "transactional_id", tid),
                        {"producer_id": -1, "producer_epoch": -1})


def _add_partitions(check: Check) -> bool:
    """All or nothing, as Kafka: a refused topic (or transactional id) refuses the request,
    the partitions not refused answered OPERATION_NOT_ATTEMPTED."""
    body = check.call.body
    use = _may_use(check, body.v3_and_below_transactional_id)
    codes = {t.name: TXN_DENIED if not use else ErrorCode.none if check.allowed(
        "write", "stream", t.name) else TOPIC_DENIED for t in body.v3_and_below_topics}
    if not any(codes.values()):
        return True
    check.call.answer({"results_by_topic_v3_and_below": [
        {"name": t.name, "results_by_partition": [
            {"partition_index": p,
             "partition_error_code": codes[t.name] or ErrorCode.operation_not_attempted}
            for p in t.partitions]} for t in body.v3_and_below_topics]})
    return False


def _txn_group(operation: str):
    """EndTxn (no group), AddOffsetsToTxn (read on the group too)."""
    def rule(check: Check) -> bool:
        body = check.call.body
        if not _may_use(check, body.transactional_id):
            return check.refuse(TXN_DENIED, check.why("write", "transactional_id",
                                                      body.transactional_id))
        group = getattr(body, "group_id", None)
        if group is None or check.allowed(operation, "group", group):
            return True
        return check.refuse(GROUP_DENIED, check.why(operation, "group", group))
    return rule


def _txn_offset_commit(check: Check) -> bool:
    tid = check.call.body.transactional_id
    if not _may_use(check, tid):
        return _partitions(check, OFFSET_COMMIT, TXN_DENIED, permitted=lambda name: False,
                           message=check.why("write", "transactional_id", tid))
    return _offset_commit(check)


def _describe_transactions(check: Check) -> bool:
    return check.split("transactional_ids", lambda t: t,
                       lambda t: check.allowed("describe", "transactional_id", t),
                       "transaction_states",
                       lambda t: {"transactional_id": t, "error_code": TXN_DENIED,
                                  "transaction_state": "", "topics": []})


def _list_transactions(check: Check) -> bool:
    check.amend(lambda data: {**data, "transaction_states": [
        t for t in data.get("transaction_states", ())
        if check.allowed("describe", "transactional_id", _field(t, "transactional_id"))]})
    return True


def _describe_groups(check: Check) -> bool:
    return check.split("groups", lambda g: g, lambda g: check.allowed("describe", "group", g),
                       "groups", lambda g: {"group_id": g, "error_code": GROUP_DENIED})


def _delete_groups(check: Check) -> bool:
    return check.split("groups_names", lambda g: g,
                       lambda g: check.allowed("delete", "group", g), "results",
                       lambda g: {"group_id": g, "error_code": GROUP_DENIED})


def _list_groups(check: Check) -> bool:
    if check.allowed("describe", "cluster", CLUSTER_NAME):
        return True
    check.amend(lambda data: {**data, "groups": [
        g for g in data.get("groups", ())
        if check.allowed("describe", "group", _field(g, "group_id"))]})
    return True


# ---------------------------------------------------------------------- topics, configs
def _metadata(check: Check) -> bool:
    """Every topic asked for (or, for a listing, every topic) the user may not describe is
    left out of the handler's answer; those it named come back TOPIC_AUTHORIZATION_FAILED.
    The handler always runs: the answer's brokers are for everyone."""
    check.amend(lambda data: {**data, "topics": [
        t for t in data.get("topics", ())
        if check.allowed("describe", "stream", _field(t, "name"))]})
    if check.call.body.topics is None:
        return True
    return check.split("topics", lambda t: t.name,
                       lambda n: check.allowed("describe", "stream", n), "topics",
                       lambda t: {"name": t.name, "error_code": TOPIC_DENIED, "partitions": [],
                                  "is_internal": False}, run_empty=True)


def _topic_change(operation: str, field: str, out: str, permitted=None):
    """A rule for CreateTopics, DeleteTopics and CreatePartitions: per topic, by name."""
    def rule(check: Check) -> bool:
        allow = permitted or (lambda c, n: c.allowed(operation, "stream", n))
        entries = field if hasattr(check.call.body, field) else "topic_names"   # DeleteTopics < v6
        return check.split(entries, lambda t: t if isinstance(t, str) else t.name,
                           lambda n: allow(check, n), out,
                           lambda t: _topic_refusal(check, operation, t))
    return rule


def _topic_refusal(check: Check, operation: str, entry) -> dict:
    name = entry if isinstance(entry, str) else entry.name
    return {"name": name, "error_code": TOPIC_DENIED,
            "error_message": check.why(operation, "stream", name)}


def _describe_configs(check: Check) -> bool:
    def permitted(resource) -> bool:
        kind, name = resource
        if kind == TOPIC_RESOURCE:
            return check.allowed("describe", "stream", name)
        if kind in (BROKER_RESOURCE, BROKER_LOGGER_RESOURCE):
            return check.allowed("describe", "cluster", CLUSTER_NAME)
        return True   # the handler answers what it does not know

    def refusal(r) -> dict:
        topic = r.resource_type == TOPIC_RESOURCE
        what = ("stream", r.resource_name) if topic else ("cluster", CLUSTER_NAME)
        return {"resource_type": r.resource_type, "resource_name": r.resource_name,
                "error_code": TOPIC_DENIED if topic else CLUSTER_DENIED,
                "error_message": check.why("describe", *what), "configs": []}
    return check.split("resources", lambda r: (r.resource_type, r.resource_name), permitted,
                       "results", refusal)


def _field(entry, name: str):
    return entry.get(name) if isinstance(entry, dict) else getattr(entry, name, None)


def _open(check: Check) -> bool:
    return True


# api key -> rule; each answers (or narrows) what the principal may not do.
RULES: dict[int, Callable[[Check], bool]] = {
    0: _produce,
    1: _fetch,
    2: _list_offsets,
    3: _metadata,
    8: _offset_commit,
    9: _offset_fetch,
    10: _find_coordinator,
    11: _group("read"),                     # JoinGroup
    12: _group("read"),                     # Heartbeat
    13: _group("read"),                     # LeaveGroup
    14: _group("read"),                     # SyncGroup
    15: _describe_groups,
    16: _list_groups,
    17: _open,                              # SaslHandshake (refused after the login)
    18: _open,                              # ApiVersions
    19: _topic_change("create", "topics", "topics", lambda c, n: _may_create(c, n)),
    20: _topic_change("delete", "topics", "responses"),
    21: _delete_records,
    22: _init_producer_id,                  # idempotent: open (writes are checked per Produce)
    24: _add_partitions,
    25: _txn_group("read"),                 # AddOffsetsToTxn
    26: _txn_group("read"),                 # EndTxn: no group, the transactional id only
    28: _txn_offset_commit,
    32: _describe_configs,
    36: _open,                              # SaslAuthenticate (refused after the login)
    37: _topic_change("alter", "topics", "results"),
    42: _delete_groups,
    47: _offset_delete,
    60: _open,                              # DescribeCluster: brokers, as Metadata gives
    65: _describe_transactions,
    66: _list_transactions,
}
