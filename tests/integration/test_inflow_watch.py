"""kera.net.inflow over real sockets, in one process: a connection sending a message of many
frames (each under the frame limit) is cut off at its daemon's message limit plus slack; one
pipelining many requests near the limit is not; closed connections are forgotten; one source
holds a bounded number of connections that send nothing."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kera.codec import wire
from kera.net import rpc
from kera.net.inflow import SILENT_GRACE_S, SILENT_PER_SOURCE_MAX, UNREAD_SLACK_BYTES
from kera.net.server import Server

MiB = 1024 * 1024
FRAME_LIMIT_BYTES = 1 * MiB   # below a chunk frame: the message limit is this too
WAIT_S = 10.0


@pytest.fixture
def server():
    srv = Server("inflow-test", frame_bytes_max=FRAME_LIMIT_BYTES)
    srv.on("echo", lambda req: {"frames": len(req.frames)})
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(5)


def dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    return sock


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_message_of_many_frames_under_the_frame_limit_is_cut_off(server):
    assert server.message_bytes_max == FRAME_LIMIT_BYTES
    unread_max = FRAME_LIMIT_BYTES + UNREAD_SLACK_BYTES
    sock = dealer(server.address)
    events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        frame = bytes(FRAME_LIMIT_BYTES - 1024)
        frames = 4 * unread_max // len(frame)
        sock.send_multipart([wire.request("echo", 1)] + [frame] * frames, copy=False)
        assert events.poll(int(WAIT_S * 1000)), "the connection was never cut"
        assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        assert not sock.poll(200), "the message was answered"
    finally:
        sock.disable_monitor()
        events.close(linger=0)
        sock.close()
    assert server.inflow.cut_total == 1
    assert rpc.call(server.address, "echo", timeout_s=5)[0]["frames"] == 0


def test_requests_near_the_limit_sent_back_to_back_are_all_served(server):
    frame = bytes(FRAME_LIMIT_BYTES // 2 - 1024)
    count = 3 * (FRAME_LIMIT_BYTES + UNREAD_SLACK_BYTES) // FRAME_LIMIT_BYTES   # 3x what it may hold
    with rpc.Connection(server.address, timeout_s=WAIT_S) as conn:
        ids = {conn.send("echo", {}, [frame, frame]) for _ in range(count)}
        while ids:
            header, _ = conn.recv()
            assert header["ok"] is True and header["frames"] == 2
            ids.discard(header["id"])
    assert server.inflow.cut_total == 0


def test_closed_connections_are_forgotten(server):
    socks = [dealer(server.address) for _ in range(20)]
    for i, sock in enumerate(socks):
        sock.send_multipart([wire.request("echo", i)])
        assert sock.poll(int(WAIT_S * 1000))
    wait_until(lambda: len(server.inflow.conns) >= 20, "20 connections watched")
    for sock in socks:
        sock.close()
    wait_until(lambda: not server.inflow.conns, "closed connections forgotten")


def test_a_source_holds_a_bounded_number_of_silent_connections(server):
    """Connections that never send anything (a handshake never finished) beyond
    SILENT_PER_SOURCE_MAX from one address are closed after SILENT_GRACE_S; the first ones stay
    (a plaintext daemon has no handshake timeout to close them), and the daemon serves on."""
    extra = 20
    silent = [socket.create_connection(server.address.rsplit(":", 1), timeout=WAIT_S)
              for _ in range(SILENT_PER_SOURCE_MAX + extra)]
    try:
        started = time.monotonic()
        wait_until(lambda: server.inflow.silent_closed_total >= extra,
                   f"{extra} silent connections closed")
        assert time.monotonic() - started < SILENT_GRACE_S + 2.0
        assert server.inflow.silent_closed_total == extra
        ended = [s for s in silent if ended_by_peer(s)]
        assert len(ended) == extra
        assert rpc.call(server.address, "echo", timeout_s=5)[0]["frames"] == 0
    finally:
        for s in silent:
            s.close()


def ended_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon closed this connection (after its zmq greeting, EOF or a reset)."""
    sock.setblocking(False)
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
