"""Bounds on hostile connections to secure daemons (kera.net.inflow), issue 37 items 3 and 9.

A client key sending one message of a header and many large frames (each under the daemon's
frame limit) to a coordinator, broker or backup is cut off once its connection holds about one
message's worth, instead of having all of it buffered by zmq (24 x 64 MiB frames raised a
daemon's peak memory by 1.5 GiB). The daemon's peak resident memory grows by at most its
message limit and what arrives between two checks, and it serves on. A host opening many
connections that never finish their CURVE handshake holds at most SILENT_PER_SOURCE_MAX of
them past SILENT_GRACE_S, well before the handshake interval closes them."""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kera.client.admin import Admin
from kera.codec import wire
from kera.consumer import Consumer
from kera.coordinator.server import COORDINATOR_FRAME_BYTES_MAX
from kera.net import rpc
from kera.net.inflow import SILENT_GRACE_S, SILENT_PER_SOURCE_MAX, UNREAD_SLACK_BYTES
from kera.net.keys import KEY_FILE_ENV
from kera.net.server import CURVE_HANDSHAKE_MS, message_bytes_max
from kera.producer import Producer
from tests.integration.test_inflow_watch import ended_by_peer

MiB = 1024 * 1024
# What arrives between two checks of a connection (kera.net.inflow.CHECK_INTERVAL_S, ~20 ms)
# at this VM's loopback rate, plus allocator slack: measured 5-40 MiB.
OVERSHOOT_BYTES = 96 * MiB
CUT_WAIT_S = 60.0   # 1.5 GiB through CURVE on a busy 2-core VM takes a few seconds
# daemon kind -> (frame bytes, frames): a broker's and a backup's frame limit is a chunk (64
# MiB), the coordinator's a header (4 MiB); each message is well over 4x the daemon's limit.
ATTACKS = {"broker": (64 * MiB, 24), "backup": (64 * MiB, 24),
           "coordinator": (COORDINATOR_FRAME_BYTES_MAX - MiB, 128)}


@pytest.fixture(scope="module")
def cluster(local_cluster):
    c = local_cluster(brokers=1, backups=1, secure=True, log_level="WARNING")
    os.environ.pop(KEY_FILE_ENV, None)   # every call below names its key
    return c


def daemon_of(cluster, kind: str):
    return {"broker": cluster.brokers[0], "backup": cluster.backups[0],
            "coordinator": cluster.coordinator}[kind]


def peak_reset(pid: int) -> int:
    """Reset the process's peak resident memory (VmHWM) to its current size; that size."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return status_bytes(pid)["VmRSS"]


def status_bytes(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rows = [line.split(":", 1) for line in f]
    return {k: int(v.split()[0]) * 1024 for k, v in rows if k in ("VmRSS", "VmHWM")}


def send_and_wait_for_cut(address: str, key_file: str, frame_bytes: int, frames: int) -> None:
    """Send header + `frames` frames of `frame_bytes` as the client key; return once the
    daemon has cut the connection (no reply comes)."""
    with rpc.Connection(address, key_file=key_file, timeout_s=10.0) as conn:
        events = conn.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            rpc_probe_connected(conn)
            big = memoryview(bytearray(frame_bytes))
            conn.sock.send_multipart([wire.request("stats", 1, {})] + [big] * frames, copy=False)
            assert events.poll(int(CUT_WAIT_S * 1000)), "the connection was never cut"
            assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            conn.sock.disable_monitor()
            events.close(linger=0)


def rpc_probe_connected(conn: rpc.Connection) -> None:
    """One ordinary request first: the CURVE handshake is done and the daemon answers."""
    try:
        conn.call("stats", {})
    except Exception as err:   # a client key may be refused `stats`: an answer all the same
        assert getattr(err, "code", None) == "not_authorized", err


@pytest.mark.parametrize("kind", list(ATTACKS))
def test_a_message_of_many_large_frames_is_cut_off_at_the_daemons_message_limit(cluster, kind):
    daemon = daemon_of(cluster, kind)
    frame_bytes, frames = ATTACKS[kind]
    frame_limit = COORDINATOR_FRAME_BYTES_MAX if kind == "coordinator" else wire.MAX_FRAME_BYTES
    limit = message_bytes_max(frame_limit)
    assert frame_bytes < frame_limit and frame_bytes * frames > 4 * limit
    before = peak_reset(daemon.pid)
    send_and_wait_for_cut(daemon.address, str(cluster.keys.client), frame_bytes, frames)
    grown = status_bytes(daemon.pid)["VmHWM"] - before
    assert grown < limit + UNREAD_SLACK_BYTES + OVERSHOOT_BYTES, \
        f"{kind} peak grew by {grown // MiB} MiB for a {frame_bytes * frames // MiB} MiB message"
    assert_serves_on(cluster, f"after-{kind}")


def assert_serves_on(cluster, name: str, count: int = 50) -> None:
    """Every daemon runs and a replicated stream takes and gives back records."""
    assert all(d.running() for d in cluster.daemons), cluster._tails()
    admin_key = str(cluster.keys.admin)
    with Admin(cluster.bootstrap, key_file=admin_key) as admin:
        admin.create_stream(name, streamlets=1, replication=2)
    values = [b"%s-%d" % (name.encode(), i) for i in range(count)]
    with Producer(cluster.bootstrap, key_file=admin_key) as p:
        p.send_batch(name, values)
        p.flush()
    got = []
    with Consumer(cluster.bootstrap, name, key_file=admin_key) as c:
        while len(got) < count:
            record = c.poll(10)
            assert record is not None, f"only {len(got)} of {count} records read back"
            got.append(record.value)
    assert sorted(got) == sorted(values)


@pytest.mark.parametrize("kind", ["coordinator", "broker"])
def test_one_host_holds_few_connections_that_never_finish_their_handshake(cluster, kind):
    daemon = daemon_of(cluster, kind)
    host, port = daemon.address.rsplit(":", 1)
    extra = 20
    started = time.monotonic()
    silent = [socket.create_connection((host, int(port)), timeout=5.0)
              for _ in range(SILENT_PER_SOURCE_MAX + extra)]
    try:
        deadline = started + SILENT_GRACE_S + 2.0
        assert deadline < started + CURVE_HANDSHAKE_MS / 1000   # not the handshake timeout
        ended: set[int] = set()
        while len(ended) < extra and time.monotonic() < deadline:
            ended |= {i for i, s in enumerate(silent) if i not in ended and ended_by_peer(s)}
            time.sleep(0.05)
        assert len(ended) == extra, f"{len(ended)} of the {extra} extra connections closed"
        assert_serves_on(cluster, f"after-silent-{kind}")
    finally:
        for s in silent:
            s.close()

