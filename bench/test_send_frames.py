"""A daemon's send of chunk frames (issue 15): pyzmq's default copy threshold (64 KiB) against
kera.net.server.ZERO_COPY_MIN_BYTES, for 4 KiB and 64 KiB chunks taken from a segment-like mmap;
short non-adjacent chunks sent one frame each against packed into one frame
(kera.codec.frame_pack.pack); and one payload sent to two peers, made into zmq Frames per send against
once (kera.net.server.share_payloads).

    python -m pytest bench/test_send_frames.py -q --benchmark-enable

Each round sends FRAMES_PER_ROUND frames, FRAMES_PER_MESSAGE per message (a replication write
carries several chunks), from a DEALER to a ROUTER drained by a thread; the timed part is the
sender's `send_multipart` calls and the wait until the receiver has them all. The figure to
read is the time per round at each threshold: no assertion on it.
"""

from __future__ import annotations

import mmap
import threading
import time

import pytest
import zmq

from kera.codec.frame_pack import pack as _pack
from kera.net.server import ZERO_COPY_MIN_BYTES, send_frames, share_payloads

FRAMES_PER_ROUND = 2000
FRAMES_PER_MESSAGE = 4
SEGMENT_BYTES = 64 * 1024 * 1024
ROUNDS = 5
DRAIN_TIMEOUT_S = 60.0


class Link:
    """A connected DEALER -> ROUTER pair; a thread counts the frames that arrive."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.received = threading.Semaphore(0)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            while True:
                self.router.recv_multipart(copy=False)
                self.received.release()
        except zmq.ContextTerminated:
            self.router.close(linger=0)   # term() waits for every socket of the context

    def close(self) -> None:
        self.dealer.close(linger=0)
        self.ctx.term()   # the drain thread's recv ends with ContextTerminated


@pytest.fixture(scope="module")
def segment():
    buf = mmap.mmap(-1, SEGMENT_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"x" * SEGMENT_BYTES)   # touched once: the bench times sends, not page faults
    yield memoryview(buf)


def _views(segment: memoryview, offset: int, count: int, size: int,
           stride: int) -> tuple[list, int]:
    """`count` views of `size` bytes, `stride` apart from `offset` (wrapping at the segment's
    end), and the offset after them."""
    views = []
    for _ in range(count):
        if offset + stride > SEGMENT_BYTES:
            offset = 0
        views.append(segment[offset:offset + size])
        offset += stride
    return views, offset


@pytest.mark.parametrize("chunk_bytes", [4 * 1024, 64 * 1024 - 512])
@pytest.mark.parametrize("threshold", ["pyzmq-default", "kera"])
def test_send_chunk_frames(benchmark, segment, chunk_bytes, threshold):
    link = Link()
    default = threshold == "pyzmq-default"
    link.dealer.copy_threshold = zmq.COPY_THRESHOLD if default else ZERO_COPY_MIN_BYTES
    messages = FRAMES_PER_ROUND // FRAMES_PER_MESSAGE

    def send_round():
        offset = 0
        for _ in range(messages):
            views, offset = _views(segment, offset, FRAMES_PER_MESSAGE, chunk_bytes, chunk_bytes)
            link.dealer.send_multipart([b"header", *views], copy=False)

    _measure(benchmark, link, send_round, messages)
    benchmark.extra_info.update(chunk_bytes=chunk_bytes, copy_threshold=link.dealer.copy_threshold,
                                frames_per_round=FRAMES_PER_ROUND)


@pytest.mark.parametrize("chunks_per_write", [4, 16, 64])
@pytest.mark.parametrize("layout", ["frame-per-chunk", "packed"])
@pytest.mark.parametrize("size", [4000, 64000])
def test_send_short_chunks(benchmark, segment, chunks_per_write, layout, size):
    """Chunks of `size` bytes with a 4 KiB+ gap between them (never adjacent, as chunks of
    different groups in one replication write), at kera's threshold: 4000-byte ones go as
    copies either way, 64000-byte ones zero-copy one frame each or packed into one copy
    (kera.codec.frame_pack.PACK_RUN_BYTES_MAX)."""
    link = Link()
    link.dealer.copy_threshold = ZERO_COPY_MIN_BYTES
    messages = FRAMES_PER_ROUND // chunks_per_write
    stride = (size // 4096 + 2) * 4096

    def send_round():
        offset = 0
        for _ in range(messages):
            views, offset = _views(segment, offset, chunks_per_write, size, stride)
            frames = views if layout == "frame-per-chunk" else _pack(views)
            link.dealer.send_multipart([b"header", *frames], copy=False)

    _measure(benchmark, link, send_round, messages)
    benchmark.extra_info.update(chunks_per_write=chunks_per_write, chunk_bytes=size,
                                chunks_per_round=messages * chunks_per_write)


@pytest.mark.parametrize("chunk_bytes", [16 * 1024, 64 * 1024 - 512])
@pytest.mark.parametrize("payload", ["per-peer", "shared"])
def test_send_payload_to_two_peers(benchmark, segment, chunk_bytes, payload):
    """A replication payload sent to two backups (R=3): each send making its own zmq message
    from the views, against the views made into Frames once and sent to both
    (kera.net.server.share_payloads). `cpu_us_per_payload` is this process's CPU (sender, its zmq
    threads and both drain threads) per payload over the rounds."""
    links = [Link(), Link()]
    for link in links:
        link.dealer.copy_threshold = ZERO_COPY_MIN_BYTES
    messages = FRAMES_PER_ROUND // FRAMES_PER_MESSAGE

    def send_round():
        offset = 0
        for _ in range(messages):
            views, offset = _views(segment, offset, FRAMES_PER_MESSAGE, chunk_bytes, chunk_bytes)
            frames = share_payloads([views, views])[0] if payload == "shared" else views
            for link in links:
                send_frames(link.dealer, [b"header", *frames])

    cpu_before = time.process_time()
    _measure(benchmark, _Both(links), send_round, messages)
    cpu_s = time.process_time() - cpu_before
    benchmark.extra_info.update(chunk_bytes=chunk_bytes, frames_per_payload=FRAMES_PER_MESSAGE,
                                cpu_us_per_payload=cpu_s / ((ROUNDS + 1) * messages) * 1e6)


class _Both:
    """Two links waited on and closed as one (for _measure)."""

    def __init__(self, links: list[Link]):
        self.links = links
        self.received = self

    def acquire(self, timeout: float) -> bool:
        return all(link.received.acquire(timeout=timeout) for link in self.links)

    def close(self) -> None:
        for link in self.links:
            link.close()


def _measure(benchmark, link: Link, send_round, messages: int) -> None:
    """Time rounds of `send_round` plus the wait until the receiver has its `messages`."""
    def run():
        send_round()
        for _ in range(messages):
            assert link.received.acquire(timeout=DRAIN_TIMEOUT_S)

    try:
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    finally:
        link.close()
