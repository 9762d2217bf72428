"""Defaults shared by daemons and clients; every bound has a name with its unit."""

KiB = 1024
MiB = 1024 * KiB

# Stream layout
DEFAULT_STREAMLETS = 1
DEFAULT_ACTIVE_GROUPS = 1          # Q: groups of a streamlet open to appends at once
DEFAULT_GROUP_SEGMENTS = 16        # G: segments in a group before it closes
DEFAULT_SEGMENT_SIZE_BYTES = 8 * MiB
DEFAULT_REPLICATION = 1            # R: copies of each chunk (broker + R-1 backups)
DURABILITY_MEMORY = "memory"       # backup acks once the replica is in its memory
DURABILITY_DISK = "disk"           # backup acks once the replica is fsynced
DEFAULT_DURABILITY = DURABILITY_MEMORY

# Broker
DEFAULT_VIRTUAL_LOGS = 1           # V: shared virtual logs per broker (replication capacity)
DEFAULT_VIRTUAL_SEGMENT_BYTES = 8 * MiB
REPLICATION_TIMEOUT_S = 2.0        # a backup slower than this is replaced for the open segment
REPLICATION_IN_FLIGHT_MAX = 1      # replication writes in flight per virtual log
PRODUCER_TABLE_MAX = 100_000       # (producer, streamlet) entries kept for duplicate detection
# Entries evicted from that table but kept while their chunks are retained, so a retry of
# any sequence (0 included) is still recognised: ~370 bytes each (measured with tracemalloc),
# so 2 M is ~0.7 GiB at most; past it the oldest evicted producers are forgotten.
PRODUCER_RETAINED_MAX = 2_000_000
# Groups a streamlet retains at once on a broker. Each costs a Python object and its index,
# and `offsets` describes every one in a reply under the 4 MiB header limit (~16 bytes each):
# 65,536 keep that reply near 1 MiB. With the default 16 x 8 MiB groups this is 8 PiB per
# streamlet: only floods of tiny groups reach it.
GROUPS_PER_STREAMLET_MAX = 65_536

# Producer
DEFAULT_CHUNK_SIZE_BYTES = 16 * KiB
DEFAULT_LINGER_MS = 5
DEFAULT_REQUEST_SIZE_BYTES = 1 * MiB
# Produce requests a producer keeps in flight per broker (Kafka's default is 5). With 4 the
# broker idled between requests on a 2-core machine, replies and next requests each waiting for
# a thread to be scheduled; 8 measured faster with less CPU per record (README, "Benchmarks").
# It costs at most this many `request_size_bytes` in flight per broker, within `buffer_bytes`.
DEFAULT_IN_FLIGHT_PER_BROKER = 8
DEFAULT_BUFFER_BYTES = 64 * MiB
DEFAULT_MAX_RECORD_BYTES = 4 * MiB
DEFAULT_SEND_TIMEOUT_S = 30.0
DEFAULT_REQUEST_TIMEOUT_S = 10.0
# A client asks the coordinator about each stream it uses at least this often even when nothing
# failed, so a raised streamlet count reaches producers and consumers (Kafka's
# metadata.max.age.ms is 5 minutes; streamlets added here should be used within a minute).
DEFAULT_METADATA_MAX_AGE_MS = 30_000
# A client request unanswered this long may be waiting on a dead broker: from then on the
# owners of its streamlets are asked again every STALL_PROBE_INTERVAL_S, and once a new owner
# is published (the coordinator declares a broker dead after 2 s by default) the request goes
# there at once instead of after the request timeout. A healthy reply takes milliseconds.
STALL_PROBE_S = 1.0
STALL_PROBE_INTERVAL_S = 0.25

# Consumer
DEFAULT_CACHE_CHUNKS_MAX = 256
DEFAULT_FETCH_MAX_BYTES = 4 * MiB  # per broker request
DEFAULT_FETCH_WAIT_MS = 5          # idle back-off when a fetch returns nothing
# How long a broker may hold a fetch that found nothing, until records arrive (Kafka's
# fetch.max.wait.ms, whose default is 500): a consumer at the end of its streams then asks
# about 10 times a second instead of 200, and gets new records as soon as they are durable.
# It is also how late a seek or a new assignment of an idle consumer can take effect.
DEFAULT_FETCH_MAX_WAIT_MS = 100
# The most a fetch may ask to be held, ms: under STALL_PROBE_S, so a held fetch is not taken
# for a stalled broker.
FETCH_WAIT_MAX_MS = 500

# Coordinator
HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_MISSED_MAX = 20          # a daemon silent this many intervals is declared dead
