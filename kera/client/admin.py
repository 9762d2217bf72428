"""Admin client: create, describe, list and delete streams; look at the cluster and its counters.

    with Admin("127.0.0.1:7000") as admin:
        admin.create_stream("events", streamlets=4, replication=2)

Every call has a timeout and raises the KeraError the coordinator (or a daemon) replied with.
An Admin may be shared between threads (calls are serialized on one connection).
"""

from __future__ import annotations

import threading
import time

from kera import config

from kera.codec import cleanup
from kera.net import rpc

from kera.daemon import stream_traffic
from kera.client.coordinator_client import CoordinatorClient
from kera.net.coordinators import parse_addresses
from kera.errors import KeraError, Timeout

READY_POLL_S = 0.02          # between describe_stream calls while waiting for `ready`
STATS_TIMEOUT_S_MAX = 2.0    # per daemon: a dead daemon must not stall `stats` for long
# Pages one listing follows at most: far more than the coordinator's bounds can fill (10,000
# streams; 4096 brokers' replica maps at 20,000 entries a page), so only a coordinator whose
# cursor does not advance reaches it.
PAGES_MAX = 1_000_000
# `rebalance_all`: each step makes the spread of streamlets per broker strictly smaller, so a
# few steps balance any cluster kera targets; this only stops a coordinator that never settles.
REBALANCE_STEPS_MAX = 64
REBALANCE_POLL_S = 0.2       # between looks at a step in progress
DEFAULT_REBALANCE_TIMEOUT_S = 600.0   # all steps, their recoveries included


def parse_bootstrap(bootstrap: str) -> str:
    """The first coordinator's "host:port" of a bootstrap list (kera.net.coordinators)."""
    return parse_addresses(bootstrap)[0]


class Admin:
    def __init__(self, bootstrap: str, timeout_s: float = 10.0, key_file: str | None = None):
        """`key_file`: CURVE key (kera.net.keys) to connect with; None is $KERA_KEY_FILE, else
        plaintext."""
        self.bootstrap = parse_bootstrap(bootstrap)
        self.timeout_s = timeout_s
        self.key_file = key_file
        # The leader of the bootstrap list's coordinators (kera.client.coordinator_client).
        self._conn = CoordinatorClient(bootstrap, timeout_s=timeout_s, key_file=key_file)
        self._lock = threading.Lock()

    def _call(self, op: str, fields: dict | None = None, timeout_s: float | None = None) -> dict:
        with self._lock:
            header, _ = self._conn.call(op, fields, timeout_s=timeout_s)
        return header

    # ------------------------------------------------------------------ streams
    def create_stream(self, name: str, streamlets: int = config.DEFAULT_STREAMLETS,
                      active_groups: int = config.DEFAULT_ACTIVE_GROUPS,
                      replication: int = config.DEFAULT_REPLICATION,
                      group_segments: int = config.DEFAULT_GROUP_SEGMENTS,
                      segment_size_bytes: int = config.DEFAULT_SEGMENT_SIZE_BYTES,
                      durability: str = config.DEFAULT_DURABILITY,
                      replication_capacity: int = 0, wait_ready: bool = True,
                      retention_ms: int = 0, retention_bytes: int = 0,
                      retain_until_consumed: bool = False, cleanup_policy: str | None = None,
                      partitioner: str | None = None, **compaction) -> dict:
        """Create a stream and return its descriptor; with `wait_ready`, once every owning
        broker has picked it up (raises Timeout after `timeout_s`). `retention_ms` /
        `retention_bytes` (per streamlet): whole groups beyond them are deleted (0: keep).
        `retain_until_consumed`: by age only once every consumer group committed past them
        (kera.broker.retention). `cleanup_policy` "delete", "compact" or "compact,delete" and
        the `compaction` settings min_cleanable_dirty_ratio, delete_retention_ms,
        min_compaction_lag_ms, max_compaction_lag_ms (kera.codec.cleanup; None: default).
        `partitioner`: how clients that name none place keys, "crc32c" (None: the default) or
        "murmur2" (as Kafka's clients; kera.codec.partitioner); fixed for the stream's life."""
        deadline = time.monotonic() + self.timeout_s
        fields = {
            "name": name, "streamlets": streamlets, "active_groups": active_groups,
            "replication": replication, "group_segments": group_segments,
            "segment_size_bytes": segment_size_bytes, "durability": durability,
            "replication_capacity": replication_capacity}
        if retention_ms:
            fields["retention_ms"] = retention_ms
        if retention_bytes:
            fields["retention_bytes"] = retention_bytes
        if retain_until_consumed:
            fields["retain_until_consumed"] = True
        if partitioner is not None:
            fields["partitioner"] = partitioner
        fields.update(_cleanup_fields(cleanup_policy, compaction))
        stream = self._call("create_stream", fields)["stream"]
        if wait_ready:
            stream = self.wait_ready(name, deadline - time.monotonic(), stream)
        return stream

    def alter_stream(self, name: str, retention_ms: int | None = None,
                     retention_bytes: int | None = None, wait_ready: bool = True,
                     retain_until_consumed: bool | None = None,
                     streamlets: int | None = None, cleanup_policy: str | None = None,
                     **compaction) -> dict:
        """Change a stream's retention (None: leave as is, 0: no limit), cleanup policy and
        compaction settings (as for create_stream) or raise its streamlet count (never
        lowered; keys map over the new count from then on); returns the descriptor, with
        `wait_ready` once every owning broker applies it."""
        deadline = time.monotonic() + self.timeout_s
        fields: dict = {"name": name}
        if retention_ms is not None:
            fields["retention_ms"] = retention_ms
        if retention_bytes is not None:
            fields["retention_bytes"] = retention_bytes
        if retain_until_consumed is not None:
            fields["retain_until_consumed"] = retain_until_consumed
        if streamlets is not None:
            fields["streamlets"] = streamlets
        fields.update(_cleanup_fields(cleanup_policy, compaction))
        stream = self._call("alter_stream", fields)["stream"]
        if wait_ready:
            stream = self.wait_ready(name, deadline - time.monotonic(), stream)
        return stream


    def wait_ready(self, name: str, timeout_s: float | None = None, stream: dict | None = None) -> dict:
        """Poll until the stream's descriptor says `ready`; returns it, or raises Timeout."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        while stream is None or not stream.get("ready"):
            left = deadline - time.monotonic()
            if stream is not None:
                if left <= 0:
                    raise Timeout(f"stream '{name}' not ready within {budget:.1f} s: brokers "
                                  f"{sorted(set(stream.get('placement', [])))} have not "
                                  f"applied metadata version {stream.get('version')}")
                time.sleep(min(READY_POLL_S, left))
            stream = self.describe_stream(name)
        return stream

    def describe_stream(self, name: str) -> dict:
        return self._call("describe_stream", {"name": name})["stream"]

    def list_streams(self) -> list[dict]:
        """Every stream's descriptor, in name order (following the coordinator's pages)."""
        return self._pages("list_streams", {}, "streams")

    def _pages(self, op: str, fields: dict, key: str) -> list:
        """All items of a paginated listing: each reply's `next` is the following `after`."""
        out: list = []
        after = None
        for _ in range(PAGES_MAX):
            header = self._call(op, fields if after is None else {**fields, "after": after})
            out += header[key]
            cursor = header.get("next")
            if cursor is None:
                return out
            if after is not None and cursor <= after:
                raise KeraError(f"{op}: the coordinator's cursor {cursor!r} does not advance "
                                f"past {after!r}")
            after = cursor
        raise KeraError(f"{op}: more than {PAGES_MAX} pages")

    def delete_stream(self, name: str) -> None:
        self._call("delete_stream", {"name": name})

    # ------------------------------------------------------------------ cluster
    def cluster(self) -> dict:
        """{"brokers": [...], "backups": [...], "metadata_version": int, "cluster_id": str};
        each daemon as {"id", "address", "node", "alive"}."""
        header = self._call("cluster")
        return {k: header[k] for k in ("brokers", "backups", "metadata_version", "cluster_id")
                if k in header}

    def replicas(self, broker_id: int | None = None, backup_id: int | None = None) -> list[list]:
        """Which backups hold which virtual segments, as the brokers reported them:
        `[[broker_id, vlog, vseg, [backup ids]], ...]`, sorted; optionally only one broker's,
        or only the virtual segments one backup holds."""
        fields = {k: v for k, v in (("broker_id", broker_id), ("backup_id", backup_id))
                  if v is not None}
        return self._pages("replicas", fields, "replicas")

    def deregister(self, kind: str, daemon_id: int) -> dict:
        """Forget a dead broker or backup (`kind`): its id is never handed out again. Refused
        (bad_request, saying why) while it is alive or, for a broker, still owns streamlets
        or is a source of a streamlet being recovered. Returns the coordinator's reply."""
        return self._call("deregister", {"kind": kind, "daemon_id": daemon_id})

    def rebalance(self, dry_run: bool = False) -> dict:
        """One rebalance step (kera.coordinator.rebalance): the plan (`loads`, `broker` to
        hand over or None when balanced, `after`, `busy`), and unless `dry_run` the step
        started. Raises NotReady while a step is in progress."""
        return self._call("rebalance", {"dry_run": dry_run})

    def rebalance_all(self, timeout_s: float = DEFAULT_REBALANCE_TIMEOUT_S,
                      progress=lambda reply: None) -> list[dict]:
        """Steps until no step makes the spread smaller, each after the previous one's
        recovery; `progress(reply)` sees every plan looked at. Returns the steps' replies;
        raises Timeout (naming what is still in progress) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        steps: list[dict] = []
        while len(steps) < REBALANCE_STEPS_MAX:
            reply = self.rebalance(dry_run=True)
            progress(reply)
            if reply["busy"] is None and reply["broker"] is None:
                return steps
            if reply["busy"] is None:
                steps.append(self.rebalance())
                progress(steps[-1])
            elif time.monotonic() >= deadline:
                raise Timeout(f"rebalance not done within {timeout_s:.0f} s: {reply['busy']}")
            else:
                time.sleep(REBALANCE_POLL_S)
        raise Timeout(f"rebalance took {REBALANCE_STEPS_MAX} steps without settling")

    def stats(self) -> dict:
        """Counters of every live daemon: {"brokers": {id: stats}, "backups": {id: stats},
        "coordinator": stats}. A daemon that does not answer gets {"error": message}."""
        cluster = self.cluster()
        result: dict = {"brokers": {}, "backups": {}}
        per_daemon_s = min(self.timeout_s, STATS_TIMEOUT_S_MAX)
        for kind in ("brokers", "backups"):
            for member in cluster[kind]:
                if member["alive"]:
                    result[kind][member["id"]] = self._daemon_stats(member["address"], per_daemon_s)
        try:
            result["coordinator"] = self._call("stats")["stats"]
        except KeraError as err:
            result["coordinator"] = {"error": f"{err.code}: {err.message}"}
        return result

    def stream_traffic(self) -> dict:
        """Per stream, the traffic every live broker counted since it started, added up:
        {"streams": {name: {records_in, chunks_in, bytes_in, chunks_out, bytes_out}},
        "errors": {broker id: message}} (kera.daemon.stream_traffic)."""
        per_daemon_s = min(self.timeout_s, STATS_TIMEOUT_S_MAX)
        replies, errors = [], {}
        for member in self.cluster()["brokers"]:
            if not member["alive"]:
                continue
            try:
                header, _ = rpc.call(member["address"], "stats", timeout_s=per_daemon_s,
                                     key_file=self.key_file)
                replies.append(header.get("streams") or {})
            except KeraError as err:
                errors[member["id"]] = f"{err.code}: {err.message}"
        return {"streams": stream_traffic.summed(replies), "errors": errors}

    def _daemon_stats(self, address: str, timeout_s: float) -> dict:
        try:
            header, _ = rpc.call(address, "stats", timeout_s=timeout_s, key_file=self.key_file)
            return header.get("stats", {})
        except KeraError as err:
            return {"error": f"{err.code}: {err.message}"}

    # ------------------------------------------------------------------ access control
    def add_acls(self, entries) -> dict:
        """Add ACL entries, each [principal, allow|deny, operation, stream|group|cluster,
        name, literal|prefixed] (kera.net.acl); needs an admin key."""
        return self._call("acl_add", {"acls": [list(e) for e in entries]})

    def remove_acls(self, entries) -> dict:
        return self._call("acl_remove", {"acls": [list(e) for e in entries]})

    def list_acls(self, principal: str | None = None) -> list[list]:
        fields = {"principal": principal} if principal is not None else {}
        return self._call("acl_list", fields)["acls"]

    def set_quota(self, principal: str, produce_bytes_per_s: int | None = None,
                  fetch_bytes_per_s: int | None = None) -> dict:
        """Set a principal's (or '*', the default's) byte rates per broker (kera.net.quota);
        None leaves a rate as it is, 0 removes it. Returns every principal's rates."""
        fields: dict = {"principal": principal}
        for kind, rate in (("produce", produce_bytes_per_s), ("fetch", fetch_bytes_per_s)):
            if rate is not None:
                fields[f"{kind}_bytes_per_s"] = rate
        return self._call("quota_set", fields)["quotas"]

    def list_quotas(self) -> dict:
        return self._call("quota_list")["quotas"]

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cleanup_fields(policy: str | None, compaction: dict) -> dict:
    """The cleanup fields of a create or alter request (None values left out); TypeError for a
    setting kera does not know, as for any unknown keyword argument."""
    unknown = set(compaction) - set(cleanup.SETTINGS)
    if unknown:
        raise TypeError(f"unknown compaction settings {sorted(unknown)}; known: "
                        f"{', '.join(cleanup.SETTINGS)}")
    out = {k: v for k, v in compaction.items() if v is not None}
    if policy is not None:
        out["cleanup_policy"] = policy
    return out
