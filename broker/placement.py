"""Where a replicated stream's new groups write: the broker's virtual logs, chosen per group,
and the backups behind them.

`Placement` is the streamlets' group listener (kera.broker.streamlet.GroupListener): a group
opened on a replicated stream takes a virtual log (its slot's previous log while that one is
not wholly durable, else the least loaded of the stream's allowed logs), and a closed one gives
it back. It keeps the logs (`vlogs`, `vlog_list`: the broker core and its shell read them) and
the backup pool they replicate to. Sans-IO.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from kera.broker.backups import BackupPool
from kera.broker.group import Group
from kera.broker.tier import TierStore
from kera.broker.virtual_log import VirtualLog
from kera.codec.vseg import vseg_id
from kera.daemon.metrics import Counters

if TYPE_CHECKING:
    from kera.broker.core import BrokerConfig, Stream

log = logging.getLogger(__name__)


class Placement:
    """The broker's virtual logs and the groups placed on them."""

    def __init__(self, cfg: "BrokerConfig", pool: BackupPool, streams: dict, tier: TierStore,
                 counters: Counters, wall_ms: Callable[[], int],
                 epoch: Callable[[], int | None]):
        """`streams`: the core's {stream id: Stream}, shared; `wall_ms()`: the retention
        clock (group stamps); `epoch()`: this incarnation's epoch, None until known (new
        logs number their virtual segments from it)."""
        self.cfg = cfg
        self.pool = pool
        self.streams = streams
        self.tier = tier
        self.counters = counters
        self.wall_ms = wall_ms
        self.epoch = epoch
        self.vlogs: dict[tuple[int, int, str], VirtualLog] = {}   # (index, R, durability)
        self.vlog_list: list[VirtualLog] = []                     # by wire id

    def set_backups(self, entries, now: float, settled: bool = True) -> None:
        """The coordinator's backup list; replicas on backups that died are replaced. An
        unsettled list (a coordinator restarted less than a dead window ago) declares none dead."""
        lost = self.pool.update(entries, settled)
        if lost:
            log.warning("backups %s are gone: re-replicating what they held", lost)
            lost_set = set(lost)
            for vlog in self.vlog_list:
                self.counters.add("replicas_lost", vlog.backups_lost(lost_set, now))

    def group_opened(self, group: Group) -> None:
        group.created_ms = group.last_ms = self.wall_ms()
        stream = self.streams[group.stream_id]
        if stream.info.replication > 1:
            # A new group takes the log of its slot's previous group while that one is not
            # wholly durable: a producer's chunk is then never durable (nor acknowledged)
            # before its earlier chunks, which recovery relies on (kera.broker.rebuild).
            vlog = _slot_vlog(stream, group) or self.choose_vlog(stream)
            group.vlog = vlog
            vlog.active_groups += 1
        self.counters.add("groups_opened")

    def group_closed(self, group: Group) -> None:
        if group.vlog is not None:
            group.vlog.active_groups -= 1
        elif group.segments:
            self.tier.segment_sealed(group.segments[-1])
        self.counters.add("groups_closed")

    def close_group(self, group: Group) -> None:
        """Close an open group before it is full (by time for retention, or under memory
        pressure): its slot's next chunk opens a new group."""
        if not group.closed:
            group.closed = True
            self.group_closed(group)

    def choose_vlog(self, stream: Stream) -> VirtualLog:
        """The least loaded of the stream's allowed logs: `replication_capacity` of them (0 = all)
        starting at one spread by stream id. With V at least the number of open groups, every
        group gets a log of its own (the Kafka-like layout)."""
        info = stream.info
        v = self.cfg.virtual_logs
        capacity = min(info.replication_capacity or v, v)
        start = info.id % v
        turn = stream.turn
        stream.turn += 1
        best = None
        best_key = None
        for k in range(capacity):
            index = (start + (turn + k) % capacity) % v
            vlog = self.vlogs.get((index, info.replication, info.durability))
            load = vlog.active_groups if vlog is not None else 0
            if best_key is None or load < best_key:
                best, best_key = index, load
        key = (best, info.replication, info.durability)
        vlog = self.vlogs.get(key)
        if vlog is None:
            vlog = VirtualLog(len(self.vlog_list), info.replication, info.durability,
                              self.cfg.virtual_segment_bytes, self.pool,
                              in_flight_max=self.cfg.replication_in_flight_max,
                              exclude_s=self.cfg.backup_exclude_s, counters=self.counters,
                              vseg_base=vseg_id(self.epoch() or 0, 0))
            self.vlogs[key] = vlog
            self.vlog_list.append(vlog)
        return vlog


# Groups looked back over to find a slot's previous group (a few per active group suffice).
SLOT_LOOKBACK_GROUPS = 64


def _slot_vlog(stream: "Stream", group: Group) -> VirtualLog | None:
    """The log of the previous group of `group`'s slot while that group is not wholly durable
    (None: any log will do)."""
    streamlet = stream.streamlets.get(group.streamlet)
    if streamlet is None:
        return None
    groups = streamlet.groups
    i = group.id - streamlet.first_group - 1
    stop = max(-1, i - SLOT_LOOKBACK_GROUPS)
    while i > stop:
        other = groups[i]
        if other.slot == group.slot and other is not group:
            if other.finished:
                return None   # nothing of it left to replicate: no order to keep
            vlog = other.vlog
            info = stream.info
            if vlog is not None and vlog.copies == info.replication - 1 \
                    and vlog.durability == info.durability:
                return vlog
            return None
        i -= 1
    return None
