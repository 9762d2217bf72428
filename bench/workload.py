"""One workload definition drives both systems; presets are lists of them scaled to 2 cores.

A Workload names everything a run depends on: client processes, stream layout, replication,
chunking, record size, timing. `kera_layout` and `kafka_layout` say how each system realises it
(R copies: kera = 1 broker + R-1 backups, Kafka = R brokers with `acks=all`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB

CHUNK_HEADER_BYTES = 64 + 4        # kera chunk header + the producer's reserve (accumulator)
RECORD_OVERHEAD_BYTES = 12         # kera: i64 timestamp + u32 value offset per record
HEADERS_INDEX_BYTES = 4            # kera: a record's offset into the headers column
HEADER_OVERHEAD_BYTES = 8          # kera: per header pair, its key and value offsets
STAMP_BYTES = 8                    # send time (µs, little-endian i64) at the start of each value
ONE_PER_SUB_PARTITION = 0          # virtual_logs value meaning "streams x streamlets x groups"
# Default producer buffer: closed-loop producers keep it full, so it sets the queueing delay
# (buffer / throughput) and how long the final flush takes; sized in chunks, capped.
BUFFER_CHUNKS = 1024
BUFFER_BYTES_MAX = 8 * MiB
# Codecs both systems have (kera.codec.chunk.COMPRESSIONS; Kafka's compression.type), and record
# contents: random bytes compress not at all, text (words of a small vocabulary, like logs or
# JSON) about as well as typical event data.
COMPRESSIONS = ("none", "lz4", "zstd")
PAYLOADS = ("random", "text")


@dataclass(frozen=True)
class Workload:
    name: str
    producers: int = 1                  # P: producer processes (one client each)
    consumers: int = 1                  # C: consumer processes (one client each, or one per stream for kera)
    streams: int = 1                    # S: kera streams = Kafka topics
    streamlets: int = 1                 # per stream = Kafka partitions per topic
    active_groups: int = 1              # Q: kera active groups per streamlet (no Kafka equivalent)
    replication: int = 1                # R: copies of each record
    virtual_logs: int | None = None     # V per kera broker; None = broker default, 0 = one per sub-partition
    chunk_size_bytes: int = 16 * KiB    # kera chunk = Kafka batch.size
    linger_ms: float = 5.0              # both
    record_size_bytes: int = 100        # value bytes (no keys)
    warmup_s: float = 2.0               # excluded from the measurement
    duration_s: float = 5.0             # measured window
    buffer_bytes: int | None = None     # producer buffer (kera buffer_bytes = Kafka queue.buffering.max.kbytes); None: BUFFER_CHUNKS chunks, at most BUFFER_BYTES_MAX
    rate_records_per_s: int = 0         # per producer; 0 = as fast as the system takes them
    durability: str = "memory"          # kera backups ack from memory; Kafka acks from page cache
    compression: str = "none"           # both: none, lz4 or zstd (per kera chunk / Kafka batch)
    payload: str = "random"             # record bytes: random (incompressible) or text (words)
    headers: int = 0                    # both: header pairs per record ("h<i>" -> 8 bytes)
    # The kera broker's --memory-limit, MiB; 0: its default (a quarter of RAM). Kafka has none
    # (its brokers write to the page cache as always).
    memory_limit_mib: int = 0
    tags: dict = field(default_factory=dict, compare=False, hash=False)  # the swept values, for tables

    def __post_init__(self) -> None:
        for name in ("producers", "consumers", "streams", "streamlets", "active_groups",
                     "replication"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.record_size_bytes < STAMP_BYTES:
            raise ValueError(f"record_size_bytes must be >= {STAMP_BYTES} (the send-time stamp)")
        if self.records_per_chunk < 1:
            raise ValueError(f"chunk_size_bytes={self.chunk_size_bytes} holds no record of "
                             f"{self.record_size_bytes} bytes")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}: use one of {', '.join(COMPRESSIONS)}")
        if self.payload not in PAYLOADS:
            raise ValueError(f"payload={self.payload!r}: use one of {', '.join(PAYLOADS)}")
        if self.memory_limit_mib < 0:
            raise ValueError("memory_limit_mib must be >= 0 (0: the broker's default)")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("duration_s must be > 0 and warmup_s >= 0")

    # ------------------------------------------------------------------ derived
    @property
    def records_per_chunk(self) -> int:
        """Records of one send unit: what fills one kera chunk (and one Kafka batch)."""
        return (self.chunk_size_bytes - CHUNK_HEADER_BYTES) // (
            self.record_size_bytes + RECORD_OVERHEAD_BYTES + self.record_header_bytes)

    @property
    def record_headers(self) -> list[tuple[str, bytes]]:
        """The header pairs every record carries (the same for both systems)."""
        return [(f"h{i}", b"%08d" % i) for i in range(self.headers)]

    @property
    def record_header_bytes(self) -> int:
        """What a record's headers add to a kera chunk (index + key, value, offsets)."""
        if not self.headers:
            return 0
        return HEADERS_INDEX_BYTES + sum(len(k) + len(v) + HEADER_OVERHEAD_BYTES
                                         for k, v in self.record_headers)

    @property
    def producer_buffer_bytes(self) -> int:
        if self.buffer_bytes is not None:
            return max(self.buffer_bytes, self.chunk_size_bytes)
        return min(BUFFER_BYTES_MAX, BUFFER_CHUNKS * self.chunk_size_bytes)

    @property
    def sub_partitions(self) -> int:
        return self.streams * self.streamlets * self.active_groups

    @property
    def effective_virtual_logs(self) -> int | None:
        if self.virtual_logs == ONE_PER_SUB_PARTITION:
            return self.sub_partitions
        return self.virtual_logs

    def kera_layout(self) -> dict:
        return {"brokers": 1, "backups": self.replication - 1,
                "virtual_logs": self.effective_virtual_logs,
                "memory_limit_mib": self.memory_limit_mib}

    def kafka_layout(self) -> dict:
        return {"brokers": self.replication,
                "min_insync_replicas": 2 if self.replication >= 3 else 1}

    def label(self) -> str:
        if self.tags:
            return " ".join(f"{k}={v}" for k, v in self.tags.items())
        return self.name

    def replace(self, **changes) -> "Workload":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["records_per_chunk"] = self.records_per_chunk
        d["sub_partitions"] = self.sub_partitions
        d["producer_buffer_bytes"] = self.producer_buffer_bytes
        d["effective_virtual_logs"] = self.effective_virtual_logs
        d["label"] = self.label()
        return d


# ---------------------------------------------------------------------- assignments

def producer_streams(w: Workload, index: int) -> list[int]:
    """Streams producer `index` writes to: its share when there are enough, else all of them."""
    if w.streams >= w.producers:
        return [s for s in range(w.streams) if s % w.producers == index]
    return list(range(w.streams))


def consumer_partitions(w: Workload, index: int) -> dict[int, list[int]]:
    """{stream: [streamlets]} consumer `index` reads: every (stream, streamlet) pair exactly once
    over all consumers, dealt round-robin."""
    out: dict[int, list[int]] = {}
    k = 0
    for s in range(w.streams):
        for sl in range(w.streamlets):
            if k % w.consumers == index:
                out.setdefault(s, []).append(sl)
            k += 1
    return out


# ---------------------------------------------------------------------- presets

@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    workloads: tuple
    repeats: int = 2                   # kera/Kafka pairs per workload (medians over them)
    ceiling_bytes: int = 256 * MiB     # bytes moved by the raw pyzmq ceiling per chunk size
    systems: tuple = ()                # systems run without --systems (empty: kera and kafka)
    equal_load: tuple = ()             # then all systems at these fractions of the slower max


# The systems of the presets that ask for a Kafka people trust: the Python client with the
# workload's settings and tuned for throughput, and Kafka's own Java tools with both.
REFERENCE_SYSTEMS = ("kera", "kafka", "kafka-tuned", "kafka-java", "kafka-java-tuned")


def _quick() -> Preset:
    base = Workload("quick", producers=1, consumers=1, streams=2, streamlets=2,
                    chunk_size_bytes=16 * KiB, warmup_s=1.0, duration_s=3.0)
    return Preset("quick", "two small configurations, R=1: as fast as each system goes, and "
                  "latency at the same offered load (50k records/s); a smoke run of the whole "
                  "harness (under two minutes)",
                  (base.replace(tags={"load": "max"}),
                   base.replace(name="quick-50k", rate_records_per_s=50_000,
                                tags={"load": "50k rec/s"})),
                  repeats=2, ceiling_bytes=128 * MiB)


def _streams() -> Preset:
    out = []
    for r in (1, 2, 3):
        for s in (8, 32, 128, 512):
            out.append(Workload(f"streams-{s}-r{r}", producers=2, consumers=2, streams=s,
                                streamlets=1, replication=r, chunk_size_bytes=1 * KiB,
                                warmup_s=2.0, duration_s=5.0, tags={"R": r, "streams": s}))
    return Preset("streams", "scaling streams 8..512 with 1 KiB chunks, R=1/2/3 "
                  "(KerA Figs. 8, 10, 12)", tuple(out))


def _clients() -> Preset:
    out = []
    for pc in (1, 2, 4):
        out.append(Workload(f"clients-{pc}", producers=pc, consumers=pc, streams=128,
                            streamlets=1, replication=1, chunk_size_bytes=16 * KiB,
                            warmup_s=2.0, duration_s=5.0,
                            tags={"producers": pc, "consumers": pc}))
    return Preset("clients", "128 streams, 16 KiB chunks, 1/2/4 producer and consumer processes "
                  "(KerA Fig. 9)", tuple(out))


def _throughput() -> Preset:
    out = []
    for r in (1, 3):
        for kib in (4, 16, 64):
            out.append(Workload(f"throughput-{kib}k-r{r}", producers=2, consumers=2, streams=1,
                                streamlets=32, active_groups=4, replication=r,
                                chunk_size_bytes=kib * KiB, warmup_s=2.0, duration_s=5.0,
                                tags={"R": r, "chunk_KiB": kib}))
    return Preset("throughput", "one stream of 32 streamlets x 4 active groups, chunks of "
                  "4-64 KiB, R=1/3 (KerA Figs. 11, 17)", tuple(out))


def _vlogs() -> Preset:
    out = []
    for v in (1, 4, 32, ONE_PER_SUB_PARTITION):
        w = Workload(f"vlogs-{v or 'all'}", producers=2, consumers=2, streams=16, streamlets=4,
                     active_groups=2, replication=3, virtual_logs=v, chunk_size_bytes=4 * KiB,
                     warmup_s=2.0, duration_s=5.0)
        out.append(w.replace(tags={"V": w.effective_virtual_logs}))
    return Preset("vlogs", "R=3 with 1, 4, 32 and one virtual log per sub-partition "
                  "(16 streams x 4 streamlets x 2 groups; KerA Figs. 13-16)", tuple(out))


def _compression() -> Preset:
    out = []
    for codec in COMPRESSIONS:
        out.append(Workload(f"compression-{codec}", producers=2, consumers=2, streams=1,
                            streamlets=8, replication=3, chunk_size_bytes=64 * KiB,
                            payload="text", compression=codec, warmup_s=2.0, duration_s=5.0,
                            tags={"compression": codec}))
    return Preset("compression", "text records (compressible) with no compression, lz4 and "
                  "zstd, 64 KiB chunks, R=3", tuple(out))


def _headers() -> Preset:
    out = []
    for pairs in (0, 2):
        out.append(Workload(f"headers-{pairs}", producers=2, consumers=2, streams=1,
                            streamlets=8, replication=3, chunk_size_bytes=16 * KiB,
                            headers=pairs, warmup_s=2.0, duration_s=5.0,
                            tags={"headers": pairs}))
    return Preset("headers", "records without and with 2 headers each, 16 KiB chunks, R=3 "
                  "(kera send_batch with headers; Kafka produce() per record, as produce_batch "
                  "drops headers)", tuple(out))


# The memory-full preset's broker budget: above what the open segments map (32 streamlets x 4
# groups x 8 MiB = 1 GiB, counted whole), and filled within the warm-up at these rates.
MEMORY_FULL_LIMIT_MIB = 2048
MEMORY_FULL_WARMUP_S = 15.0


def _memory_full() -> Preset:
    out = []
    for kib in (16, 64):
        out.append(Workload(f"memory-full-{kib}k-r3", producers=2, consumers=2, streams=1,
                            streamlets=32, active_groups=4, replication=3,
                            chunk_size_bytes=kib * KiB, memory_limit_mib=MEMORY_FULL_LIMIT_MIB,
                            warmup_s=MEMORY_FULL_WARMUP_S, duration_s=8.0,
                            tags={"R": 3, "chunk_KiB": kib, "memory_MiB": MEMORY_FULL_LIMIT_MIB}))
    return Preset("memory-full", "the throughput preset's R=3 rows in steady state: the kera "
                  f"broker's --memory-limit is {MEMORY_FULL_LIMIT_MIB} MiB, filled during a "
                  f"{MEMORY_FULL_WARMUP_S:.0f} s warm-up, so it writes to its disk (tiers) all "
                  "it takes in while measured; Kafka's brokers are as always (the page cache)",
                  tuple(out))


def _reference() -> Preset:
    out = []
    for r in (1, 3):
        out.append(Workload(f"reference-64k-r{r}", producers=2, consumers=2, streams=1,
                            streamlets=32, active_groups=4, replication=r,
                            chunk_size_bytes=64 * KiB, warmup_s=2.0, duration_s=5.0,
                            tags={"R": r, "chunk_KiB": 64}))
    return Preset("reference", "the throughput preset's 64 KiB configurations (R=1, R=3) on "
                  "kera, Kafka with the Python client as configured and tuned for throughput, "
                  "and Kafka's own Java tools (ProducerPerformance / ConsumerPerformance) as "
                  "configured and tuned", tuple(out), repeats=2, systems=REFERENCE_SYSTEMS)


def _latency_r3() -> Preset:
    w = Workload("latency-r3", producers=2, consumers=2, streams=1, streamlets=8,
                 replication=3, chunk_size_bytes=16 * KiB, warmup_s=2.0, duration_s=5.0,
                 tags={"R": 3, "load": "max"})
    return Preset("latency-r3", "R=3, 1 stream of 8 streamlets, 16 KiB chunks: each system's "
                  "maximum, then every system at 25/50/75% of the slower one's, for "
                  "p50/p99/p99.9 latency at equal offered load", (w,), repeats=1,
                  systems=("kera", "kafka", "kafka-tuned"), equal_load=(0.25, 0.5, 0.75))


PRESETS = {p.name: p for p in (_quick(), _streams(), _clients(), _throughput(), _vlogs(),
                               _compression(), _headers(), _reference(), _latency_r3(),
                               _memory_full())}
