"""The coordinator's marker channel shell (kera.coordinator.server), over real sockets: a
decided commit's markers reach the owning broker as `txn_markers`, a request the broker leaves
unanswered is sent again after MARKER_RETRY_S, and the acknowledgement completes the
transaction on disk."""

import threading
import time

from kera.coordinator import store
from kera.coordinator import transactions as tx
from kera.coordinator.server import CoordinatorServer
from kera.net.server import DEFERRED, Server

TID = "job-1"
WAIT_S = 10.0     # for the markers to go round: a resend after MARKER_RETRY_S (1 s), then acks


def test_markers_are_resent_until_acknowledged_and_the_completion_persists(tmp_path):
    broker = Server("broker")
    received: list[list] = []

    def txn_markers(req):
        received.append(req.fields.h["markers"])
        if len(received) == 1:
            return DEFERRED            # the first request is lost
        return {"written": [[s, sl, pid, txn] for _, pid, _, txn, _, s, sl in
                            req.fields.h["markers"]], "not_owner": []}

    broker.on("txn_markers", txn_markers)
    thread = threading.Thread(target=broker.run, daemon=True)
    thread.start()
    coord = CoordinatorServer(str(tmp_path), "127.0.0.1", 0, heartbeat_interval_s=1.0)
    try:
        core, now = coord.core, coord.clock.monotonic()
        core.handle("register", {"kind": "broker", "address": broker.address, "node": "n"}, now)
        core.handle("create_stream", {"name": "out", "streamlets": 1}, now)
        ids = core.handle("txn_init", {"transactional_id": TID}, now)
        owner = {"transactional_id": TID, **ids}
        core.handle("txn_add_parts", {**owner, "parts": [["out", 0]]}, now)
        core.handle("txn_end", {**owner, "commit": True}, now)
        coord._persist()                 # as the turn that handled them would
        deadline = time.monotonic() + WAIT_S
        while core.transactions.txns[TID].state != tx.COMPLETE_COMMIT:
            assert time.monotonic() < deadline, (received, coord.markers.counters)
            coord.server.run_once(0.01)
        coord.server.run_once(0.01)      # the turn after the ack persists the completion
        assert received[0] == received[1] == [[TID, ids["producer_id"], ids["epoch"], 1, True,
                                               "out", 0]]
        assert coord.markers.counters["markers_written"] == 1
    finally:
        coord.server.close()
        coord.close()
        broker.stop()
        thread.join(5)
    state = store.MetadataStore(tmp_path).load()
    assert [t["state"] for t in state["transactions"]] == [tx.COMPLETE_COMMIT]
