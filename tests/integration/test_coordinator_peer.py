"""A daemon's requests to the coordinator (kera.daemon.coordinator_peer), over real sockets."""

import threading
import time

import pytest

from kera.daemon.coordinator_peer import CoordinatorPeer
from kera.errors import Timeout
from kera.net.server import DEFERRED, Server

TIMEOUT_S = 0.3      # each request's timeout
WAIT_S = 5.0         # for a reply or a timeout to come back


@pytest.fixture
def coordinator():
    """Never answers the first heartbeat nor any `stall` (a cut network); answers the rest."""
    srv = Server("coordinator")
    unanswered = []

    def heartbeat(req):
        if not unanswered:
            unanswered.append(req)
            return DEFERRED
        return {"beat": True}

    srv.on("heartbeat", heartbeat)
    srv.on("stall", lambda req: DEFERRED)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(5)


def ask(daemon: Server, peer: CoordinatorPeer, op: str):
    """Send `op` through `peer`; its (header, error) once the daemon's loop has it."""
    results = []
    peer.request(op, {}, [], TIMEOUT_S, lambda h, f, e: results.append((h, e)))
    deadline = time.monotonic() + WAIT_S
    while not results and time.monotonic() < deadline:
        daemon.run_once()
    assert results, f"{op}: neither a reply nor a timeout within {WAIT_S} s"
    return results[0]


def test_a_heartbeat_unanswered_in_time_closes_the_connection_and_the_next_goes_on_a_new_one(coordinator):
    daemon = Server("daemon")
    try:
        peer = CoordinatorPeer(daemon, coordinator.address)
        first = daemon.peer(coordinator.address)
        header, error = ask(daemon, peer, "stall")
        assert isinstance(error, Timeout)
        assert daemon.peers[coordinator.address] is first, \
            "another request's timeout keeps the connection (it may just be slow)"
        header, error = ask(daemon, peer, "heartbeat")
        assert isinstance(error, Timeout) and first.closed, "a lost heartbeat closes it"
        header, error = ask(daemon, peer, "heartbeat")
        assert error is None and header["beat"] is True
        assert daemon.peers[coordinator.address] is not first
    finally:
        daemon.close()
