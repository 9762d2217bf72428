"""Placement across hosts, driven through the broker core without sockets: the R-1 backups of
each virtual segment are on different nodes whenever the live backups span enough nodes, also
when a replica fails and is moved, and the segments spread over every node."""

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.errors import StorageError

ME = 7
# Six backups on three hosts, two per host, laid out so that the choice by load and rotation
# alone (without the preference for new hosts) pairs backups of one host: 1 and 3 first.
NODE_OF = {1: "h4", 3: "h4", 4: "h5", 5: "h5", 2: "h6", 6: "h6"}
SEGMENTS = 12


def stream(R=3):
    return {"name": "s", "id": 1, "streamlets": 1, "active_groups": 1, "replication": R,
            "group_segments": 64, "segment_size_bytes": 1 << 20, "durability": "memory",
            "replication_capacity": 0, "placement": [ME], "brokers": {}, "version": 1,
            "ready": True}


def broker(node_of=NODE_OF):
    b = Broker("h2", BrokerConfig(replication_timeout_s=2.0), broker_id=ME)
    b.apply_metadata([stream()], 1)
    b.placement.set_backups([{"id": i, "address": f"10.0.0.{i}:9000", "node": n, "alive": True}
                   for i, n in node_of.items()], 0.0)
    return b


def one_segment(b, seq):
    """Produce a chunk into a new virtual segment and close it; the first writes of that
    segment (one per replica), acknowledged with everything else in flight."""
    b.produce(seq, [chunk.encode(1, seq, 1, 0, [b"r"])], 0.0)
    writes = b.sync(0.0)
    newest = max(w.fields["vseg"] for w in writes)
    b.vlog_list[0].close_open()
    for w in list(b._writes):
        b.write_done(w, {"length": w.end_bytes}, None, 0.0)
    return [w for w in writes if w.fields["vseg"] == newest]


def test_each_virtual_segment_has_its_replicas_on_different_hosts():
    b = broker()
    used = set()
    for seq in range(SEGMENTS):
        nodes = [NODE_OF[w.backup_id] for w in one_segment(b, seq)]
        assert len(nodes) == 2 and len(set(nodes)) == 2, f"segment {seq} on {nodes}"
        used.update(nodes)
    assert used == {"h4", "h5", "h6"}


def test_a_failed_replica_moves_to_a_host_the_segment_is_not_on():
    # Backup 4 shares backup 1's host, and is the one load and rotation alone would pick next.
    nodes = {1: "h4", 2: "h5", 3: "h6", 4: "h4"}
    b = broker(nodes)
    b.produce("a", [chunk.encode(1, 0, 1, 0, [b"r"])], 0.0)
    first, second = b.sync(0.0)
    b.write_done(first, {"length": first.end_bytes}, None, 0.0)
    b.write_done(second, None, StorageError("disk full"), 0.0)
    [again] = [w for w in b.sync(0.0) if w.backup_id != first.backup_id]
    assert again.backup_id != second.backup_id
    assert nodes[again.backup_id] != nodes[first.backup_id], f"both copies on {nodes[first.backup_id]}"


def test_two_hosts_for_two_copies_still_pair_across_hosts():
    b = broker({1: "h4", 2: "h4", 3: "h4", 4: "h5"})
    for seq in range(4):
        nodes = [w.backup_id for w in one_segment(b, seq)]
        assert 4 in nodes, f"segment {seq} on backups {nodes}: both on h4"
