"""The coordinator's metadata on a real etcd (kera.coordinator.etcd_store): the whole state
round-trips, a coordinator killed with -9 (its directory wiped too) comes back with its streams,
ACLs and group commits, a commit fenced by a newer claim is refused and changes nothing (and a
running coordinator fenced off stops), and a 3-member etcd that loses a member keeps serving.

Each test starts its own etcd (tests/etcd_cluster.py, the `etcd_cluster` fixture).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
import time

import pytest

from kera import Consumer, Producer

from kera.net import rpc
from kera.client.admin import Admin
from kera.coordinator.core import Coordinator
from kera.coordinator.etcd_client import ETCD_CALL_DEADLINE_S, EtcdClient, b64, parse_url
from kera.coordinator.leadership import LEADER_KEY
from kera.coordinator.etcd_store import EtcdStore, prefix_for
from kera.errors import Fenced, KeraError, NotReady, StreamExists, Timeout
from kera.cli.local import free_port

STREAMLETS = 2
SETTLE_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 15.0
REFUSAL_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 10.0      # one admin call while leadership moves; `until` asks again after it
ACL = ["alice", "allow", "read", "stream", "orders", "literal"]
_names = itertools.count()


def until(condition, what, timeout_s=SETTLE_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def register(c: Coordinator, kind: str, port: int) -> int:
    return c.handle("register", {"kind": kind, "address": f"127.0.0.1:{port}", "node": "n"},
                    0.0)["daemon_id"]


def busy_core() -> Coordinator:
    """A coordinator's core holding some of everything: members, streams, a replica map, an
    ACL and a consumer group's committed positions."""
    c = Coordinator(0.0)
    brokers = [register(c, "broker", 7100 + i) for i in range(2)]
    register(c, "backup", 7200)
    for name in ("orders", "clicks"):
        c.handle("create_stream", {"name": name, "streamlets": STREAMLETS}, 0.0)
    c.replica_map.report(brokers[0], [[0, v, [0]] for v in range(300)])   # > one transaction
    c.handle("acl_add", {"acls": [ACL]}, 0.0)
    joined = c.groups.heartbeat("g", "", 0, 0.0, streams=("orders",))
    c.groups.commit("g", joined["member_id"], joined["member_epoch"],
                    {("orders", 0): [[0, 7, None]]})
    return c


def stored_keys(url: str, name: str) -> dict:
    client = EtcdClient(parse_url(url))
    try:
        kvs, _ = client.read_prefix(prefix_for(name))
        return {k: v for k, v, _ in kvs}
    finally:
        client.close()


def coordinator_cluster(fresh_cluster, etcd, name: str, **kw):
    return fresh_cluster(brokers=1, backups=0, log_level="WARNING", extra_coordinator_args=[
        "--metadata", etcd.url, "--metadata-prefix", name], **kw)


def test_the_whole_state_round_trips_through_etcd(etcd_cluster):
    etcd = etcd_cluster(members=1)
    c = busy_core()
    store = EtcdStore.from_url(etcd.url, "roundtrip")
    assert store.load() is None, "an empty prefix is a first start"
    c.replica_map.take_journal()
    store.snapshot(c.to_state())
    c.handle("delete_stream", {"name": "clicks"}, 0.0)
    c.replica_map.report(1, [[1, 0, [0]]])
    assert store.commit(c.base_state(), c.replica_map.take_journal()) > 0
    store.close()

    again = EtcdStore.from_url(etcd.url, "roundtrip")
    state = again.load()
    assert state == c.to_state()
    restored = Coordinator(1.0, state=state)
    assert sorted(restored.streams) == ["orders"]
    assert restored.replica_map.entries() == c.replica_map.entries()
    assert restored.access.to_state() == c.access.to_state()
    assert restored.groups.to_state() == c.groups.to_state()
    keys = stored_keys(etcd.url, "roundtrip")
    assert "/kera/roundtrip/streams/orders" in keys and "/kera/roundtrip/meta/acls" in keys
    assert sum(k.startswith("/kera/roundtrip/replicas/0/") for k in keys) == 300
    again.close()


def test_a_commit_behind_a_newer_claim_is_refused_and_changes_nothing(etcd_cluster):
    etcd = etcd_cluster(members=1)
    c = busy_core()
    old = EtcdStore.from_url(etcd.url, "fence")
    old.load()
    c.replica_map.take_journal()
    old.snapshot(c.to_state())
    newer = EtcdStore.from_url(etcd.url, "fence")
    newer.load()                       # claims the fence: `old` holds a stale revision now
    before = stored_keys(etcd.url, "fence")
    c.handle("create_stream", {"name": "late", "streamlets": 1}, 0.0)
    c.replica_map.report(0, [[5, 5, [0]]])
    with pytest.raises(Fenced, match="taken over"):
        old.commit(c.base_state(), c.replica_map.take_journal())
    assert stored_keys(etcd.url, "fence") == before
    c.handle("delete_stream", {"name": "late"}, 0.0)   # `newer` still writes
    assert newer.commit(c.base_state(), []) > 0
    old.close()
    newer.close()


def test_a_coordinator_on_etcd_keeps_its_metadata_across_kill_9(etcd_cluster, fresh_cluster):
    """The coordinator's directory is wiped with the kill: what comes back is etcd's."""
    etcd = etcd_cluster(members=1)
    cluster = coordinator_cluster(fresh_cluster, etcd, "kill9")
    stream = f"orders-{next(_names)}"
    with cluster.admin() as admin:
        admin.create_stream(stream, streamlets=STREAMLETS)
        admin.add_acls([ACL])
    with Producer(cluster.bootstrap) as p:
        for i in range(100):
            p.send(stream, str(i).encode(), key=str(i).encode())
        p.flush()
    with Consumer(cluster.bootstrap, stream, group="g", auto_commit_interval_ms=None) as c:
        until(lambda: c.poll(timeout_s=0.05) is not None, "a record")
        c.commit()
    committed = group_positions(cluster, "g")
    assert committed, "the group committed positions"
    cluster.kill_coordinator()
    shutil.rmtree(cluster.data_dir / "coordinator")
    cluster.restart_coordinator()
    with cluster.admin() as admin:
        assert stream in [s["name"] for s in admin.list_streams()]
        assert ACL in admin.list_acls()
    assert group_positions(cluster, "g") == committed


def group_positions(cluster, group: str) -> list:
    return rpc.call(cluster.bootstrap, "group_offsets", {"group": group})[0]["positions"]


def test_a_fenced_coordinator_stands_by_and_leads_again(etcd_cluster, fresh_cluster):
    etcd = etcd_cluster(members=1)
    cluster = coordinator_cluster(fresh_cluster, etcd, "fenced")
    with cluster.admin() as admin:
        admin.create_stream("before-the-claim", streamlets=1)
    # Another coordinator took the leadership over (as after this one's lease ran out): the
    # leader key it guards its commits by moves on.
    leader_key = b64(prefix_for("fenced") + LEADER_KEY)
    taker = EtcdClient(parse_url(etcd.url))
    taker.txn([], [{"request_put": {"key": leader_key, "value": b64("127.0.0.1:1")}}])
    # Its next commit is refused: the one for this request, or, if a heartbeat's commit met the
    # fence first, that one (it stands by then and answers not_leader).
    with pytest.raises(KeraError) as refused:
        rpc.call(cluster.bootstrap, "create_stream", {"name": "after-the-claim", "streamlets": 1},
                 timeout_s=REFUSAL_TIMEOUT_S)
    assert refused.value.code in ("fenced", "not_leader", "timeout"), refused.value
    until(lambda: "the leader is 127.0.0.1:1" in standby_answer(cluster), "standing by")
    assert cluster.coordinator.running(), "a deposed coordinator stands by, it does not exit"
    assert "taken over by another coordinator" in cluster.coordinator.log_tail()
    assert "/kera/fenced/streams/after-the-claim" not in stored_keys(etcd.url, "fenced")
    # The other leader goes (its key deleted, as when its lease ends): this one leads again,
    # from what etcd holds.
    taker.txn([], [{"request_delete_range": {"key": leader_key}}])
    taker.close()
    with cluster.admin(timeout_s=CALL_TIMEOUT_S) as admin:
        until(lambda: created(admin, "after-leading-again"), "the broker back with the new leader",
              timeout_s=2 * SETTLE_TIMEOUT_S)
        assert {s["name"] for s in admin.list_streams()} == {"before-the-claim",
                                                             "after-leading-again"}


def created(admin, stream: str) -> bool:
    try:
        admin.create_stream(stream, streamlets=1)
    except (NotReady, Timeout):   # the brokers have not heartbeated to the new leader yet, or
        return False              # no reply in CALL_TIMEOUT_S (once, under a full run): ask again
    except StreamExists:          # only this test creates it: an attempt whose reply was lost did
        return True
    return True


def standby_answer(cluster) -> str:
    try:
        rpc.call(cluster.bootstrap, "list_streams", {}, timeout_s=REFUSAL_TIMEOUT_S)
    except KeraError as err:
        return err.message
    return "leading"


def test_a_three_member_etcd_losing_its_leader_keeps_serving(etcd_cluster, fresh_cluster):
    """The member lost is etcd's raft leader and the one the coordinator's client asks first:
    the client moves on to another member while the other two elect a leader."""
    etcd = etcd_cluster(members=3)
    leader = etcd.leader()
    cluster = fresh_cluster(brokers=1, backups=0, log_level="WARNING", extra_coordinator_args=[
        "--metadata", etcd.url_from(leader), "--metadata-prefix", "three"])
    with cluster.admin() as admin:
        admin.create_stream("before", streamlets=1)
    etcd.kill(leader)
    with cluster.admin() as admin:
        admin.create_stream("after", streamlets=1)
        admin.add_acls([ACL])
    cluster.kill_coordinator()
    cluster.restart_coordinator()
    with cluster.admin() as admin:
        assert {"before", "after"} <= {s["name"] for s in admin.list_streams()}
        assert ACL in admin.list_acls()


def test_a_coordinator_that_loses_etcd_stops(etcd_cluster, fresh_cluster):
    """With no etcd to write to, nothing is acknowledged and the coordinator stops (fail-stop,
    as on a disk error) once its etcd deadline passes."""
    etcd = etcd_cluster(members=1)
    cluster = coordinator_cluster(fresh_cluster, etcd, "lost")
    etcd.kill(0)
    with pytest.raises(KeraError):
        with cluster.admin() as admin:
            admin.create_stream("unstored", streamlets=1)
    assert cluster.coordinator.wait(ETCD_CALL_DEADLINE_S + EXIT_TIMEOUT_S) == 1
    assert "did not answer" in cluster.coordinator.log_tail()


START_TRIES_MAX = 3   # a port picked free can be taken before the coordinator binds it
ANSWER_WAIT_S = 2.0   # one ask of a starting coordinator; asked again until SETTLE_TIMEOUT_S


def _start_answering_coordinator(etcd, tmp_path) -> tuple[subprocess.Popen, int]:
    """`kera coordinator` on etcd in an empty working directory, once it answers; a start
    that exits (its port taken meanwhile) is retried on another port."""
    log = tmp_path / "coordinator.log"
    for _ in range(START_TRIES_MAX):
        port = free_port()
        with open(log, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "kera", "coordinator", "--port",
                                     str(port), "--metadata", etcd.url, "--metadata-prefix",
                                     "nodir"], cwd=tmp_path, stdout=logf, stderr=subprocess.STDOUT)
        # A loaded machine may take seconds to start the process and reach etcd: the admin
        # call waits as long as the other tests here give a coordinator to settle.
        try:
            with Admin(f"127.0.0.1:{port}", timeout_s=ANSWER_WAIT_S) as admin:
                until(lambda: proc.poll() is not None or _answers(admin),
                      "the coordinator answers")
        except AssertionError as err:
            proc.kill()
            raise AssertionError(f"{err}; its log:\n{log.read_text()[-3000:]}") from None
        if proc.poll() is None:
            return proc, port
    raise AssertionError(f"the coordinator exited {START_TRIES_MAX} times: {log.read_text()[-3000:]}")


def test_a_coordinator_on_etcd_needs_no_directory(etcd_cluster, tmp_path):
    etcd = etcd_cluster(members=1)
    proc, port = _start_answering_coordinator(etcd, tmp_path)
    try:
        with Admin(f"127.0.0.1:{port}", timeout_s=SETTLE_TIMEOUT_S) as admin:
            admin.add_acls([ACL])
        assert '"alice"' in stored_keys(etcd.url, "nodir")["/kera/nodir/meta/acls"]
    finally:
        proc.kill()
        proc.wait(EXIT_TIMEOUT_S)
    assert list(tmp_path.iterdir()) == [tmp_path / "coordinator.log"], "nothing else written"


def _answers(admin: Admin) -> bool:
    try:
        admin.cluster()
        return True
    except KeraError:
        return False
