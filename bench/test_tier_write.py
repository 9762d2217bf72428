"""A broker's tier write of a sealed segment (issue 15): CPU per MiB through O_DIRECT and
through the page cache.

    python -m pytest bench/test_tier_write.py -q -s --benchmark-enable -p no:randomly

A broker at its `--memory-limit` writes every segment it takes in to its data dir
(kera.broker.tier), on its tier thread, competing with the server loop for the machine. Each round
writes FILES segment files of 8 MiB (the default segment) with `tier_files.write_segment`
(fdatasync and the `.meta` record included) into new files that are kept until the end, as a
broker keeps its tiered segments, so the page cache has to grow. The figure to read is the
summary line's CPU ms per MiB of each path (the process's user + system time).
"""

from __future__ import annotations

import mmap

import pytest

from kera.codec import chunk
from kera.backup import direct_write
from kera.broker import tier_files

from .procstat import cpu_ms_per_mib

SEGMENT_BYTES = 8 << 20                # the default segment
CHUNK_VALUES = 600                     # ~64 KiB chunks of 100-byte values
FILES = 48                             # per round: 384 MiB
ROUNDS = 3


def _segment() -> tuple[memoryview, int, int]:
    """A segment's bytes (whole chunks, as in memory), its length and its chunk count."""
    one = chunk.encode(1, 0, 1, 0, [b"v" * 100] * CHUNK_VALUES)
    count = SEGMENT_BYTES // len(one)
    buf = mmap.mmap(-1, SEGMENT_BYTES)
    buf.write(bytes(one) * count)
    return memoryview(buf), count * len(one), count


def _write_files(root, first: int, data, length: int, chunks: int) -> int:
    for group in range(first, first + FILES):
        record = tier_files.SegmentRecord(1, 0, group, 0, 0, length, chunks, 0, chunks, 0, 0,
                                          SEGMENT_BYTES, 0, True)
        tier_files.write_segment(root, record, data)
    return FILES * length


@pytest.mark.parametrize("path", ["o_direct", "page_cache"])
def test_tier_8mib_segments_into_new_files(benchmark, tmp_path, monkeypatch, path):
    monkeypatch.setattr(direct_write, "_works", path == "o_direct")
    data, length, chunks = _segment()
    ms, mib = cpu_ms_per_mib(
        benchmark, lambda i: _write_files(tmp_path, i * FILES, data, length, chunks), ROUNDS)
    assert direct_write._works is (path == "o_direct")
    print(f"\n{path}: {ms:.2f} ms CPU per MiB tiered ({mib:.0f} MiB)")
