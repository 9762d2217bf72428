"""The raw pyzmq ceiling: ROUTER/DEALER transfer of the same bytes kera's producer sends.

A server *process* (like a broker) receives multipart requests of `frames_per_request` frames of
`frame_bytes` each and answers each with a small ack; the client keeps `in_flight` requests
outstanding, exactly the shape of kera's produce path with none of its work.

    zmq_ceiling(1 << 30)                        # start a server, move 1 GiB, stop it
    with CeilingServer() as server:             # or keep one server for repeated transfers
        transfer(server.port, 64 << 20)
"""

from __future__ import annotations

import multiprocessing as mp
import time

import zmq

SERVER_START_TIMEOUT_S = 30.0
REPLY_TIMEOUT_MS = 30_000
STOP_TIMEOUT_S = 10.0


def _serve(port_queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port_queue.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        parts = sock.recv_multipart(copy=False)
        if len(parts) == 2 and parts[1].bytes == b"stop":
            break
        sock.send_multipart([parts[0], b"ok"])
    sock.close()
    ctx.term()


class CeilingServer:
    """The ROUTER side in its own process, until `stop()`."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        self.process = ctx.Process(target=_serve, args=(ports,), daemon=True)
        self.process.start()
        try:
            self.port = ports.get(timeout=SERVER_START_TIMEOUT_S)
        except BaseException:
            self.process.kill()
            raise

    def stop(self) -> None:
        if self.process.is_alive():
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            sock.send(b"stop")
            sock.close()
            self.process.join(STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(STOP_TIMEOUT_S)

    def __enter__(self) -> "CeilingServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def transfer(port: int, total_bytes: int, frame_bytes: int = 16 * 1024,
             frames_per_request: int = 64, in_flight: int = 4) -> dict:
    """Move `total_bytes` (rounded down to whole requests, at least one) to the server."""
    requests = max(1, total_bytes // (frame_bytes * frames_per_request))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        frames = [bytes(frame_bytes)] * frames_per_request
        sent = acked = 0
        start = time.perf_counter()
        while acked < requests:
            while sent < requests and sent - acked < in_flight:
                sock.send_multipart(frames, copy=False)
                sent += 1
            if not sock.poll(REPLY_TIMEOUT_MS):
                raise TimeoutError("ceiling server stopped answering")
            sock.recv()
            acked += 1
        elapsed = time.perf_counter() - start
    finally:
        sock.close()
    moved = requests * frames_per_request * frame_bytes
    return {"bytes": moved, "seconds": elapsed, "bytes_per_s": moved / elapsed,
            "frames_per_s": requests * frames_per_request / elapsed, "frame_bytes": frame_bytes,
            "frames_per_request": frames_per_request, "in_flight": in_flight}


def zmq_ceiling(total_bytes: int, frame_bytes: int = 16 * 1024, frames_per_request: int = 64,
                in_flight: int = 4) -> dict:
    """Bytes/s and frames/s of a raw transfer of `total_bytes` from a DEALER to a ROUTER process."""
    with CeilingServer() as server:
        return transfer(server.port, total_bytes, frame_bytes, frames_per_request, in_flight)


if __name__ == "__main__":
    result = zmq_ceiling(1 << 30)
    print(f"raw pyzmq ROUTER/DEALER: {result['bytes_per_s'] / 1e6:.0f} MB/s, "
          f"{result['frames_per_s']:.0f} frames/s of 16 KiB")
