"""The coordinator daemon over real sockets: ops, persistence across kill -9, bad input."""

import os
import random
import time

import msgpack
import pytest
import zmq

from kera.net import rpc

from kera.codec import wire
from kera.client.admin import Admin
from kera.errors import BadRequest, NotReady, StreamExists, Timeout, UnknownStream
from kera.cli.local import LocalCluster


def wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def coordinator(tmp_path):
    """A coordinator alone (no brokers, no backups), fast heartbeats."""
    with LocalCluster(tmp_path, brokers=0, backups=0, heartbeat_interval_ms=50,
                      log_level="WARNING") as cluster:
        yield cluster


def test_ops_through_admin_with_fake_brokers(coordinator, fake_daemons):
    with Admin(coordinator.bootstrap, timeout_s=5) as admin:
        with pytest.raises(NotReady, match="no live broker"):
            admin.create_stream("s")
        b0 = fake_daemons(coordinator.bootstrap, address="127.0.0.1:7101", node="a")
        b1 = fake_daemons(coordinator.bootstrap, address="127.0.0.1:7102", node="b")
        fake_daemons(coordinator.bootstrap, "backup", address="127.0.0.1:7201", node="c")
        stream = admin.create_stream("s", streamlets=4, replication=2, durability="disk")
        assert stream["ready"] is True
        assert sorted(stream["placement"]) == [b0.id, b0.id, b1.id, b1.id]
        assert stream["brokers"] == {str(b0.id): "127.0.0.1:7101", str(b1.id): "127.0.0.1:7102"}
        with pytest.raises(StreamExists):
            admin.create_stream("s")
        with pytest.raises(NotReady, match="needs 2 live backups"):
            admin.create_stream("t", replication=3)
        with pytest.raises(BadRequest, match="streamlets"):
            admin.create_stream("t", streamlets=0)
        assert admin.describe_stream("s") == stream
        assert [s["name"] for s in admin.list_streams()] == ["s"]
        cluster = admin.cluster()
        assert [m["alive"] for m in cluster["brokers"] + cluster["backups"]] == [True] * 3
        # broker_streams is what brokers poll.
        with rpc.Connection(coordinator.bootstrap) as conn:
            reply, _ = conn.call("broker_streams", {"broker_id": b0.id})
        assert [s["name"] for s in reply["streams"]] == ["s"]
        admin.delete_stream("s")
        with pytest.raises(UnknownStream):
            admin.describe_stream("s")
        assert admin.list_streams() == []


def test_create_waits_for_ready_and_times_out(coordinator, fake_daemons):
    # A broker that never applies anything: the stream is created but never ready.
    fake_daemons(coordinator.bootstrap, applied_version=0)
    with Admin(coordinator.bootstrap, timeout_s=0.5) as admin:
        with pytest.raises(Timeout, match="not ready"):
            admin.create_stream("slow")
        assert admin.describe_stream("slow")["ready"] is False
        assert admin.create_stream("other", wait_ready=False)["ready"] is False


def test_silent_daemon_declared_dead(coordinator, fake_daemons):
    quiet = fake_daemons(coordinator.bootstrap, address="127.0.0.1:7101")
    with Admin(coordinator.bootstrap) as admin:
        assert admin.cluster()["brokers"][0]["alive"]
        quiet.stop()
        # 50 ms interval x 20 missed = 1 s allowance
        wait_for(lambda: not admin.cluster()["brokers"][0]["alive"], 5.0, "broker declared dead")
        with pytest.raises(NotReady):
            admin.create_stream("s")


def test_restart_after_kill_keeps_streams_and_identities(coordinator, fake_daemons):
    bootstrap = coordinator.bootstrap
    brokers = [fake_daemons(bootstrap, address=f"127.0.0.1:{7101 + i}", node=f"n{i}")
               for i in range(3)]
    backup = fake_daemons(bootstrap, "backup", address="127.0.0.1:7201", node="nb")
    with Admin(bootstrap, timeout_s=5) as admin:
        created = [admin.create_stream(f"s{i}", streamlets=i + 1, replication=2) for i in range(5)]
        admin.delete_stream("s4")
        before = {s["name"]: s for s in admin.list_streams()}
        version_before = admin.cluster()["metadata_version"]

    coordinator.kill_coordinator()
    coordinator.restart_coordinator(wait=False)
    coordinator.wait_coordinator()

    with Admin(bootstrap, timeout_s=5) as admin:
        after = {s["name"]: s for s in admin.list_streams()}
        strip = lambda d: {k: v for k, v in d.items() if k not in ("ready", "states")}  # live
        assert {n: strip(s) for n, s in after.items()} == {n: strip(s) for n, s in before.items()}
        cluster = admin.cluster()
        assert cluster["metadata_version"] > version_before
        assert [m["id"] for m in cluster["brokers"]] == [b.id for b in brokers]
        assert [m["address"] for m in cluster["backups"]] == ["127.0.0.1:7201"]
        # The fake daemons keep heartbeating under their ids: alive again, streams ready again.
        wait_for(lambda: all(m["alive"] for k in ("brokers", "backups")
                             for m in admin.cluster()[k]), 5, "daemons alive")
        wait_for(lambda: all(s["ready"] for s in admin.list_streams()), 5, "streams ready")
        # Ids are never reused, not even the deleted stream's.
        fresh = admin.create_stream("s4", replication=2)
        assert fresh["id"] > max(s["id"] for s in created)
        # A daemon registering again with its id and its token (which survived the restart)
        # keeps it; a new one gets a new id.
        with rpc.Connection(bootstrap) as conn:
            again = conn.call("register", {"kind": "broker", "address": "127.0.0.1:7101",
                                           "node": "n0", "daemon_id": brokers[0].id,
                                           "token": brokers[0].token})[0]["daemon_id"]
            new = conn.call("register", {"kind": "backup", "address": "127.0.0.1:7202",
                                         "node": "nb2"})[0]["daemon_id"]
        assert again == brokers[0].id and new == backup.id + 1
    assert os.path.exists(coordinator.data_dir / "coordinator" / "coordinator.json")


def test_fuzzed_frames_never_stop_the_coordinator(coordinator, fake_daemons):
    seed = int(os.environ.get("KERA_FUZZ_SEED", random.randrange(2**32)))
    print(f"fuzz seed {seed} (KERA_FUZZ_SEED={seed} reproduces)")
    rng = random.Random(seed)
    fake_daemons(coordinator.bootstrap, address="127.0.0.1:7101")
    with Admin(coordinator.bootstrap, timeout_s=5) as admin:
        # A name the fuzzer never produces, so no fuzzed delete_stream can hit it.
        admin.create_stream("kept-stream", streamlets=2)
        before = admin.describe_stream("kept-stream")

    messages = [fuzz_message(rng) for _ in range(3000)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{coordinator.bootstrap}")
    try:
        replies = 0
        for i, parts in enumerate(messages):
            sock.send_multipart(parts)
            # Keep a bounded window in flight; every message gets exactly one reply.
            while i + 1 - replies > 200:
                assert sock.poll(5000), "coordinator stopped answering"
                parse_reply(sock.recv_multipart())
                replies += 1
        while replies < len(messages):
            assert sock.poll(5000), f"only {replies} of {len(messages)} messages were answered"
            parse_reply(sock.recv_multipart())
            replies += 1
    finally:
        sock.close()

    assert coordinator.coordinator.running()
    with Admin(coordinator.bootstrap, timeout_s=5) as admin:
        after = admin.describe_stream("kept-stream")
        assert {k: after[k] for k in ("id", "placement", "streamlets")} == \
               {k: before[k] for k in ("id", "placement", "streamlets")}
        # No waiting for ready: the fuzzer may have registered brokers that never heartbeat.
        assert admin.create_stream("after-fuzz", wait_ready=False)["id"] > before["id"]
        admin.delete_stream("after-fuzz")
    # The metadata on disk is still loadable after whatever the fuzzer managed to change.
    coordinator.kill_coordinator()
    coordinator.restart_coordinator(wait=False)
    coordinator.wait_coordinator()
    with Admin(coordinator.bootstrap, timeout_s=5) as admin:
        assert admin.describe_stream("kept-stream")["id"] == before["id"]


def parse_reply(parts):
    assert len(parts) == 1
    header = wire.unpack_header(parts[0])
    assert header["v"] == 1 and isinstance(header["ok"], bool)
    if not header["ok"]:
        assert isinstance(header["code"], str) and isinstance(header["message"], str)
        assert header["code"] != "internal", header["message"]  # no unhandled exception


OPS = ["register", "heartbeat", "cluster", "create_stream", "describe_stream", "list_streams",
       "delete_stream", "broker_streams", "stats", "produce", "", "x" * 100]
FIELDS = ["kind", "address", "node", "daemon_id", "id", "metadata_version", "stats", "name", "streamlets",
          "active_groups", "replication", "group_segments", "segment_size_bytes", "durability",
          "replication_capacity", "broker_id", "v", "op"]


def fuzz_value(rng: random.Random, depth: int = 0):
    choice = rng.randrange(12)
    if choice == 0:
        return rng.choice([0, 1, -1, 2**63 - 1, 2**64 - 1, -(2**63), 4096, 4097, 256, 9])
    if choice == 1:
        return rng.randrange(-10, 10_000)
    if choice == 2:
        return rng.choice(["broker", "backup", "memory", "disk", "127.0.0.1:7000", "h:0",
                           ":1", "", "s", "x" * rng.randrange(200, 2000), "a b", "ü"])
    if choice == 3:
        return None
    if choice == 4:
        return rng.random() * 1e6
    if choice == 5:
        return rng.random() < 0.5
    if choice == 6:
        return os.urandom(rng.randrange(0, 64))
    if choice == 7 and depth < 3:
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if choice == 8 and depth < 3:
        keys = [rng.randrange(-5, 100), None, True, 1.5, str(rng.randrange(100))]
        return {rng.choice(keys): fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}
    return "".join(rng.choice("abcxyz0-_.") for _ in range(rng.randrange(0, 12)))


def fuzz_message(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(6)
    if kind == 0:  # garbage bytes
        parts = [os.urandom(rng.randrange(0, 300))]
    elif kind == 1:  # msgpack that is not a map
        parts = [msgpack.packb(fuzz_value(rng), use_bin_type=True)]
    else:  # a plausible request with random fields
        header = {"v": 1, "op": rng.choice(OPS), "id": rng.randrange(2**31)}
        for name in rng.sample(FIELDS, rng.randrange(0, len(FIELDS))):
            header[name] = fuzz_value(rng)
        if rng.random() < 0.1:
            header.pop(rng.choice(["v", "op", "id"]), None)
        try:
            packed = msgpack.packb(header, use_bin_type=True)
        except (TypeError, ValueError):
            packed = b"\x80"
        if kind == 2:  # truncated
            packed = packed[:rng.randrange(0, max(1, len(packed)))]
        parts = [packed]
    for _ in range(rng.choice([0, 0, 0, 1, 3])):
        parts.append(os.urandom(rng.randrange(0, 100)))
    return parts


def test_metrics_endpoint_and_clean_stop(tmp_path):
    from urllib.request import urlopen

    from kera.cli.local import free_port
    port = free_port()
    cluster = LocalCluster(tmp_path, brokers=0, log_level="WARNING",
                           extra_coordinator_args=["--metrics-port", str(port)])
    try:
        body = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "# TYPE kera_coordinator_metadata_version gauge" in body
        assert "kera_coordinator_streams 0.0" in body
        assert "kera_group_lag" not in body   # names groups: only with --metrics-stream-labels
    finally:
        cluster.stop()
    assert cluster.coordinator.proc.returncode == 0     # SIGTERM is a clean stop


def test_corrupt_metadata_refuses_to_start(tmp_path):
    from kera.cli.local import ClusterError
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "coordinator.json").write_text("{not json")
    with pytest.raises(ClusterError, match="not valid JSON"):
        LocalCluster(tmp_path, brokers=0, log_level="WARNING")
