"""kera.net.server: frames of ZERO_COPY_MIN_BYTES or more leave zero-copy, shorter ones are copied;
either way the bytes that arrive are the bytes handed over, even when the sender drops its
buffer right after the send (zmq keeps its own reference until the frame is out)."""

from __future__ import annotations

import mmap
import time

import pytest
import zmq

from kera.net import server as kera_server
from kera.codec import wire

RECEIVE_TIMEOUT_S = 10.0


@pytest.fixture
def shell():
    s = kera_server.Server("test")
    yield s
    s.close()


def test_router_and_peers_send_large_frames_zero_copy(shell):
    assert shell.router.copy_threshold == kera_server.ZERO_COPY_MIN_BYTES
    peer = shell.peer(f"127.0.0.1:{shell.port}")
    assert peer.sock.copy_threshold == kera_server.ZERO_COPY_MIN_BYTES
    # below pyzmq's own default (64 KiB): a 64 KiB chunk must not be copied
    assert kera_server.ZERO_COPY_MIN_BYTES < zmq.COPY_THRESHOLD


def _segment_like(size: int, fill: int) -> tuple[mmap.mmap, memoryview]:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(bytes([fill]) * size)
    return buf, memoryview(buf)


@pytest.mark.parametrize("size", [kera_server.ZERO_COPY_MIN_BYTES - 1,
                                  kera_server.ZERO_COPY_MIN_BYTES, 64 * 1024, 1024 * 1024])
def test_reply_frames_arrive_intact_on_both_sides_of_the_threshold(shell, size):
    def handler(req):
        _buf, view = _segment_like(size, 0xAB)
        return {}, [view]          # the handler's buffer goes out of scope at once

    shell.handlers["get"] = handler
    client = shell.ctx.socket(zmq.DEALER)
    try:
        client.connect(f"tcp://127.0.0.1:{shell.port}")
        client.send_multipart([wire.request("get", 1)])
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while not client.poll(0) and time.monotonic() < deadline:
            shell.run_once(0.01)
        header, payload = client.recv_multipart()
    finally:
        client.close(linger=0)
    assert wire.unpack_header(header)["id"] == 1
    assert payload == bytes([0xAB]) * size


def test_senders_pack_every_piece_the_server_would_copy():
    from kera.codec import frame_pack
    assert frame_pack.PACK_RUN_BYTES_MAX >= kera_server.ZERO_COPY_MIN_BYTES


def test_a_payload_sent_to_several_peers_is_made_into_frames_once():
    from kera.broker.segment_pool import in_use
    big_buf, big = _segment_like(kera_server.ZERO_COPY_MIN_BYTES, 1)
    small = b"s" * (kera_server.ZERO_COPY_MIN_BYTES - 1)
    twice, once = [big, small], [small]
    out = kera_server.share_payloads([twice, once, twice])
    assert out[1] is once                       # sent once: left as it is
    assert out[0] is out[2] and out[0] is not twice
    assert all(isinstance(f, zmq.Frame) for f in out[0])
    assert [f.bytes for f in out[0]] == [bytes(big), small]
    del big, twice
    assert in_use(big_buf)                      # the long frame references the buffer...
    assert out[0][1].buffer.obj is not small    # ...the short one is a copy


@pytest.mark.parametrize("size", [kera_server.ZERO_COPY_MIN_BYTES - 1, 64 * 1024])
def test_a_shared_payload_arrives_intact_at_every_peer(size):
    receivers = [kera_server.Server(f"backup-{i}") for i in range(2)]
    got: dict[str, list] = {}

    def keep(req, name):
        got[name] = [bytes(f) for f in req.frames]
        return {}

    for r in receivers:
        r.handlers["replicate"] = lambda req, name=r.name: keep(req, name)
    sender = kera_server.Server("broker")
    try:
        buf, view = _segment_like(size, 0xCD)
        payload = [view[: size // 2], view[size // 2:]]
        shared = sender.share([payload, payload])
        del view, payload
        replies = []
        for r, frames in zip(receivers, shared):
            sender.peer(f"127.0.0.1:{r.port}").request(
                "replicate", {}, frames, RECEIVE_TIMEOUT_S,
                lambda header, frames, error: replies.append(error))
        del shared
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while len(replies) < 2 and time.monotonic() < deadline:
            for s in (sender, *receivers):
                s.run_once(0.005)
        assert replies == [None, None]
        half = bytes([0xCD]) * (size // 2)
        assert got == {r.name: [half, bytes([0xCD]) * (size - size // 2)] for r in receivers}
    finally:
        for s in (sender, *receivers):
            s.close()
