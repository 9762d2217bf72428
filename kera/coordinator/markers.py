"""The marker channel: a decided transaction's markers, sent to the brokers owning its parts.
Sans-IO.

Once a commit or abort decision is persisted, every part of the transaction needs a marker (a
control chunk the owning broker appends: docs/TRANSACTIONS.md). `due(now)` takes the markers
Transactions.markers_due hands out (never sent by this coordinator, or unanswered for
MARKER_RETRY_S) and groups them into `txn_markers` requests, one or more per owning broker;
the shell (kera.coordinator.server) sends each on its connection to that broker. A reply
lists the markers the broker holds durably (`written`), and `replied` records each of those
with Transactions.marker_written; the last one of a transaction completes it. Anything else
(`not_owner`, an error reply, a timeout, a reply that never comes, a part whose owner is dead)
needs nothing here: the marker is still unwritten, so markers_due hands it out again after
MARKER_RETRY_S, and `due` then sends it to whoever owns the part by then. Brokers answer a
marker they already hold as written without writing it twice, so a resend, a duplicated request
or a reply that arrives late (for a transaction completed since) does no harm: marker_written
ignores acknowledgements of anything but the current transaction.

Call `due` only after the state that ordered the markers is persisted (the shell persists
first): a marker sent for a decision a crash then forgot would mark a transaction that may
still end the other way.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from kera.coordinator.transactions import Marker, Part, Transactions

# Markers in one `txn_markers` request. A marker packs to at most ~540 bytes (a 255-character
# transactional id and stream name), so 4096 stay near 2 MiB, under the broker's 4 MiB header
# bound (kera.codec.wire.MAX_HEADER_BYTES); markers_due hands out at most MARKERS_PER_TURN_MAX
# (10,000) per call, so a turn sends a few requests per broker at most.
MARKERS_PER_REQUEST_MAX = 4096
# How long the shell waits for a `txn_markers` reply. A broker answers once the control chunks
# are durable (a replication round trip, milliseconds; seconds while its backups fail over);
# markers unanswered for MARKER_RETRY_S are resent meanwhile, so this only bounds how long a
# dead broker's requests are kept: a few resends' worth.
MARKER_REQUEST_TIMEOUT_S = 10.0

Batch = list[Marker]


class MarkerChannel:
    """`owner_of(part)`: the address of the live broker owning `part`, or None while it has
    none (its owner is dead and not yet replaced, or its stream is being deleted)."""

    def __init__(self, txns: Transactions, owner_of: Callable[[Part], str | None]):
        self.txns = txns
        self.owner_of = owner_of
        self.counters: Counter = Counter()   # for the coordinator's stats

    def due(self, now: float) -> list[tuple[str, Batch]]:
        """(broker address, markers) requests to send now, in address order."""
        by_owner: dict[str, Batch] = {}
        for marker in self.txns.markers_due(now):
            address = self.owner_of(marker.part)
            if address is None:
                self.counters["markers_unplaced"] += 1   # due again after MARKER_RETRY_S
                continue
            by_owner.setdefault(address, []).append(marker)
        out = []
        for address, markers in sorted(by_owner.items()):
            for at in range(0, len(markers), MARKERS_PER_REQUEST_MAX):
                out.append((address, markers[at:at + MARKERS_PER_REQUEST_MAX]))
        self.counters["markers_sent"] += sum(len(b) for _, b in out)
        return out

    @staticmethod
    def request(batch: Batch) -> dict:
        """The fields of the `txn_markers` request carrying `batch`."""
        return {"markers": [m.to_wire() for m in batch]}

    def replied(self, batch: Batch, reply: dict, now: float) -> int:
        """A broker's reply to the request that carried `batch`: records the markers it
        reports durable. Returns how many transactions that completed."""
        written = _written(reply.get("written"))
        completed = 0
        for marker in batch:
            if (marker.stream, marker.streamlet, marker.producer_id, marker.txn) in written:
                self.counters["markers_written"] += 1
                completed += self.txns.marker_written(marker, now)
        not_owner = reply.get("not_owner")
        if isinstance(not_owner, list):
            self.counters["markers_not_owner"] += len(not_owner)   # resent to the new owner
        return completed

    def failed(self, batch: Batch) -> None:
        """The request carrying `batch` failed (error reply, timeout): resent when due."""
        self.counters["marker_requests_failed"] += 1


def _written(entries) -> set[tuple]:
    """The reply's `written` ([[stream, streamlet, producer_id, txn], ...]) as a set; entries
    of another shape are ignored (they match no marker)."""
    if not isinstance(entries, list):
        return set()
    return {tuple(e) for e in entries if isinstance(e, list) and len(e) == 4
            and isinstance(e[0], str) and all(type(v) is int for v in e[1:])}
