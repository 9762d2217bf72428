"""The coordinator takes no frame larger than a request header (COORDINATOR_FRAME_BYTES_MAX):
a peer sending a broker-sized frame is cut off by zmq before it is buffered, and the
coordinator serves on. Its resident memory does not grow by what was sent."""

import zmq

from kera.broker.memory import resident_bytes
from kera.cli.local import LocalCluster
from kera.codec import wire
from kera.coordinator.server import COORDINATOR_FRAME_BYTES_MAX
from kera.net import rpc

FRAMES = 6
FRAME_BYTES = 64 * 1024 * 1024   # what a broker takes per frame (a chunk)
GROWTH_ALLOWED_BYTES = FRAME_BYTES               # less than one of the frames sent
QUIET_S = 2.0   # the coordinator's loop has read (or dropped) what was sent by then


def test_oversized_frames_to_the_coordinator_are_dropped_and_it_serves_on(tmp_path):
    with LocalCluster(tmp_path, brokers=0, log_level="WARNING") as cluster:
        before = resident_bytes(cluster.coordinator.pid)["VmRSS"]
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{cluster.coordinator.address}")
        big = bytes(FRAME_BYTES)
        header = wire.request("cluster", 1, {})
        sock.send_multipart([header, *[big] * FRAMES])
        assert not sock.poll(int(QUIET_S * 1000), zmq.POLLIN), "an oversized message was served"
        sock.close()
        grown = resident_bytes(cluster.coordinator.pid)["VmRSS"] - before
        assert grown < GROWTH_ALLOWED_BYTES, f"the coordinator grew by {grown} bytes"
        header, _ = rpc.call(cluster.bootstrap, "cluster", timeout_s=10.0)
        assert header["brokers"] == []
    assert COORDINATOR_FRAME_BYTES_MAX < FRAME_BYTES
