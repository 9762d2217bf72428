"""Hostile control-plane messages: a seeded generator of malformed or forged requests for every
op of every daemon (issue 10, "Tests that must exist": the fuzz test).

A message is drawn as a *template* of the op (well-formed fields built from the live cluster's
state: its daemon ids, stream ids, epochs) and then broken by one *family* of hostility: a bad
envelope, fields of the wrong type, huge numbers, huge counts, unknown ids, forged ids of live
daemons, bogus addresses, zero-byte replicate writes with fresh keys, or bad payload frames.

What is NOT sent, because only authentication (a later issue: the trust boundary of
docs/DESIGN.md) can refuse it, not validation: an anonymous caller acting as the legitimate
member would, on live state:
  - `drop_replica` of a live replica (the broker's own retention does exactly this);
  - `replicate` to a live replica's key (the broker is its only writer; `reset` discards it);
  - `list_replicas` with `fence` naming a live or future epoch of a live broker (recovery does it);
  - `recovered` naming a live (broker id, epoch) (the new owner sends it);
  - `delete_stream`, and `alter_stream` with valid values, of the streams holding the data
    (administrative ops an operator may legitimately send), and a `rebalance` that is not a
    dry run (an operator's step: safe, but it moves the streamlets the test watches);
  - valid chunks with checksums to the streams holding the data (a producer may write).
Everything else, including a forged `register` or `heartbeat` of a live daemon id (issue 10
item 1: incarnation tokens refuse it), must be refused by validation and lose nothing.

Against a secure cluster the attacker holds a key (issue 37), and `Rights` says which of the acts
above its role may legitimately do: only those are still left out. A client key may do none of
them, so every one is sent, aimed at live state (live replicas, live epochs, the streams holding
the data) and must be refused; a broker key may still write and drop its own broker's replicas
and administer streams (for its Kafka listener), but fences and other brokers' replicas are sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack

from kera.codec import chunk

from kera.codec import wire

HUGE_INTS = [2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2**63, -(2**62)]
JUNK_VALUES = [None, True, False, 1.5, float("nan"), "", "x" * 300, "\u2603", b"\xff" * 9, [],
               {}, [1, "a"], {"a": None}, {"1": [None]}, -1, 2**64 - 1]
BOGUS_ADDRESSES = ["bad!host:1", "", ":", "host", "host:", "127.0.0.1:0", "127.0.0.1:65536",
                   "127.0.0.1:-5", "[::1", "::1:5", "a" * 290 + ":1", "h\u00e9st:10",
                   "127.0.0.1:80 ; rm", "tcp://127.0.0.1:9", "*:5555", "host name:12",
                   "127.0.0.1:1:2", "1.2.3.4.5:6", "\x00:1", "localhost:99999999999"]
# Hostile sizes stay inside the header limit (wire.MAX_HEADER_BYTES, 4 MiB), which is checked
# already: the point is what a daemon does with a header it admits.
LONG_LIST_ITEMS = 200_000          # ~1 MiB of small ints
BIG_MAP_KEYS = 60_000              # ~0.6 MiB of short keys
DEEP_NESTING = 90                  # under msgpack's default nesting limits: it decodes
STATS_EMPTY_MAPS = 400_000         # ~3.5 MiB: the "stats full of empty maps"
# Messages of the sizes above per run (each up to 4 MiB: packing and sending them is what costs
# the test its time); the other huge-count messages use the moderate sizes below.
HUGE_MESSAGES_MAX = 60
MODERATE_ITEMS = 5_000

# Fields of each op (docs/PROTOCOL.md), by role: which ones take daemon ids, which ints, etc.
COORDINATOR_OPS = {
    "register": ["kind", "address", "node", "daemon_id", "token", "cluster_id",
                 "stream_id_mark", "kafka_address"],
    "heartbeat": ["kind", "daemon_id", "token", "metadata_version", "epoch", "stats", "vsegs",
                  "held", "stream_id_mark", "acl_version", "consumed_at", "floors"],
    "cluster": [],
    "create_stream": ["name", "streamlets", "active_groups", "replication", "group_segments",
                      "segment_size_bytes", "durability", "replication_capacity",
                      "retention_ms", "retention_bytes", "retain_until_consumed"],
    "describe_stream": ["name"],
    "list_streams": ["after", "limit"],
    "delete_stream": ["name"],
    "alter_stream": ["name", "retention_ms", "retention_bytes", "retain_until_consumed",
                     "streamlets"],
    "rebalance": ["dry_run"],
    "broker_streams": ["broker_id"],
    "replicas": ["broker_id", "backup_id", "after", "limit"],
    "recovered": ["broker_id", "token", "epoch", "streamlets"],
    "deregister": ["kind", "daemon_id"],
    "recovery_status": [],
    "stats": [],
    "group_heartbeat": ["group", "member_id", "member_epoch", "streams", "pattern", "owned",
                        "instance_id", "session_timeout_ms"],
    "group_commit": ["group", "member_id", "member_epoch", "positions"],
    "group_offsets": ["group"],
    "group_list": [],
    "group_describe": ["group"],
    "group_reset": ["group", "streams", "positions"],
    "group_delete": ["group"],
    "acl_add": ["acls"],
    "acl_remove": ["acls"],
    "acl_list": ["principal", "resource"],
    "quota_set": ["principal", "produce_bytes_per_s", "fetch_bytes_per_s"],
    "quota_list": [],
    "kafka_offset_commit": ["group", "offsets"],
    "kafka_offset_fetch": ["group"],
    "kafka_offset_delete": ["group", "partitions"],
    "kafka_group_list": [],
    "txn_init": ["transactional_id", "timeout_ms", "producer_id", "epoch"],
    "txn_add_parts": ["transactional_id", "producer_id", "epoch", "parts"],
    "txn_add_positions": ["transactional_id", "producer_id", "epoch", "group", "positions",
                          "member_id", "member_epoch", "kafka"],
    "txn_end": ["transactional_id", "producer_id", "epoch", "commit"],
    "txn_verify": ["producer_id", "epoch", "part", "add"],
    "txn_resolve": ["producer_id", "epoch", "part"],
    "txn_describe": ["transactional_id"],
    "txn_list": [],
}
BROKER_OPS = {"produce": ["acks"], "fetch": ["reads"], "offsets": ["sid", "sl", "at"], "stats": [],
              "offsets_for_time": ["sid", "sl", "timestamp_us"],
              "offsets_for_number": ["sid", "sl", "number"],
              "numbers": ["sid", "sl", "timestamp_us"], "txn_markers": ["markers"]}
BACKUP_OPS = {
    "replicate": ["broker_id", "vlog", "vseg", "offset", "durability", "close", "reset"],
    "list_replicas": ["broker_id", "fence"],
    "read_replica": ["broker_id", "vlog", "vseg", "offset", "max_bytes", "streamlets"],
    "drop_replica": ["broker_id", "vlog", "vseg"],
    "stats": [],
}
OPS_BY_KIND = {"coordinator": COORDINATOR_OPS, "broker": BROKER_OPS, "backup": BACKUP_OPS}
LIST_FIELDS = {"vsegs", "floors", "held", "streamlets", "reads", "fence", "streams", "owned",
               "positions", "acls", "offsets", "partitions", "parts", "part", "markers"}
MAP_FIELDS = {"stats", "at"}

FAMILIES = ("envelope", "types", "huge_numbers", "huge_counts", "unknown_ids", "forged_ids",
            "bogus_address", "zero_byte_replicate", "payload")
# Ops a family changes nothing for are drawn with the "types" family instead.
UNKNOWN_ID = 7_777_777
# Request ids the "envelope" family gives its messages (1 to 4): a reply with one of these ids
# may answer a well-formed message of the same id as well.
ENVELOPE_IDS_MAX = 4


@dataclass(frozen=True)
class Rights:
    """Acts on live state the attacker's key may legitimately do, so the generator leaves them
    out (the module docstring's list). The default, an anonymous plaintext caller, is left out
    of all of them: nothing but authentication could tell its acts from the real member's."""
    replicas_of: frozenset | None = None   # brokers whose live replicas it may write or drop; None: all
    fence: bool = True                     # fence live or future incarnations of live brokers
    recovered: bool = True                 # report a live incarnation recovered
    rebalance: bool = True                 # move streamlets
    streams: bool = True                   # create, alter or delete the streams holding the data

    @property
    def anonymous(self) -> bool:
        return self == Rights()

    def owns_replicas_of(self, broker_id) -> bool:
        return self.replicas_of is None or broker_id in self.replicas_of


# A client key may do none of them: its role has no cluster op (kera.net.access) and no grant.
CLIENT_RIGHTS = Rights(frozenset(), fence=False, recovered=False, rebalance=False, streams=False)


def broker_rights(broker_id: int) -> Rights:
    """A broker key: its own broker's replicas, and stream administration (the Kafka
    listener's, docs/SECURITY.md); fences need the coordinator's token, `recovered` the
    incarnation's token, `rebalance` an operator's grant."""
    return Rights(frozenset({broker_id}), fence=False, recovered=False, rebalance=False,
                  streams=True)


class LiveState:
    """What the generator knows of the cluster it attacks (read before the barrage)."""

    def __init__(self, brokers: list[int], backups: list[int], epochs: dict[int, int],
                 protected_streams: dict[str, int], junk_stream_id: int, live_replicas: set,
                 dead_ports: list[int], rights: Rights = Rights(), cluster_id: str | None = None):
        self.brokers, self.backups, self.epochs = brokers, backups, epochs
        self.protected_streams = protected_streams          # name -> stream id
        self.junk_stream_id = junk_stream_id
        self.live_replicas = live_replicas                  # {(broker_id, vlog, vseg)}
        # Ports the test holds bound (on every address) and never listens on: an address made
        # of one reaches nobody, not even another test's daemon on this shared machine.
        self.dead_ports = dead_ports
        self.rights = rights
        self.cluster_id = cluster_id   # what a real member's `register` names


class HostileMessages:
    """`next(kind)` -> (op, family, frames): one hostile message for a daemon of that kind."""

    def __init__(self, rng: random.Random, live: LiveState, families=FAMILIES):
        self.rng, self.live, self.families = rng, live, tuple(families)
        self._req_id = 0
        self._big: dict[str, object] = {}
        self.huge_left = HUGE_MESSAGES_MAX
        self.last_id: int | None = None   # the id of the last message, unless its envelope is broken
        self.last_aimed = False           # whether it acts on live state (secure clusters only)

    # ---------------------------------------------------------------- entry point
    def next(self, kind: str, op: str) -> tuple[str, list]:
        family = self.rng.choice(self.families)
        fields = self.template(kind, op)
        self.last_id = None
        if family == "envelope":
            return family, [self.envelope(op, fields)]
        if family == "payload":
            return family, [self.header(op, fields), *self.frames(op)]
        breaker = getattr(self, f"_{family}")
        return family, [self.header(op, breaker(kind, op, fields))]

    def header(self, op: str, fields: dict) -> bytes:
        self._req_id += 1
        self.last_id = self._req_id
        self.last_aimed = not self.live.rights.anonymous and self.aimed(op, fields)
        return msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": op, "id": self._req_id, **fields},
                             use_bin_type=True)

    # ---------------------------------------------------------------- templates
    def template(self, kind: str, op: str) -> dict:
        """Well-formed fields of `op` that change nothing live (unknown ids, fresh keys)."""
        rng, live = self.rng, self.live
        broker = rng.choice(live.brokers)
        t = {
            "kind": rng.choice(["broker", "backup"]), "address": self._fresh_address(),
            "node": f"fuzz-{rng.randrange(1000)}", "daemon_id": UNKNOWN_ID + rng.randrange(100),
            "metadata_version": rng.randrange(1, 50), "epoch": rng.randrange(1, 50),
            # (no "streamlets" count here: the key is the list below, in every op using it)
            "name": f"fuzz-unknown-{rng.randrange(10**6)}", "active_groups": 1,
            "replication": 1, "group_segments": 1, "segment_size_bytes": 65536,
            "durability": "memory", "replication_capacity": 0, "retention_ms": 0,
            "retention_bytes": 0, "broker_id": UNKNOWN_ID, "backup_id": UNKNOWN_ID,
            "vlog": rng.randrange(4), "vseg": rng.randrange(1 << 32),   # epoch 0: never issued
            "offset": 0, "close": False, "reset": False, "max_bytes": 65536, "acks": True,
            "sid": live.junk_stream_id, "sl": 0, "fence": [2**40 + rng.randrange(100)],
            "reads": [[live.junk_stream_id, 0, {"low": 0, "offsets": {}}, 65536]],
            "streamlets": [[live.junk_stream_id, 0]], "stats": {"produced": 1},
            "vsegs": [[0, rng.randrange(1 << 32), [UNKNOWN_ID]]],
            "floors": [[live.junk_stream_id, 0, rng.randrange(1 << 32), [rng.randrange(1 << 40)]]],
            "held": [[UNKNOWN_ID, 1, 1, 1]],
            "token": rng.randbytes(16).hex(), "cluster_id": rng.randbytes(16).hex(),
            "stream_id_mark": rng.randrange(10), "limit": rng.randrange(1, 100),
            "after": [rng.randrange(3), rng.randrange(9), rng.randrange(1 << 32)],
            "group": f"fuzz-group-{rng.randrange(100)}", "member_id": "",
            "member_epoch": rng.choice([0, 0, 1, -1, -2]),
            "streams": [rng.choice(list(live.protected_streams) + ["fuzz-unknown"])],
            "pattern": rng.choice(["fuzz-.*", ".*", "[a-", "(a+)+$", "(a)\\1", "**" * 50]),
            "owned": [[rng.choice(list(live.protected_streams)), rng.randrange(4)]],
            "instance_id": f"fuzz-{rng.randrange(10)}", "session_timeout_ms": 1000,
            "positions": [[rng.choice(list(live.protected_streams)), rng.randrange(2),
                           [[rng.randrange(3), rng.randrange(100), None]]]],
            "acl_version": rng.randrange(-1, 5), "consumed_at": rng.randrange(-1, 5),
            "retain_until_consumed": rng.random() < 0.5, "dry_run": True,
            "at": {"low": 0, "offsets": {}},
            "timestamp_us": rng.choice([0, 1, 2**62, int(1.7e15)]),
            # ACLs and quotas: enforced only in secure clusters, so plaintext fuzz changes
            # nothing a client sees; they must be validated all the same.
            "acls": [[rng.choice(["fuzz", "*", "a/b"]), rng.choice(["allow", "deny", "maybe"]),
                      rng.choice(["read", "all", "fly"]), rng.choice(["stream", "group", "x"]),
                      f"fuzz-{rng.randrange(10)}", rng.choice(["literal", "prefixed"])]],
            "principal": rng.choice(["fuzz", "*", "", "a/b"]), "resource": "fuzz-1",
            "produce_bytes_per_s": rng.choice([0, 1, 2**40]),
            "fetch_bytes_per_s": rng.choice([0, 1, 2**40]),
            "number": rng.choice([0, 1, 2**64 - 2, 2**64 - 1, -1, "7"]),
            # Kafka groups' offsets: fuzz groups only, never a live group's
            "offsets": [[f"fuzz-{rng.randrange(10)}", rng.randrange(4),
                         rng.choice([0, 5, 2**63 - 1, -1]), rng.choice(["", "m" * 5000])]],
            "partitions": [[f"fuzz-{rng.randrange(10)}", rng.randrange(4)]],
            "kafka_address": self._fresh_address(),
            # Transactions: fuzz ids and random producer ids, which no live producer holds
            "transactional_id": f"fuzz-txn-{rng.randrange(100)}",
            "timeout_ms": rng.choice([1000, 60000, 0, 2**40]),
            "producer_id": rng.randrange(1, 2**55), "commit": rng.random() < 0.5,
            "add": rng.random() < 0.5, "kafka": rng.random() < 0.5,
            "parts": [[rng.choice(list(live.protected_streams)), rng.randrange(4)]],
            "part": [rng.choice(list(live.protected_streams)), rng.randrange(4)],
            # Markers of producer ids nothing holds open: a broker writes none of them
            "markers": [[f"fuzz-txn-{rng.randrange(100)}", rng.randrange(1, 2**55),
                         rng.randrange(5), rng.randrange(1, 9), rng.random() < 0.5,
                         rng.choice(list(live.protected_streams)), rng.randrange(4)]],
        }
        if op == "list_streams":
            t["after"] = f"fuzz-{rng.randrange(10**6)}"
        if kind == "broker" and op == "fetch" and rng.random() < 0.5:
            sid = rng.choice(list(live.protected_streams.values()))   # reads change nothing
            t["reads"] = [[sid, rng.randrange(2), {"low": 0, "offsets": {}}, 65536]]
        if kind == "backup" and op in ("replicate", "drop_replica", "read_replica"):
            t["broker_id"] = rng.choice([broker, UNKNOWN_ID + rng.randrange(3)])
        if op == "read_replica" and live.live_replicas and rng.random() < 0.5:
            t["broker_id"], t["vlog"], t["vseg"] = rng.choice(sorted(live.live_replicas))
        if op == "create_stream":
            t["name"] = f"fuzz-junk-{rng.randrange(10**9)}"
        if not live.rights.anonymous:
            self._aim_at_live_state(op, t)
            self._keep_protected_safe(kind, op, t)
        return {name: t[name] for name in OPS_BY_KIND[kind][op]}

    def _aim_at_live_state(self, op: str, t: dict) -> None:
        """Half the time, aim an act at live state (secure clusters only): its role, not
        validation, must refuse it; `_keep_protected_safe` then undoes what the key may do."""
        rng, live = self.rng, self.live
        if rng.random() < 0.5:
            return
        if op in ("replicate", "drop_replica") and live.live_replicas:
            t["broker_id"], t["vlog"], t["vseg"] = rng.choice(sorted(live.live_replicas))
        elif op == "list_replicas":
            t["broker_id"] = broker = rng.choice(live.brokers)
            epoch = live.epochs.get(broker, 0)
            t["fence"] = [epoch, epoch + 1, epoch + rng.randrange(2, 50)]
        elif op == "recovered":
            t["broker_id"], t["epoch"] = rng.choice(sorted(live.epochs.items()))
        elif op == "rebalance":
            t["dry_run"] = False
        elif op == "register" and live.cluster_id is not None:
            t["cluster_id"] = live.cluster_id   # a new daemon id, asked as a real member asks
        elif op in ("delete_stream", "alter_stream", "create_stream"):
            t["name"] = rng.choice(list(live.protected_streams))

    def aimed(self, op: str, fields: dict) -> bool:
        """Whether a message's final fields act on live state (the acts of the module
        docstring's list, and a `register` naming the cluster's id): only a key whose `Rights`
        allow the act may be answered `ok`."""
        live, get = self.live, fields.get
        if op in ("replicate", "drop_replica"):
            return any((get("broker_id"), get("vlog"), get("vseg")) == r for r in live.live_replicas)
        if op == "list_replicas":
            return get("broker_id") in live.brokers and isinstance(get("fence"), list) and \
                bool(get("fence"))
        if op == "recovered":
            return any((get("broker_id"), get("epoch")) == e for e in live.epochs.items())
        if op == "rebalance":
            return get("dry_run") is False
        if op in ("delete_stream", "alter_stream", "create_stream"):
            return any(get("name") == name for name in live.protected_streams)
        return op == "register" and live.cluster_id is not None and \
            get("cluster_id") == live.cluster_id

    def _fresh_address(self) -> str:
        """A valid address nobody answers at (a registered fake member is unreachable, as a
        crashed one), distinct most times: any loopback host, a port the test holds."""
        rng = self.rng
        host = f"127.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
        return f"{host}:{rng.choice(self.live.dead_ports)}"

    # ---------------------------------------------------------------- families
    def envelope(self, op: str, fields: dict) -> bytes:
        rng = self.rng
        choice = rng.randrange(9)
        if choice == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        if choice == 1:
            return msgpack.packb(rng.choice([[1, 2, 3], "op", 7, None, [{"op": op}]]))
        if choice == 2:
            return msgpack.packb({"v": rng.choice([0, 2, 255, 256, -1, "1", None]), "op": op, "id": 1})
        if choice == 3:
            return msgpack.packb({"v": 1, "op": rng.choice(["", "x" * 70, "nope", 5, None, ["stats"]]),
                                  "id": 2})
        if choice == 4:
            return msgpack.packb({"v": 1, "op": op, "id": rng.choice(["1", 1.5, None, [1], True]), **fields})
        if choice == 5:
            return msgpack.packb({"v": 1, "op": op, "id": rng.choice([2**64 - 1, -2**63, 0]), **fields})
        if choice == 6:
            return msgpack.packb({"v": 1, "op": op, **fields})          # no id at all
        if choice == 7:
            return msgpack.packb({1: 1, b"op": op, None: 2, "v": 1, "id": 3})  # keys of other types
        return msgpack.packb({"v": 1, "op": op, "id": 4, **fields})[:-1]  # truncated

    def _types(self, kind: str, op: str, fields: dict) -> dict:
        names = list(fields) or ["unexpected"]
        for name in self.rng.sample(names, self.rng.randint(1, len(names))):
            fields[name] = self.rng.choice(JUNK_VALUES)
        return self._keep_protected_safe(kind, op, fields)

    def _huge_numbers(self, kind: str, op: str, fields: dict) -> dict:
        ints = [n for n, v in fields.items() if isinstance(v, int) and not isinstance(v, bool)]
        if not ints:
            return self._types(kind, op, fields)
        for name in self.rng.sample(ints, self.rng.randint(1, len(ints))):
            fields[name] = self.rng.choice(HUGE_INTS)
        for name in ("reads", "vsegs", "floors", "held", "streamlets", "fence"):
            if name in fields:
                fields[name] = [[self.rng.choice(HUGE_INTS) for _ in range(4)]]
        if "reads" in fields and self.rng.random() < 0.5:
            fields["reads"] = [[self.live.junk_stream_id, 0,
                                {"low": self.rng.choice(HUGE_INTS),
                                 "offsets": {self.rng.choice(HUGE_INTS): self.rng.choice(HUGE_INTS)}},
                                self.rng.choice(HUGE_INTS)]]
        return self._keep_protected_safe(kind, op, fields)

    def _huge_counts(self, kind: str, op: str, fields: dict) -> dict:
        rng = self.rng
        shape = rng.choice(["list", "map", "deep", "stats"])
        name = rng.choice([n for n in fields if n in LIST_FIELDS | MAP_FIELDS] or list(fields) or ["extra"])
        huge = self.huge_left > 0 and rng.random() < 0.05
        self.huge_left -= huge
        if shape == "list":
            fields[name] = self._cached("list", lambda: list(range(LONG_LIST_ITEMS))) if huge else \
                [[rng.randrange(8)] * 4 for _ in range(MODERATE_ITEMS)]
        elif shape == "map":
            fields[name] = self._cached("map", lambda: {f"k{i}": i for i in range(BIG_MAP_KEYS)}) if huge \
                else {f"k{i}": {} for i in range(MODERATE_ITEMS)}
        elif shape == "deep":
            deep: object = 1
            for _ in range(DEEP_NESTING):
                deep = {"a": deep} if rng.random() < 0.5 else [deep]
            fields[name] = deep
        elif huge:
            fields[name] = self._cached("stats", lambda: {f"s{i}": {} for i in range(STATS_EMPTY_MAPS)})
        if op == "heartbeat" and huge and rng.random() < 0.5:   # big stats kept for a live member?
            fields.update(self._forged_member())
            fields["stats"] = self._cached("stats", lambda: {f"s{i}": {} for i in range(STATS_EMPTY_MAPS)})
        return self._keep_protected_safe(kind, op, fields)

    def _unknown_ids(self, kind: str, op: str, fields: dict) -> dict:
        rng = self.rng
        for name in ("broker_id", "backup_id", "daemon_id", "sid"):
            if name in fields:
                fields[name] = rng.choice([UNKNOWN_ID, 2**31 - 1, 2**32 - 1, 2**40, 0xDEAD])
        if "reads" in fields:
            fields["reads"] = [[rng.choice([2**40, UNKNOWN_ID]), rng.randrange(5000),
                                {"low": 0, "offsets": {}}, 65536]]
        if "name" in fields and op != "create_stream":
            fields["name"] = f"nobody-{rng.randrange(10**6)}"
        return fields

    def _forged_ids(self, kind: str, op: str, fields: dict) -> dict:
        """Claims of a live daemon's identity (issue 10 item 1)."""
        rng = self.rng
        if op == "register":
            fields.update(self._forged_member())
            fields["address"] = self._fresh_address()   # bogus ones: family "bogus_address"
        elif op == "heartbeat":
            fields.update(self._forged_member())
            fields["metadata_version"] = rng.choice([2**62, 2**63 - 1, 2**40, rng.randrange(1, 10**6)])
            if rng.random() < 0.5:
                fields["epoch"] = rng.choice([2**62, 0, rng.randrange(1, 1000)])
        elif op in ("broker_streams", "replicas", "list_replicas"):
            fields["broker_id"] = rng.choice(self.live.brokers)          # reads: harmless
            fields.pop("fence", None)
        elif op == "recovered":
            broker = rng.choice(self.live.brokers)
            fields["broker_id"] = broker
            fields["epoch"] = rng.choice([e for e in (0, 2**62, 2**63 - 1, rng.randrange(1, 10**6))
                                          if e != self.live.epochs.get(broker)])
        else:
            return self._types(kind, op, fields)
        return fields

    def _bogus_address(self, kind: str, op: str, fields: dict) -> dict:
        if op != "register":
            return self._types(kind, op, fields)
        fields["address"] = self.rng.choice(BOGUS_ADDRESSES + [self._fresh_address()])
        fields["kind"] = self.rng.choice(["broker", "backup"])
        fields.pop("daemon_id", None)
        return fields

    def _zero_byte_replicate(self, kind: str, op: str, fields: dict) -> dict:
        """Empty writes at offset 0 with fresh keys: each may create a replica (issue 10 item 4)."""
        if op != "replicate":
            return self._types(kind, op, fields)
        fields.update(offset=0, close=self.rng.random() < 0.3, reset=self.rng.random() < 0.5,
                      durability=self.rng.choice(["memory", "disk"]),
                      broker_id=self.rng.choice(self.live.brokers + [UNKNOWN_ID + self.rng.randrange(50)]),
                      vlog=self.rng.randrange(1 << 16), vseg=self.rng.randrange(1 << 32))
        return fields

    def _forged_member(self) -> dict:
        kind = self.rng.choice(["broker", "backup"])
        ids = self.live.brokers if kind == "broker" else self.live.backups
        return {"kind": kind, "daemon_id": self.rng.choice(ids)}

    def _keep_protected_safe(self, kind: str, op: str, fields: dict) -> dict:
        """Undo what would be a legitimate member's or admin's act on live state (the list in
        the module docstring): those need authentication, not validation, to refuse."""
        rights = self.live.rights
        key = (fields.get("broker_id"), fields.get("vlog"), fields.get("vseg"))
        if op in ("replicate", "drop_replica") and key in map(tuple, self.live.live_replicas) \
                and rights.owns_replicas_of(key[0]):
            fields["broker_id"] = UNKNOWN_ID
        if op == "list_replicas" and isinstance(fields.get("fence"), list) and rights.fence:
            fields["broker_id"] = UNKNOWN_ID
        if op == "recovered" and rights.recovered and \
                any(fields.get("broker_id") == b and fields.get("epoch") == e
                    for b, e in self.live.epochs.items()):
            fields["epoch"] = 0
        if op == "rebalance" and isinstance(fields.get("dry_run"), bool) and rights.rebalance:
            fields["dry_run"] = True
        if op in ("delete_stream", "alter_stream", "create_stream") and rights.streams and \
                any(fields.get("name") == name for name in self.live.protected_streams):
            fields["name"] = f"nobody-{self.rng.randrange(10**6)}"
        return fields

    def _cached(self, key: str, make):
        if key not in self._big:
            self._big[key] = make()
        return self._big[key]

    # ---------------------------------------------------------------- payload frames
    def frames(self, op: str) -> list[bytes]:
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0:
            return [b""] * rng.choice([1, 100, 8192, 8193])              # many empty frames
        if choice == 1:
            return [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))]
        good = self._chunk(rng.choice([self.live.junk_stream_id, 2**40, UNKNOWN_ID]))
        if choice == 2:                                                  # one byte flipped
            data = bytearray(good)
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            return [bytes(data)]
        if choice == 3:
            return [good[:rng.randrange(1, len(good))]]                 # truncated
        if choice == 4:
            return [good + b"\x00" * rng.randrange(1, 9)]               # trailing bytes
        return [good] * rng.randint(1, 3)                               # valid: junk stream or unknown

    def _chunk(self, stream_id: int) -> bytes:
        rng = self.rng
        return chunk.encode(rng.choice([rng.randrange(1 << 63), 0, 2**64 - 1]),
                            rng.choice([0, 1, 2**62, 2**63 - 1, rng.randrange(1 << 20)]),
                            stream_id, rng.choice([0, 1, 4095, 2**31]),
                            [b"junk"] * rng.randint(1, 4), timestamps=0)
