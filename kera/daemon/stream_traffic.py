"""Per-stream traffic as brokers count it: records, chunks and bytes appended and fetched since
the broker started (its `stats` op, labelled metrics, `kera stats --streams`). A stream's
counters live and die with the broker's copy of the stream: a deleted stream's go with it."""

from __future__ import annotations

# The counters, in the order kept; bytes are chunk bytes as stored and sent (compressed ones
# as compressed).
FIELDS = ("records_in", "chunks_in", "bytes_in", "chunks_out", "bytes_out")


class StreamTraffic:
    __slots__ = ("records_in", "chunks_in", "bytes_in", "chunks_out", "bytes_out")

    def __init__(self):
        self.records_in = self.chunks_in = self.bytes_in = 0
        self.chunks_out = self.bytes_out = 0

    def appended(self, records: int, nbytes: int) -> None:
        self.records_in += records
        self.chunks_in += 1
        self.bytes_in += nbytes

    def fetched(self, chunks: int, nbytes: int) -> None:
        self.chunks_out += chunks
        self.bytes_out += nbytes

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}


def summed(per_broker: list[dict]) -> dict[str, dict]:
    """{stream: counters} added up over brokers' `streams` stats (a stream whose streamlets
    live on several brokers has traffic on each)."""
    out: dict[str, dict] = {}
    for streams in per_broker:
        for name, counters in streams.items():
            into = out.setdefault(name, dict.fromkeys(FIELDS, 0))
            for field in FIELDS:
                value = counters.get(field, 0)
                into[field] += value if isinstance(value, int) and not isinstance(value, bool) else 0
    return out
