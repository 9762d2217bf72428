"""The raw pyzmq ceiling: ROUTER/DEALER transfer of the same bytes kera's producer sends.

A server *process* (like a broker) receives multipart requests of `frames_per_request` frames of
`frame_bytes` each and answers each with a small ack; the client keeps `in_flight` requests
outstanding, exactly the shape of kera's produce path with none of its work.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import zmq


def _serve(port_queue, total_requests: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    port_queue.put(port)
    for _ in range(total_requests):
        if not sock.poll(30_000):
            break
        parts = sock.recv_multipart(copy=False)
        sock.send_multipart([parts[0], b"ok"])
    sock.close()
    ctx.term()


def zmq_ceiling(total_bytes: int, frame_bytes: int = 16 * 1024, frames_per_request: int = 64,
                in_flight: int = 4) -> dict:
    """Bytes/s and frames/s of a raw transfer of `total_bytes` from a DEALER to a ROUTER process."""
    requests = max(1, total_bytes // (frame_bytes * frames_per_request))
    ports: mp.Queue = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_serve, args=(ports, requests), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        frames = [bytes(frame_bytes)] * frames_per_request
        sent = acked = 0
        start = time.perf_counter()
        while acked < requests:
            while sent < requests and sent - acked < in_flight:
                sock.send_multipart(frames, copy=False)
                sent += 1
            if not sock.poll(30_000):
                raise TimeoutError("ceiling server stopped answering")
            sock.recv()
            acked += 1
        elapsed = time.perf_counter() - start
        sock.close()
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()
    moved = requests * frames_per_request * frame_bytes
    return {"bytes": moved, "seconds": elapsed, "bytes_per_s": moved / elapsed,
            "frames_per_s": requests * frames_per_request / elapsed}


if __name__ == "__main__":
    result = zmq_ceiling(1 << 30)
    print(f"raw pyzmq ROUTER/DEALER: {result['bytes_per_s'] / 1e6:.0f} MB/s, "
          f"{result['frames_per_s']:.0f} frames/s of 16 KiB")
