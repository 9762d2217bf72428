"""The daemon shell's error boundary and message bounds, over real sockets."""

import logging
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kera.net import rpc

from kera.codec import wire
from kera.net import server as kera_server
from kera.errors import BadRequest, KeraError, NotOwner, PeerUnreachable, Timeout
from kera.net.server import DEFERRED, Server


@pytest.fixture
def server():
    srv = Server("test")
    deferred = []

    def echo(req):
        return {"echo": req.fields.int("x")}, [bytes(f.buffer) for f in req.frames]

    def boom(req):
        raise RuntimeError("unexpected")

    def refuse(req):
        raise NotOwner("not mine")

    def later(req):
        deferred.append(req)
        return DEFERRED

    def answer_deferred():
        while deferred:
            srv.reply(deferred.pop(), {"late": True})

    for op, fn in {"echo": echo, "boom": boom, "refuse": refuse, "later": later}.items():
        srv.on(op, fn)
    srv.after_batch.append(answer_deferred)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(5)


def test_replies_errors_and_deferred(server):
    with rpc.Connection(server.address, timeout_s=5) as conn:
        header, frames = conn.call("echo", {"x": 3}, [b"abc", b""])
        assert header["echo"] == 3 and [bytes(f.buffer) for f in frames] == [b"abc", b""]
        with pytest.raises(NotOwner):
            conn.call("refuse")
        with pytest.raises(BadRequest, match="unknown op"):
            conn.call("nope")
        with pytest.raises(BadRequest, match="must be an integer"):
            conn.call("echo", {"x": "3"})
        assert conn.call("later")[0]["late"] is True


def test_garbage_messages_never_stop_the_loop(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{server.address}")
    garbage = [[b""], [b"\x00\x01"], [wire.pack({"op": "echo"})], [wire.pack({"id": "x", "v": 1})],
               [wire.pack({"id": 1, "v": 99, "op": "echo"})], [wire.pack([1, 2])]]
    for parts in garbage:
        sock.send_multipart(parts)
    answered = 0
    while sock.poll(500):
        reply = wire.unpack_header(sock.recv_multipart()[0])
        assert reply["ok"] is False and reply["code"] == "bad_request"
        answered += 1
    assert answered == len(garbage)
    sock.close()
    with rpc.Connection(server.address, timeout_s=5) as conn:
        assert conn.call("echo", {"x": 1})[0]["echo"] == 1


def test_call_to_nothing_times_out():
    with rpc.Connection("127.0.0.1:1", timeout_s=0.2) as conn:
        with pytest.raises(Timeout):
            conn.call("echo", {"x": 1})


def test_a_daemon_gone_between_pollout_and_the_send_is_unreachable_not_a_zmq_error():
    """The race CI hit: a coordinator killed after POLLOUT said yes. zmq.Again escaped the
    request thread and killed the producer; it must be the Timeout every caller handles."""
    srv = Server("test")
    srv.on("echo", lambda req: ({"echo": req.fields.int("x")}, []))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    with rpc.Connection(srv.address, timeout_s=5) as conn:
        assert conn.call("echo", {"x": 1})[0]["echo"] == 1
        srv.stop()
        thread.join(5)
        deadline = time.monotonic() + 10
        while conn.sock.poll(0, zmq.POLLOUT):   # until zmq has seen the peer go
            assert time.monotonic() < deadline, "zmq still offers POLLOUT 10 s after the stop"
            time.sleep(0.01)
        with pytest.raises(PeerUnreachable, match="went away while echo was being sent"):
            conn._send_now("echo", [wire.request("echo", 7, {"x": 2})])


def test_peer_request_sent_before_the_connection_is_up_is_delivered(server):
    client = Server("client")
    replies = []
    try:
        # The very first request on a brand-new peer: the socket is not connected yet.
        client.peer(server.address).request("echo", {"x": 9}, [], 5.0,
                                            lambda h, f, e: replies.append((h, e)))
        deadline = time.monotonic() + 5
        while not replies and time.monotonic() < deadline:
            client.run_once()
        assert replies and replies[0][1] is None and replies[0][0]["echo"] == 9
        # A peer that never answers reports a timeout exactly once.
        client.peer("127.0.0.1:1").request("echo", {"x": 1}, [], 0.2, lambda h, f, e: replies.append((h, e)))
        while len(replies) < 2 and time.monotonic() < deadline:
            client.run_once()
        assert isinstance(replies[1][1], Timeout)
    finally:
        client.close()


def serve_in_thread(srv: Server) -> threading.Thread:
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    return thread


def test_unexpected_error_in_a_handler_stops_the_server_with_its_stack(caplog):
    srv = Server("buggy")
    srv.on("echo", lambda req: {"echo": req.fields.int("x")})
    srv.on("boom", lambda req: 1 / 0)
    thread = serve_in_thread(srv)
    with caplog.at_level(logging.CRITICAL, logger="kera.net.server"):
        with rpc.Connection(srv.address, timeout_s=5) as conn:
            assert conn.call("echo", {"x": 1})[0]["echo"] == 1
            with pytest.raises(KeraError, match="internal error in buggy, which is stopping: "
                                                "ZeroDivisionError"):
                conn.call("boom")
        thread.join(5)
    assert not thread.is_alive(), "the server went on serving after a bug"
    assert isinstance(srv.failure, ZeroDivisionError)
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert "stopping (this is a bug)" in record.getMessage()
    assert record.exc_info and "1 / 0" in caplog.text   # the stack is in the log


@pytest.mark.parametrize("where", ["timer", "after_batch", "peer_callback"])
def test_unexpected_error_outside_handlers_stops_the_server(where, server, caplog):
    srv = Server("buggy")
    srv.on("ping", lambda req: {})

    def bug(*args):
        raise AssertionError(f"broken state in {where}")

    if where == "timer":
        srv.every(0.01, bug)
    elif where == "after_batch":
        srv.after_batch.append(bug)
    thread = serve_in_thread(srv)
    conn = rpc.Connection(srv.address, timeout_s=5)
    if where == "after_batch":
        conn.send("ping")   # its reply may be discarded as the server stops
    elif where == "peer_callback":
        srv.peer(server.address).request("echo", {"x": 1}, [], 5.0, bug)
    thread.join(5)
    conn.close()
    assert not thread.is_alive()
    assert isinstance(srv.failure, AssertionError)
    assert f"broken state in {where}" in caplog.text


def test_kera_error_in_a_timer_is_logged_and_the_server_serves_on(caplog):
    srv = Server("daemon")
    srv.on("ping", lambda req: {})
    ticks = []

    def refused():
        ticks.append(1)
        raise NotOwner("expected now and then")

    srv.every(0.01, refused)
    thread = serve_in_thread(srv)
    try:
        deadline = time.monotonic() + 5
        while len(ticks) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ticks) >= 3 and srv.failure is None
        rpc.call(srv.address, "ping", timeout_s=5)
    finally:
        srv.stop()
        thread.join(5)


# A real daemon process with an injected bug in its request handling: its run() must return
# non-zero, and its log must hold the stack.
BUGGY_COORDINATOR = """
import sys
from kera.coordinator import core, server
def handle(self, op, fields, now, principal=None):
    raise AssertionError("injected bug in " + op)
core.Coordinator.handle = handle
parser = server.argparse.ArgumentParser()
server.add_arguments(parser)
sys.exit(server.run(parser.parse_args(sys.argv[1:])))
"""


def test_a_daemon_whose_handler_raises_unexpectedly_exits_non_zero_with_the_stack(tmp_path):
    from kera.cli.local import free_port
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", BUGGY_COORDINATOR, "--dir", str(tmp_path),
                             "--port", address.rsplit(":", 1)[1]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The client hears the internal error, or times out if the process ended first.
        with pytest.raises(KeraError):
            rpc.call(address, "list_streams", timeout_s=10)
        _, log_text = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "CRITICAL" in log_text and "Traceback" in log_text
    # The frames of the stack, down to the injected bug (source lines of `-c` code are not shown).
    assert "AssertionError: injected bug in list_streams" in log_text
    assert "in _dispatch" in log_text and 'File "<string>", line 5, in handle' in log_text


def test_a_peer_address_zmq_rejects_fails_its_requests_instead_of_raising():
    client = Server("client")
    errors = []
    try:
        client.peer("bad!host:1").request("echo", {}, [], 5.0, lambda h, f, e: errors.append(e))
        assert errors == []   # never from inside request(): callers do not expect re-entry
        client.run_once(0)
        assert len(errors) == 1 and isinstance(errors[0], PeerUnreachable)
        assert client.failure is None
    finally:
        client.close()


def test_peers_are_bounded_least_recently_used_idle_one_closed(monkeypatch, server):
    monkeypatch.setattr(kera_server, "PEERS_MAX", 8)
    client = Server("client")
    replies = []
    try:
        busy = client.peer(server.address)
        busy.request("later", {}, [], 30.0, lambda h, f, e: replies.append(e))
        for port in range(20):
            client.peer(f"127.0.0.1:{40000 + port}")
            assert len(client.peers) <= 8
        assert client.peers.get(server.address) is busy   # busy: never closed for room
        deadline = time.monotonic() + 5
        while not replies and time.monotonic() < deadline:
            client.run_once()
        assert replies == [None]
    finally:
        client.close()


def test_peer_is_refused_when_every_connection_is_busy(monkeypatch, server):
    monkeypatch.setattr(kera_server, "PEERS_MAX", 2)
    client = Server("client")
    errors = []
    try:
        for port in (40001, 40002):
            client.peer(f"127.0.0.1:{port}").request("echo", {}, [], 30.0, lambda h, f, e: None)
        client.peer(server.address).request("echo", {"x": 1}, [], 30.0,
                                            lambda h, f, e: errors.append(e))
        client.run_once(0)
        assert len(errors) == 1 and isinstance(errors[0], PeerUnreachable)
        assert "busy" in errors[0].message
    finally:
        client.close()


def test_drop_peer_fails_its_pending_requests_once(server):
    client = Server("client")
    errors = []
    try:
        client.peer("127.0.0.1:1").request("echo", {}, [], 30.0, lambda h, f, e: errors.append(e))
        client.drop_peer("127.0.0.1:1")
        assert "127.0.0.1:1" not in client.peers
        assert len(errors) == 1 and isinstance(errors[0], Timeout)
    finally:
        client.close()


def raw_socket(address: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    return sock


def test_message_over_the_frame_count_is_refused_once_and_the_server_serves_on(server):
    sock = raw_socket(server.address)
    try:
        sock.send_multipart([wire.request("echo", 7, {"x": 1})] + [b"x"] * (wire.MAX_FRAMES + 50))
        assert sock.poll(5000)
        reply = wire.unpack_header(sock.recv_multipart()[0])
        assert reply["ok"] is False and reply["id"] == 7 and reply["code"] == "bad_request"
        assert "over the limit" in reply["message"]
        assert not sock.poll(300)   # one error for the whole message, not one per frame
    finally:
        sock.close()
    assert rpc.call(server.address, "echo", {"x": 2}, timeout_s=5)[0]["echo"] == 2


def test_message_over_the_byte_limit_is_refused(monkeypatch, server):
    monkeypatch.setattr(wire, "MESSAGE_BYTES_MAX", 1000)
    sock = raw_socket(server.address)
    try:
        sock.send_multipart([wire.request("echo", 8, {"x": 1})] + [b"y" * 300] * 5)
        assert sock.poll(5000)
        reply = wire.unpack_header(sock.recv_multipart()[0])
        assert reply["ok"] is False and reply["id"] == 8 and "1000 bytes" in reply["message"]
        sock.send_multipart([wire.request("echo", 9, {"x": 1})] + [b"y" * 300] * 3)
        assert sock.poll(5000)
        reply = wire.unpack_header(sock.recv_multipart()[0])
        assert reply["ok"] is True and reply["id"] == 9
    finally:
        sock.close()


def test_header_with_too_many_containers_is_refused(server):
    sock = raw_socket(server.address)
    try:
        header = wire.pack({"v": 1, "op": "echo", "id": 5, "x": 1,
                            "junk": [[{}] * 50_000, [{}] * 50_001]})
        sock.send_multipart([header])
        assert sock.poll(5000)
        reply = wire.unpack_header(sock.recv_multipart()[0])
        assert reply["ok"] is False and "maps and arrays" in reply["message"]
    finally:
        sock.close()


def test_close_idle_peers_keeps_the_named_and_the_busy(server):
    client = Server("client")
    try:
        client.peer("127.0.0.1:40001")
        client.peer("127.0.0.1:40002").request("echo", {}, [], 30.0, lambda h, f, e: None)
        client.peer(server.address)
        client.close_idle_peers(keep={server.address})
        assert set(client.peers) == {"127.0.0.1:40002", server.address}
    finally:
        client.close()


def test_nothing_runs_after_a_bug():
    srv = Server("buggy")
    ran = []
    srv.on("boom", lambda req: 1 / 0)
    srv.on("echo", lambda req: ran.append("handler") or {})
    srv.after_batch.append(lambda: ran.append("hook"))
    sock = raw_socket(srv.address)
    try:
        sock.send_multipart([wire.request("boom", 1)])
        sock.send_multipart([wire.request("echo", 2)])
        deadline = time.monotonic() + 5
        while srv.failure is None and time.monotonic() < deadline:
            srv.run_once()
        srv.run_once(0)   # a turn after the bug (the loop would have stopped): runs nothing
        assert isinstance(srv.failure, ZeroDivisionError)
        assert ran == [], ran
    finally:
        sock.close()
        srv.close()


def test_a_peer_kept_by_a_caller_still_works_after_it_was_evicted(monkeypatch, server):
    monkeypatch.setattr(kera_server, "PEERS_MAX", 2)
    client = Server("client")
    replies = []
    try:
        kept = client.peer(server.address)   # as a daemon keeps its coordinator's peer
        client.peer("127.0.0.1:40001")
        client.peer("127.0.0.1:40002")       # evicts `kept`, the least recently used idle one
        assert kept.closed and server.address not in client.peers
        kept.request("echo", {"x": 4}, [], 5.0, lambda h, f, e: replies.append((h, e)))
        deadline = time.monotonic() + 5
        while not replies and time.monotonic() < deadline:
            client.run_once()
        assert replies and replies[0][1] is None and replies[0][0]["echo"] == 4
    finally:
        client.close()


def test_a_callback_that_drops_peers_does_not_break_the_loop(server):
    client = Server("client")
    replies = []

    def drop_everything(header, frames, error):
        replies.append(error)
        for address in list(client.peers):
            client.drop_peer(address)

    try:
        for x in range(3):
            client.peer(server.address).request("echo", {"x": x}, [], 5.0, drop_everything)
        client.peer("127.0.0.1:1").request("echo", {}, [], 0.0, drop_everything)
        deadline = time.monotonic() + 5
        while len(replies) < 4 and time.monotonic() < deadline:
            client.run_once()
        assert client.failure is None and len(replies) == 4
    finally:
        client.close()
