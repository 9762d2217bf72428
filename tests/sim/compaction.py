"""Compaction in the simulation (issue 38): a compacted stream, its keyed records, the checks.

In one seed in COMPACTION_ONE_IN (`draw_compaction`, a generator of its own: every other draw
of every seed stays as it was) the run gains a stream with cleanup policy `compact`, a keyed
producer writing updates and deletes (tombstones: a None value) to it, and a consumer reading it
from the earliest. The brokers' compactor (kera.broker.compactor, on the `broker-compaction`
worker each broker's DaemonEnv gives it: tests/sim/daemons.SimBroker) runs its passes while the
faults go on.

Every keyed record carries its identity (producer, stream, streamlet, number) in a header, so a
tombstone is followed like any record. `Ledger` checks, where each could first break:

- a record a consumer reads was sent, with that key and value (or tombstone); each producer's
  records of a streamlet are read in send order, never twice (guarantee 3 with gaps), with the
  record number its acknowledgement named (numbers kept), numbers strictly increasing (gaps
  skipped, never re-read);
- after healing, for every key, the consumer read its latest acknowledged record (or a later
  one), and the streamlet's owner holds it: nothing acknowledged is lost but records a later
  record of their key superseded. A key whose latest record is a tombstone may be gone
  altogether once `delete_retention_ms` passed (the seeds that draw a short one, or a
  wall-clock step: the horizon is wall-clock time);
- no half-compacted state: every record the owner holds appears once, in send order, at the
  number it was acknowledged with (tests/sim/checker.check_numbers_dense checks the slot's
  chunks cover its numbers densely, a compacted chunk by its span); and every chunk it serves
  is on R-1 backups (`check_backed`), so what recovery would read back agrees with it.

The chunk-level checks that assume a chunk stays where it was acknowledged (the owner and the
backups hold every acknowledged chunk, the auditor's byte comparison) leave the compacted
stream to these: a pass replaces chunks by design. What the backups hold comes back through
recovery: a broker crash in such a seed makes its streamlets' new owner rebuild them from the
backups (kera.broker.rebuild: each segment wholly original or wholly one rewrite), and the end
checks read that owner.
"""

from __future__ import annotations

import random
from collections import defaultdict

from kera.codec import chunk

from tests.sim.checker import InvariantBroken, chunk_id

COMPACTION_ONE_IN = 4
STREAM = "c0"
# A keyed producer's client number: apart from the plain producers' 0..2.
KEYED_CLIENT = 100
# delete_retention_ms drawn: short enough for tombstones to go within a run, or a day (never).
SHORT_DELETE_RETENTION_MS = 1_000
ID_HEADER = "id"
# Records per batch of the keyed producer: a chunk of them (a header each) fits a segment.
KEYED_BATCH_MAX = 8


def draw_compaction(seed: int, always: bool = False) -> dict | None:
    """The seed's compacted stream and its keyed producer's habits, or None (most seeds;
    `always`: drawn whatever the seed, for scenario tests)."""
    rng = random.Random(f"{seed}/compaction")
    if rng.randrange(COMPACTION_ONE_IN) and not always:
        return None
    spec = {"name": STREAM, "streamlets": rng.randint(1, 2), "active_groups": 1,
            "replication": rng.choice([1, 2, 2, 3]), "group_segments": rng.randint(1, 2),
            "segment_size_bytes": 8192, "durability": rng.choice(["memory", "memory", "disk"]),
            "cleanup_policy": "compact",
            "min_cleanable_dirty_ratio": rng.choice([0.0, 0.2, 0.5]),
            "delete_retention_ms": rng.choice([SHORT_DELETE_RETENTION_MS, 86_400_000])}
    return {"stream": spec, "keys": rng.choice([3, 12, 40]), "records_max": rng.choice([400, 1200]),
            "tombstone_rate": rng.uniform(0.05, 0.25), "interval_s": rng.choice([0.01, 0.03]),
            "producer_id": rng.randrange(1 << 64), "fetch_max_bytes": rng.choice([512, 8192, 1 << 20]),
            # Simulated seconds a pass takes on the broker's compaction thread.
            "pass_s": rng.choice([(0.001, 0.01), (0.05, 0.5)]),
            # When its consumer starts: with the producer, or late, reading compacted ranges.
            "consumer_start_s": rng.choice([0.3, 0.3, 2.5, 6.0])}


def identity(client: int, sid: int, sl: int, n: int) -> bytes:
    return b"%d/%d/%d/%d" % (client, sid, sl, n)


def parse_identity(headers) -> tuple[int, int, int, int]:
    for name, value in headers or ():
        if name == ID_HEADER:
            client, sid, sl, n = bytes(value).split(b"/")
            return int(client), int(sid), int(sl), int(n)
    raise InvariantBroken(f"a keyed record without its identity header: {headers!r:.200}")


class Ledger:
    """What keyed producers sent and had acknowledged, and what readers saw of it."""

    def __init__(self, lossy: set, tombstones_expire: bool = False):
        self.lossy = lossy       # (sid, sl) whose data may go by design (Checker.lossy)
        self.stream_ids: set[int] = set()     # compacted streams (their chunks move)
        # Whether a kept tombstone may expire within the run (a short delete_retention_ms, or
        # a wall-clock step past it: the horizon is wall-clock time, as Kafka's).
        self.tombstones_expire = tombstones_expire
        self.sent: dict[tuple, tuple] = {}                 # (client, sid, sl, n) -> (key, value)
        self.acked_number: dict[tuple, int | None] = {}    # ... acknowledged -> its number
        self.latest: dict[tuple, int] = {}                 # (client, sid, sl, key) -> latest acked n
        self.by_key: dict[tuple, list[int]] = defaultdict(list)   # (client, sid, sl, key) -> ns sent
        self._read_last: dict[str, dict] = defaultdict(dict)      # consumer -> (client, sid, sl) -> n
        self._read_number: dict[str, dict] = defaultdict(dict)    # consumer -> (sid, sl) -> number
        self.read_latest: dict[str, dict] = defaultdict(dict)     # consumer -> key -> n read last
        self.counts: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------------ producers
    def sending(self, client: int, sid: int, sl: int, n: int, key: bytes, value) -> None:
        self.stream_ids.add(sid)
        self.sent[(client, sid, sl, n)] = (key, value)
        self.by_key[(client, sid, sl, key)].append(n)

    def acked(self, client: int, sid: int, sl: int, n: int, number: int | None) -> None:
        ident = (client, sid, sl, n)
        self.acked_number[ident] = number
        key = (client, sid, sl, self.sent[ident][0])
        self.latest[key] = max(self.latest.get(key, -1), n)
        self.counts["keyed_acked"] += 1
        self.counts["tombstones_acked"] += self.sent[ident][1] is None

    # ------------------------------------------------------------------ readers
    def _check_record(self, where: str, sid: int, sl: int, key, value, headers,
                      number: int | None) -> tuple:
        ident = parse_identity(headers)
        client, vsid, vsl, n = ident
        if (vsid, vsl) != (sid, sl):
            raise InvariantBroken(f"{where}: record {ident} found in stream {sid} streamlet {sl}")
        sent = self.sent.get(ident)
        if sent is None:
            raise InvariantBroken(f"{where}: record {ident} was never sent")
        if sent != (key, None if value is None else bytes(value)):
            raise InvariantBroken(f"{where}: record {ident} has key {key!r} value "
                                  f"{value!r:.40}, sent as {sent[0]!r} {sent[1]!r:.40}")
        acked = self.acked_number.get(ident)
        if (sid, sl) in self.lossy:
            return ident    # R=1 failed over: its numbers start again
        if acked is not None and number is not None and acked != number:
            raise InvariantBroken(f"{where}: record {ident} has number {number}, acknowledged "
                                  f"as number {acked} (compaction must keep record numbers)")
        return ident

    def consumed(self, consumer: str, sid: int, sl: int, batch) -> None:
        """A consumer's batch of the compacted stream (kera.consumer.batch.Batch)."""
        numbers = batch.numbers
        numbers = [None] * len(batch) if numbers is None else [int(x) for x in numbers]
        last, latest = self._read_last[consumer], self.read_latest[consumer]
        for key, value, headers, number in zip(batch.keys(), batch.value_list(), batch.headers(),
                                               numbers):
            client, _, _, n = self._check_record(consumer, sid, sl, key, value, headers, number)
            if n <= last.get((client, sid, sl), -1):
                raise InvariantBroken(f"{consumer} read record {n} of producer {client} (stream "
                                      f"{sid} streamlet {sl}) after record "
                                      f"{last[(client, sid, sl)]}: out of order or twice "
                                      f"(guarantee 3, compacted stream)")
            last[(client, sid, sl)] = n
            before = self._read_number[consumer].get((sid, sl))
            if number is not None and before is not None and number <= before \
                    and (sid, sl) not in self.lossy:
                raise InvariantBroken(f"{consumer} read number {number} after {before} in stream "
                                      f"{sid} streamlet {sl}: a gap not skipped forward")
            if number is not None:
                self._read_number[consumer][(sid, sl)] = number
            latest[(client, sid, sl, key)] = n
            self.counts["keyed_read"] += 1
            self.counts["tombstones_read"] += value is None

    # ------------------------------------------------------------------ after healing
    def may_be_gone(self, key: tuple) -> bool:
        """A key's records may all be gone: a tombstone at or after its latest acknowledged
        record, with a delete retention short enough to pass within the run."""
        a = self.latest[key]
        return self.tombstones_expire and any(
            self.sent[(*key[:3], n)][1] is None for n in self.by_key[key] if n >= a)

    def unread(self, consumer: str, held: dict | None, lost: set) -> list:
        """Keys whose latest acknowledged record `consumer` has not read (nor a later one);
        `held` (key -> n held last, from `owner_view`) excuses a key gone by its tombstone."""
        read = self.read_latest[consumer]
        out = []
        for key, a in sorted(self.latest.items()):
            if read.get(key, -1) >= a or key[1:3] in lost:
                continue
            if held is not None and key not in held and self.may_be_gone(key):
                continue
            out.append(key)
        return out

    def owner_view(self, owners: dict) -> dict:
        """(client, sid, sl, key) -> the latest n the owners hold of each compacted streamlet
        they hold, every record checked on the way (sent so, numbered as acknowledged, each
        producer's in send order and once)."""
        held: dict[tuple, int] = {}
        for (sid, sl), broker in sorted(owners.items()):
            if sid not in self.stream_ids:
                continue
            stream = broker.core.streams.get(sid)
            streamlet = stream.streamlets.get(sl) if stream is not None else None
            if streamlet is None:
                continue
            where = f"broker {broker.address} stream {sid} streamlet {sl}"
            last: dict[int, int] = {}
            for group in streamlet.groups:
                for seg in group.segments:
                    for i in range(len(seg)):
                        self._held_chunk(where, sid, sl, chunk.Chunk(seg.view(i)), last, held)
        return held

    def _held_chunk(self, where: str, sid: int, sl: int, c, last: dict, held: dict) -> None:
        first = c.header.number
        offsets = c.record_offsets()
        for i, (key, value, headers) in enumerate(zip(c.keys(), c.values(), c.headers())):
            number = None if first is None else first + int(offsets[i])
            client, _, _, n = self._check_record(where, sid, sl, key, value, headers, number)
            if n <= last.get(client, -1):
                raise InvariantBroken(f"{where} holds record {n} of producer {client} after its "
                                      f"record {last[client]}: twice or out of order")
            last[client] = n
            held[(client, sid, sl, key)] = n

    def check_backed(self, owners: dict, held: dict) -> None:
        """After healing: every chunk an owner holds of a compacted streamlet with R >= 2 (its
        compacted chunks and the originals no pass replaced) is on R-1 backups (`held`:
        Cluster.backup_holdings), so that recovery from the backups would serve what the owner
        serves, each segment wholly original or wholly one rewrite."""
        for (sid, sl), broker in sorted(owners.items()):
            stream = broker.core.streams.get(sid)
            if sid not in self.stream_ids or stream is None or stream.info.replication < 2:
                continue
            for group in stream.streamlets[sl].groups:
                for seg in group.segments:
                    for i in range(len(seg)):
                        h = chunk.read_header(seg.view(i))
                        copies = held.get(chunk_id(h), {})
                        if len(copies) < stream.info.replication - 1:
                            raise InvariantBroken(
                                f"after healing, broker {broker.address} serves chunk group "
                                f"{h.group} offset {h.base_offset} of compacted stream {sid}/{sl} "
                                f"({'compacted' if chunk.compacted(h) else 'original'}), held by "
                                f"backups {sorted(copies)} only (R={stream.info.replication})")
                        self.counts["compacted_chunks_backed"] += 1

    def check_owners(self, owners: dict, lost: set) -> None:
        """After healing: each key's latest acknowledged record (or a later one) is held by
        its streamlet's owner, unless the key may be gone by its tombstone."""
        held = self.owner_view(owners)
        for key, a in sorted(self.latest.items()):
            if key[1:3] in lost or key[1:3] not in owners:
                continue
            if held.get(key, -1) >= a or (key not in held and self.may_be_gone(key)):
                continue
            raise InvariantBroken(
                f"broker {owners[key[1:3]].address}, owner of compacted stream {key[1]} streamlet "
                f"{key[2]}, lost key {key[3]!r} of producer {key[0]}: its latest acknowledged "
                f"record is {a}, it holds {held.get(key)} (a record no later one superseded)")
        if self.latest:
            self.counts["keys_checked"] += len(self.latest)
