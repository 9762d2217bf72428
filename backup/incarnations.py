"""The backup's side of broker failover: fencing and freeing the replicas of dead incarnations.

A broker names its replicas with its incarnation's epoch (`vseg = epoch << 32 | n`, see
kera.coordinator.recovery). When a new owner recovers a dead broker's streamlets it lists the
replicas here with `fence`: from then on writes of those incarnations are refused, so a broker
declared dead while merely slow can no longer get anything acknowledged (it needs every
replica of a segment, and the recovery lists every live backup). The coordinator answers each
heartbeat with `free`: incarnations that are over with nothing left to recover from them; their
replicas are dropped (memory and files, through the store's `drop`).

Also: `held()`, what this backup holds per incarnation, sent with every heartbeat, and the
`streamlets` filter of `read_replica` (per chunk header, never per record).
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict

from kera.errors import BadRequest
from kera.codec.wire import Fields
from kera.codec.vseg import epoch_of

log = logging.getLogger(__name__)

FENCED_MAX = 65_536          # incarnations remembered as fenced (oldest forgotten first)
FILTER_ENTRIES_MAX = 4096    # [stream id, streamlet] pairs in a read filter
HELD_ENTRIES_MAX = 4096      # incarnations reported per heartbeat (the coordinator's bound)
U64_MAX = 2**64 - 1
_STREAM = struct.Struct("<QI")   # stream_id, streamlet at byte 32 of a chunk header


class Incarnations:
    def __init__(self, store):
        self.store = store
        self.fenced: OrderedDict[tuple[int, int], None] = OrderedDict()

    # ------------------------------------------------------------------ fencing
    def fence(self, broker_id: int, epochs) -> None:
        for epoch in epochs:
            key = (broker_id, epoch)
            if key not in self.fenced:
                log.info("broker %d epoch %d is fenced: its writes are refused from now on",
                         broker_id, epoch)
                self.store.counters.add("incarnations_fenced")
            self.fenced[key] = None
            self.fenced.move_to_end(key)
        while len(self.fenced) > FENCED_MAX:
            self.fenced.popitem(last=False)

    def blocked(self, key) -> bool:
        return bool(self.fenced) and (key[0], epoch_of(key[2])) in self.fenced

    # ------------------------------------------------------------------ holding and freeing
    def held(self) -> list[list[int]]:
        """[[broker_id, epoch, replicas, bytes], ...] over every replica held."""
        table: dict[tuple[int, int], list[int]] = {}
        for (broker_id, _, vseg), replica in self.store.replicas.items():
            entry = table.setdefault((broker_id, epoch_of(vseg)), [0, 0])
            entry[0] += 1
            entry[1] += replica.length
        return [[b, e, n, size] for (b, e), (n, size) in sorted(table.items())][:HELD_ENTRIES_MAX]

    def free(self, entries) -> list:
        """Drop every replica of the incarnations named ([[broker_id, epoch], ...]); returns
        the deferred replies to fail (writes that waited for the disk)."""
        wanted = set()
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, list) and len(entry) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64_MAX
                    for x in entry):
                wanted.add((entry[0], entry[1]))
        if not wanted:
            return []
        for b, e in wanted:
            self.fence(b, [e])
        replies = []
        keys = [k for k in self.store.replicas if (k[0], epoch_of(k[2])) in wanted]
        for key in keys:
            _, rep = self.store.drop(key)
            replies.extend(rep)
        if keys:
            self.store.counters.add("replicas_freed", len(keys))
            log.info("freed %d replicas of finished broker incarnations %s", len(keys),
                     sorted(wanted))
        return replies


def parse_filter(f: Fields) -> set[tuple[int, int]] | None:
    """`streamlets` of a read_replica request: the [stream id, streamlet] pairs to return."""
    value = f.list("streamlets", None, max_len=FILTER_ENTRIES_MAX)
    if value is None:
        return None
    out = set()
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= U64_MAX
                for x in entry):
            raise BadRequest("'streamlets' entries are [stream_id, streamlet]")
        out.add((entry[0], entry[1]))
    return out


def parse_fence(f: Fields) -> list[int]:
    value = f.list("fence", None, max_len=FILTER_ENTRIES_MAX)
    if value is None:
        return []
    for e in value:
        if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e <= U64_MAX:
            raise BadRequest("'fence' holds epochs (integers)")
    return value


def keep(chunks, wanted: set | None) -> list:
    """The chunks (whole, verified on the way in) of the streamlets in `wanted`."""
    if wanted is None:
        return list(chunks)
    return [c for c in chunks if _STREAM.unpack_from(c, 32) in wanted]
