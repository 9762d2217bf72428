"""kera.net.server.send_frames: a multipart message leaves whole, or not at all (zmq.Again), and the
socket sends normally after a refusal."""

from __future__ import annotations

import pytest
import zmq

from kera.net.server import ZERO_COPY_MIN_BYTES, send_frames

RECEIVE_TIMEOUT_MS = 10_000


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_parts_arrive_as_one_message_in_order(ctx):
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    big = memoryview(b"b" * (2 * ZERO_COPY_MIN_BYTES))
    send_frames(dealer, [b"header", b"x" * 10, big, bytearray(b"tail")])
    assert router.poll(RECEIVE_TIMEOUT_MS)
    identity, *parts = router.recv_multipart()
    assert parts == [b"header", b"x" * 10, bytes(big), b"tail"]
    send_frames(router, [identity, b"reply"])     # routed back by identity
    assert dealer.poll(RECEIVE_TIMEOUT_MS) and dealer.recv_multipart() == [b"reply"]


def test_refused_message_sends_nothing_and_the_socket_is_usable_after(ctx):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IMMEDIATE, 1)              # no connection yet: refuse, do not queue
    dealer.connect("tcp://127.0.0.1:1")              # nobody listens there
    with pytest.raises(zmq.Again):
        send_frames(dealer, [b"first", b"second"])
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    for _ in range(1000):
        try:
            send_frames(dealer, [b"one", b"two"])
            break
        except zmq.Again:
            dealer.poll(10, zmq.POLLOUT)
    assert router.poll(RECEIVE_TIMEOUT_MS)
    assert router.recv_multipart()[1:] == [b"one", b"two"]     # no stray part of the refused one
    assert not router.poll(100)


def test_a_single_part_message(ctx):
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    send_frames(dealer, [b"only"])
    assert router.poll(RECEIVE_TIMEOUT_MS) and router.recv_multipart()[1:] == [b"only"]
