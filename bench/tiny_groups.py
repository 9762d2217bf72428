"""Memory of tiny chunks into many groups (issue 10, item 4): one 10-byte record into each of
2,000 groups of 8 MiB segments under a 64 MiB memory limit, on the broker's sans-IO core.
Prints what was stored and throttled, the segments mapped, the `memory_bytes` stat and the
process's RSS growth.

    python -m kera.bench.tiny_groups
"""
from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.broker.memory import resident_bytes
from kera.broker.tier import TierConfig
from kera.errors import Throttled
Q = 2000   # groups, one slot each
desc = {"name": "s", "id": 1, "streamlets": 1, "active_groups": Q, "replication": 1,
        "group_segments": 16, "segment_size_bytes": 8 << 20, "durability": "memory",
        "placement": [1], "brokers": {}, "version": 1, "ready": True}
b = Broker("n", BrokerConfig(tier=TierConfig(memory_limit_bytes=64 << 20)), broker_id=1)
b.apply_metadata([desc], 1)
r0 = resident_bytes()["VmRSS"]
stored = throttled = 0
for p in range(Q):
    try:
        res = b.produce(p, [chunk.encode(p, 0, 1, 0, [b"x" * 10])], 0.0)
        stored += isinstance(res[0][0], int)
    except Throttled:
        throttled += 1
segs = [s for g in b.streams[1].streamlets[0].groups for s in g.segments]
print(f"stored {stored} chunks ({b.bytes_appended} bytes), throttled {throttled}; "
      f"segments mapped {len(segs)} ({sum(s.capacity_bytes for s in segs) >> 20} MiB of capacity); "
      f"memory_bytes stat {b.stats()['memory_bytes']}; RSS growth {(resident_bytes()['VmRSS'] - r0) >> 10} KiB")
