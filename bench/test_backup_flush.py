"""A backup's flush of replica bytes (issue 15): CPU per MiB through O_DIRECT and through the
page cache.

    python -m pytest bench/test_backup_flush.py -q -s --benchmark-enable -p no:randomly

Each round flushes FILES replica files of 16 MiB (a flush job's most) in jobs of 1 MiB of 64 KiB
chunks (`kera.backup.disk.flush`, fdatasync and `.meta` record included) into new files that are
kept until the end, as a backup keeps its replicas, so the page cache has to grow. The figure to
read is the summary line's CPU ms per MiB of each path (the process's user + system time: the
flusher's cost to its machine). On this project's VM a growing page cache is slow to fill: two
runs on 2026-11-26 gave 2.52 and 3.51 ms through the page cache, 0.69 and 0.76 ms through
O_DIRECT (kera.backup.direct_write).
"""

from __future__ import annotations

import pytest

from kera.codec import chunk
from kera.backup import direct_write, disk
from kera.backup.meta import Meta
from kera.backup.store import FlushJob

from .procstat import cpu_ms_per_mib

CHUNK_VALUES = 600                     # ~64 KiB chunks of 100-byte values
JOB_BYTES = 1 << 20                    # a flush job's bytes
FILE_BYTES = 16 << 20                  # a replica's bytes (a flush job writes at most this)
FILES = 32                             # per round: 512 MiB
ROUNDS = 3


def _flush_files(root, first: int, payload: bytes) -> int:
    per_job = JOB_BYTES // len(payload)
    written = 0
    for vseg in range(first, first + FILES):
        key, offset = (1, 0, vseg), 0
        while offset + per_job * len(payload) <= FILE_BYTES:
            buffers = (memoryview(payload),) * per_job
            end = offset + per_job * len(payload)
            disk.flush(root, FlushJob(key, offset, buffers, Meta(*key, end, False)))
            written += end - offset
            offset = end
    return written


@pytest.mark.parametrize("path", ["o_direct", "page_cache"])
def test_flush_64k_chunks_into_new_files(benchmark, tmp_path, monkeypatch, path):
    monkeypatch.setattr(direct_write, "_works", path == "o_direct")
    payload = bytes(chunk.encode(1, 0, 1, 0, [b"v" * 100] * CHUNK_VALUES))
    ms, mib = cpu_ms_per_mib(
        benchmark, lambda i: _flush_files(tmp_path, i * FILES, payload), ROUNDS)
    assert direct_write._works is (path == "o_direct")
    print(f"\n{path}: {ms:.2f} ms CPU per MiB flushed ({mib:.0f} MiB)")
