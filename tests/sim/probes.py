"""Processes that probe the daemons rather than use them: a replica auditor and a fuzzer.

The auditor reads replicas back from backups now and then, as a recovering broker would, and
checks what it gets (the read-back checksum, and equality with the broker's copy). The fuzzer
sends bad input (guarantee 6).
"""

from __future__ import annotations

from kera.codec import chunk

from kera.codec import wire
from kera.errors import KeraError

from tests.sim.checker import InvariantBroken, chunk_id
from tests.sim.clients import Client


# ====================================================================== auditor

class SimAuditor(Client):
    """Reads replicas back from backups now and then, as a recovering broker would: whatever
    a backup serves must pass its checksums and equal the broker's copy; a corruption it
    reports must be one that was injected (kera.backup.server: read_replica)."""

    INTERVAL_S = 0.3

    def __init__(self, net, address, rng, checker, coordinator, cluster):
        super().__init__(net, address, "auditor", rng, checker, coordinator)
        self.cluster = cluster
        self.busy_until = 0.0
        self._asked: dict[int, tuple] = {}
        self.detected = 0
        self.reads = 0

    def start(self) -> None:
        self.boot()
        self.every(self.INTERVAL_S, self.loop)

    def loop(self) -> None:
        now = self.sched.now
        if now < self.busy_until:
            return
        backups = [b for b in self.cluster.backups if b.up]
        if not backups:
            return
        backup = self.rng.choice(backups)
        broker = self.rng.choice(self.cluster.brokers)
        self._ask(backup, ("list", broker.broker_id), "list_replicas", {"broker_id": broker.broker_id})

    def _ask(self, backup, what: tuple, op: str, fields: dict) -> None:
        self._asked.clear()
        self._asked[self.send_request(backup.address, op, fields)] = (backup, what)
        self.busy_until = self.sched.now + 2.0

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        asked = self._asked.pop(header.get("id"), None)
        if asked is None:
            return
        backup, what = asked
        self.busy_until = 0.0
        if what[0] == "list":
            replicas = [r for r in header.get("replicas", []) if r["length"] > 0] if header.get("ok") else []
            if replicas:
                r = self.rng.choice(replicas)
                key = (r["broker_id"], r["vlog"], r["vseg"])
                self._read(backup, key, 0)
            return
        key, offset = what[1], what[2]
        if header.get("ok") is not True:
            if header.get("code") == "corrupt_chunk":
                if not backup.disk.damaged(key, offset, 1 << 62):
                    raise InvariantBroken(f"backup {backup.address} reported replica {key} from "
                                          f"byte {offset} corrupt, but no byte of it was damaged: "
                                          f"{header.get('message')}")
                self.detected += 1
            return
        self.reads += 1
        at = offset
        for frame in frames:
            try:
                h = chunk.verify(frame)
            except KeraError as err:
                raise InvariantBroken(f"backup {backup.address} served a corrupt chunk of replica "
                                      f"{key} at byte {at}: {err}") from None
            self._compare(key, h, frame)
            at += len(frame)
        if at != header.get("end"):
            raise InvariantBroken(f"backup {backup.address} read of {key} at {offset}: chunks end "
                                  f"at {at}, reply says {header.get('end')}")
        if at < header.get("length", 0) and self.rng.random() < 0.8:
            self._read(backup, key, at)

    def _read(self, backup, key: tuple, offset: int) -> None:
        self._ask(backup, ("read", key, offset), "read_replica",
                  {"broker_id": key[0], "vlog": key[1], "vseg": key[2], "offset": offset,
                   "max_bytes": self.rng.choice([1, 2048, 65536])})

    def _compare(self, key: tuple, h: chunk.ChunkHeader, data: bytes) -> None:
        """An acknowledged chunk read back from a backup is byte for byte the one a broker
        serves at that position (unacknowledged ones may legitimately differ: a failover may
        have lost them and the position been reused)."""
        if chunk_id(h) not in self.checker.acked_chunks or h.stream_id in self.checker.moving:
            return   # (a compacted stream's chunk may have been replaced by a pass since)
        for broker in self.cluster.brokers:
            if not broker.up:
                continue
            stored, group, _ = self.checker._stored_chunk(broker.core, h.stream_id, h.streamlet,
                                                          h.group, h.base_offset)
            if stored is None:
                continue
            si, ci = group.locate(h.base_offset)
            if bytes(group.segments[si].view(ci)) != bytes(data):
                raise InvariantBroken(f"replica {key} holds acknowledged chunk group {h.group} "
                                      f"offset {h.base_offset} of stream {h.stream_id}/"
                                      f"{h.streamlet} with other bytes than broker {broker.address}")


# ====================================================================== fuzzer

_JUNK = [None, -1, 2**64 - 1, -2**63, 1.5, True, "x" * 300, [], {}, [1, "a"], {"a": None}, b"\xff" * 9]


class SimFuzzer(Client):
    """Sends bad input to the daemons now and then (guarantee 6): headers that are not
    msgpack, not maps, of another protocol version, unknown ops, fields of the wrong type, and
    chunks with a byte flipped. Every one must get an error reply (or be dropped), never crash
    a daemon (the shell fails the run on any exception but a KeraError) or store anything."""

    INTERVAL_S = 0.2
    # Ops sent with junk fields: ones where junk can only be refused (no op whose fields are
    # all optional and that changes state, e.g. a coordinator's create_stream).
    FIELD_OPS = {"broker": ["produce", "fetch", "offsets"],
                 "backup": ["replicate", "read_replica", "list_replicas"],
                 "coordinator": ["describe_stream", "heartbeat", "broker_streams"]}

    def __init__(self, net, address, rng, checker, coordinator, cluster):
        super().__init__(net, address, "fuzzer", rng, checker, coordinator)
        self.cluster = cluster
        self.sent = 0
        self.answered = 0

    def start(self) -> None:
        self.every(self.INTERVAL_S, self.loop)

    def loop(self) -> None:
        rng = self.rng
        kind, target = rng.choice([("coordinator", self.cluster.coordinator),
                                   *[("broker", b) for b in self.cluster.brokers],
                                   *[("backup", b) for b in self.cluster.backups]])
        roll = rng.random()
        self.sent += 1
        if roll < 0.15:
            parts = [rng.choice([b"", b"\xc1", b"\x93\x01\x02\x03", bytes(rng.randrange(256) for _ in range(20))])]
        elif roll < 0.25:
            parts = [wire.request(rng.choice(["nope", "", "x" * 70]), 5, None)]
        elif roll < 0.3:
            parts = [wire.pack({"v": 9, "op": "stats", "id": 6})]
        elif roll < 0.65 or kind == "coordinator":
            op = rng.choice(self.FIELD_OPS[kind])
            fields = {name: rng.choice(_JUNK) for name in rng.sample(
                ["sid", "sl", "reads", "broker_id", "vlog", "vseg", "offset", "max_bytes",
                 "durability", "close", "name", "kind", "daemon_id", "metadata_version", "acks"],
                rng.randint(1, 6))}
            parts = [wire.request(op, 7, fields), *self._chunks(rng.randint(0, 2), flip=rng.random() < 0.5)]
        elif kind == "broker":
            parts = [wire.request("produce", 8, None), *self._chunks(rng.randint(1, 3), flip=True)]
        else:
            parts = [wire.request("replicate", 9, {"broker_id": 4000 + rng.randrange(3), "vlog": 0,
                                                   "vseg": rng.randrange(3), "offset": 0,
                                                   "durability": "memory", "close": False}),
                     *self._chunks(rng.randint(1, 3), flip=True)]
        self.net.send(self.address, self.incarnation, target.address, None, parts)

    def _chunks(self, n: int, flip: bool) -> list[bytes]:
        """Chunks of a stream that does not exist, one byte flipped (the checksums must catch
        it) unless `flip` is false."""
        out = []
        for _ in range(n):
            data = bytearray(chunk.encode(self.rng.randrange(1 << 64), 0, 1 << 40, 0,
                                          [b"junk"] * self.rng.randint(1, 5), timestamps=0))
            if flip:
                data[self.rng.randrange(len(data))] ^= self.rng.randrange(1, 256)
            out.append(bytes(data))
        return out

    def on_client_reply(self, src: str, header: dict, frames: list) -> None:
        self.answered += 1
        if header.get("ok") is False and header.get("code") == "internal":
            raise InvariantBroken(f"{src} answered bad input with an internal error: "
                                  f"{header.get('message')}")
