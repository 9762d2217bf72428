"""The daemon shell's error boundary, over real sockets."""

import threading
import time

import pytest
import zmq

from kera import rpc, wire
from kera.errors import BadRequest, KeraError, NotOwner, Timeout
from kera.server import DEFERRED, Server


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
        with pytest.raises(KeraError, match="internal error: RuntimeError"):
            conn.call("boom")
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
