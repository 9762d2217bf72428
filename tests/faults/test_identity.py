"""Identity and deletion against real daemons: nothing a typo, a forged message, a pause or a
lost coordinator directory does makes a broker delete acknowledged records.

- a second broker or backup started with an id that is live is refused (`id_in_use`) and exits
  non-zero; the real one is not disturbed and keeps every stream and record;
- a heartbeat with a metadata version the coordinator never issued is refused and moves
  nothing; a later broker restart and crash lose no acknowledged R=2 record;
- a broker paused (SIGSTOP) longer than the dead window comes back with its R=1 records;
- a stream is dropped on its broker only when deleted; a coordinator restart drops nothing;
- a coordinator started on an empty directory next to a broker holding data stops with a
  message that says what to do, and the broker deletes nothing;
- stream ids are never reused after a coordinator restart, even from an older state file.
"""

from __future__ import annotations

import json
import shutil
import signal

import faultkit as fk
import pytest
from faultkit import call, wait_for

from kera import Producer

from kera.net import rpc
from kera.errors import BadRequest, IdInUse, KeraError
from kera.cli.local import Daemon, free_port

pytestmark = pytest.mark.timeout(300)

RECORDS = 2000
EXIT_WAIT_S = 60.0


def produce(cluster, stream: str, producer: int, start: int = 0, n: int = RECORDS) -> None:
    """Send `n` numbered records and flush: all acknowledged when this returns."""
    with Producer(cluster.bootstrap, request_timeout_s=3.0) as p:
        p.send_batch(stream, fk.values(producer, start, n))
        p.flush(60)


def check_all(cluster, stream: str, acked: list[int]) -> None:
    """Every acknowledged record of `stream` is read, exactly once."""
    read = fk.read_everything(cluster.bootstrap, stream, sum(acked))
    fk.check_exactly_once(read, acked, [set() for _ in acked], stream)


def log_text(daemon) -> str:
    return daemon.log_path.read_text(errors="replace")


def intruder(cluster, tmp_path, kind: str, daemon_id: int) -> Daemon:
    """A second process of `kind` asking for `daemon_id`, with a directory of its own."""
    port = free_port()
    args = [kind, "--coordinator", cluster.bootstrap, "--port", str(port), "--id",
            str(daemon_id), "--dir", str(tmp_path / f"intruder-{kind}")]
    d = Daemon(kind, daemon_id, port, args, tmp_path / f"intruder-{kind}.log")
    d.start(cluster.env)
    return d


def test_a_second_daemon_with_a_live_id_is_refused_and_the_real_one_keeps_everything(
        fresh_cluster, tmp_path):
    cluster = fresh_cluster(brokers=1, backups=2)
    with cluster.admin() as admin:
        admin.create_stream("r1", streamlets=2, replication=1)
        admin.create_stream("r2", streamlets=2, replication=2)
    produce(cluster, "r1", 0)
    produce(cluster, "r2", 1)
    broker = cluster.brokers[0]
    for kind, real in (("broker", broker), ("backup", cluster.backups[0])):
        other = intruder(cluster, tmp_path, kind, 0)
        assert other.wait(EXIT_WAIT_S) == 1, f"the second {kind} was not refused"
        text = log_text(other)
        assert "id_in_use" in text and f"{kind} id 0 is in use by a live {kind} at " \
            f"{real.address}" in text and "another --id" in text
        assert f"refused it to a second process at 127.0.0.1:{other.port}" in \
            log_text(cluster.coordinator)
    # The real daemons were not disturbed: no failover, nothing re-registered, all served.
    assert call(cluster.bootstrap, "recovery_status")["failed"] == []
    assert broker.running() and cluster.backups[0].running()
    with cluster.admin() as admin:
        assert {s["name"] for s in admin.list_streams()} == {"r1", "r2"}
    produce(cluster, "r1", 0, RECORDS)
    check_all(cluster, "r1", [2 * RECORDS])
    check_all(cluster, "r2", [0, RECORDS])


def test_a_forged_version_is_refused_and_no_r2_record_is_lost_after_restart_and_crash(
        fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=2)
    with cluster.admin() as admin:
        admin.create_stream("s", streamlets=4, replication=2)
    produce(cluster, "s", 0)
    before = call(cluster.bootstrap, "cluster")["metadata_version"]
    token = json.loads((cluster.data_dir / "broker-0" / "identity.json").read_text())["token"]
    forged = {"kind": "broker", "daemon_id": 0, "metadata_version": 2**62 - 5}
    with rpc.Connection(cluster.bootstrap, timeout_s=5.0) as conn:
        with pytest.raises(IdInUse):                  # without the token: not this broker's
            conn.call("heartbeat", forged)
        with pytest.raises(BadRequest, match="never issued"):
            conn.call("heartbeat", {**forged, "token": token})   # even with it
    after = call(cluster.bootstrap, "cluster")["metadata_version"]
    assert before <= after < 2**32
    state = json.loads((cluster.data_dir / "coordinator" / "coordinator.json").read_text())
    assert state["metadata_version"] < 2**32
    cluster.restart_broker(0)          # an ordinary restart (its identity from its --dir)
    produce(cluster, "s", 0, RECORDS)
    cluster.kill_broker(1)             # a later crash: its streamlets recover from backups
    check_all(cluster, "s", [2 * RECORDS])


def test_a_broker_paused_past_the_dead_window_keeps_its_r1_records(fresh_cluster):
    cluster = fresh_cluster(brokers=2, backups=1)
    with cluster.admin() as admin:
        admin.create_stream("r1", streamlets=2, replication=1)   # one streamlet per broker
        admin.create_stream("r2", streamlets=2, replication=2)
    produce(cluster, "r1", 0)
    produce(cluster, "r2", 1)
    broker = cluster.brokers[0]

    def alive() -> bool:
        return call(cluster.bootstrap, "cluster")["brokers"][0]["alive"]

    broker.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: not alive(), "the paused broker to be declared dead")
        # Its R=2 streamlets fail over to broker 1; its R=1 streamlet stays placed on it.
        wait_for(lambda: call(cluster.bootstrap, "recovery_status")["failed"],
                 "the paused broker to be failed over")
    finally:
        broker.signal(signal.SIGCONT)
    wait_for(alive, "the broker to be back")
    check_all(cluster, "r1", [RECORDS])
    check_all(cluster, "r2", [0, RECORDS])
    assert "unreplicated kept" in log_text(broker)


def test_a_stream_is_dropped_only_when_deleted_not_by_a_coordinator_restart(fresh_cluster):
    cluster = fresh_cluster(brokers=1)
    with cluster.admin() as admin:
        kept = admin.create_stream("kept", replication=1)
        gone = admin.create_stream("gone", replication=1)
    produce(cluster, "kept", 0)
    produce(cluster, "gone", 1)
    broker = cluster.brokers[0].address
    with cluster.admin() as admin:
        admin.delete_stream("gone")

    def dropped() -> bool:
        try:
            call(broker, "offsets", {"sid": gone["id"], "sl": 0})
        except Exception as err:   # noqa: BLE001 - the refusal is what we wait for
            return getattr(err, "code", None) == "unknown_stream"
        return False

    wait_for(dropped, "the deleted stream to be dropped on the broker")
    cluster.kill_coordinator()
    cluster.restart_coordinator()      # state intact: it keeps the stream and the tombstone
    assert call(broker, "offsets", {"sid": kept["id"], "sl": 0})["groups"]
    check_all(cluster, "kept", [RECORDS])
    assert f"(id {kept['id']}) deleted" not in log_text(cluster.brokers[0])


def test_a_coordinator_on_an_empty_directory_refuses_to_run_and_nothing_is_deleted(
        fresh_cluster):
    cluster = fresh_cluster(brokers=1, backups=1)
    with cluster.admin() as admin:
        admin.create_stream("r1", streamlets=2, replication=1)
        admin.create_stream("r2", streamlets=2, replication=2)
    produce(cluster, "r1", 0)
    produce(cluster, "r2", 1)
    meta = cluster.data_dir / "coordinator"
    cluster.kill_coordinator()
    shutil.move(meta, cluster.data_dir / "coordinator.saved")    # the directory is lost
    cluster.restart_coordinator(wait=False)
    assert cluster.coordinator.wait(EXIT_WAIT_S) == 1, "the coordinator ran on empty metadata"
    text = log_text(cluster.coordinator)
    assert "CRITICAL" in text and "metadata directory is empty or wrong" in text
    assert "restore DIR/coordinator.json" in text and "wipe the data directories" in text
    assert cluster.brokers[0].running() and cluster.backups[0].running()
    # Put the directory back: everything acknowledged is still there.
    shutil.rmtree(meta)
    shutil.move(cluster.data_dir / "coordinator.saved", meta)
    cluster.restart_coordinator()
    check_all(cluster, "r1", [RECORDS])
    check_all(cluster, "r2", [0, RECORDS])


def test_stream_ids_are_never_reused_after_a_coordinator_restart(fresh_cluster):
    cluster = fresh_cluster(brokers=1)
    with cluster.admin() as admin:
        first = admin.create_stream("a", replication=1)
        second = admin.create_stream("b", replication=1)
        admin.delete_stream("b")
    produce(cluster, "a", 0)
    identity = cluster.data_dir / "broker-0" / "identity.json"
    # The broker remembers the highest id it has seen (it reports it when it registers).
    wait_for(lambda: json.loads(identity.read_text())["stream_id_mark"] == second["id"],
             "the broker to persist its stream-id mark")
    cluster.kill_coordinator()
    cluster.restart_coordinator()
    with cluster.admin() as admin:
        third = admin.create_stream("b", replication=1)
    assert third["id"] > second["id"] > first["id"]
    check_all(cluster, "a", [RECORDS])


def test_an_older_coordinator_state_reuses_no_stream_id_and_deletes_nothing(fresh_cluster):
    cluster = fresh_cluster(brokers=1)
    metadata = cluster.data_dir / "coordinator"
    with cluster.admin() as admin:
        admin.create_stream("a", replication=1)
        # A backup copy of the metadata (snapshot and change log), taken now.
        old = {p.name: p.read_bytes() for p in metadata.iterdir() if p.is_file()}
        later = admin.create_stream("b", replication=1)
    produce(cluster, "a", 0)
    produce(cluster, "b", 1)
    identity = cluster.data_dir / "broker-0" / "identity.json"
    wait_for(lambda: json.loads(identity.read_text())["stream_id_mark"] == later["id"],
             "the broker to persist its stream-id mark")
    cluster.kill_coordinator()
    for p in metadata.iterdir():                 # the coordinator is restored from the copy
        if p.is_file():
            p.unlink()
    for name, data in old.items():
        (metadata / name).write_bytes(data)
    cluster.restart_coordinator()
    with cluster.admin() as admin:
        # "b" is unknown to the restored state, yet its id is not issued again: the broker
        # reported it when it registered.
        assert admin.create_stream("c", replication=1)["id"] > later["id"]
    check_all(cluster, "a", [RECORDS])
    # The broker kept "b" (no tombstone names it): held, not served (a dropped stream would
    # be `unknown_stream`), and nothing of it deleted.
    with pytest.raises(KeraError) as held:
        call(cluster.brokers[0].address, "offsets", {"sid": later["id"], "sl": 0})
    assert held.value.code == "not_owner"
    text = log_text(cluster.brokers[0])
    assert f"(id {later['id']}) deleted" not in text and "its data is kept" in text
