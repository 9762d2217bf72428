"""Replica files: the blocking file I/O, run only by the flusher and reader threads and at startup.

Layout under the data dir: `<broker_id>/<vlog:04d>-<vseg:012d>.seg` holds the replica's chunks
back to back, exactly the bytes the store holds in memory; `<…>.meta` next to it is the commit
record (kera.backup.meta): only its `length` bytes of the `.seg` file count. Zero-padded names
make `ls` list a broker's replicas in log order.

Write order of a flush: chunk bytes at their offset, fdatasync, then the metadata record into
the `.meta` file's next slot, fdatasync (kera.backup.meta); the directory is fsynced only when
the flush created a file. A crash at any point leaves the previous record, which names only
bytes that were synced before it. Rewriting the record by temp file + rename + directory fsync
instead cost the flusher about as much as the data itself (issue 15: 30-40% of a backup's
flusher samples at 4-64 KiB chunks). The chunk bytes go through O_DIRECT where the filesystem
allows it (kera.backup.direct_write says why), through the page cache where it does not.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kera.codec import chunk
from kera.daemon.durable import fsync_dir, unlink_durable
from kera.errors import CorruptChunk

from kera.backup import direct_write
from kera.backup import meta as meta_codec
from kera.backup.meta import Meta
from kera.backup.replica import Key
from kera.backup.store import DiskRead, DropJob, FlushJob

log = logging.getLogger(__name__)


def base_name(key: Key) -> str:
    return f"{key[1]:04d}-{key[2]:012d}"


def segment_path(root: Path, key: Key) -> Path:
    return root / str(key[0]) / f"{base_name(key)}.seg"


def meta_path(root: Path, key: Key) -> Path:
    return root / str(key[0]) / f"{base_name(key)}.meta"


# --------------------------------------------------------------------------- writing

def flush(root: Path, job: FlushJob) -> None:
    """Run one flush job; raises OSError (full disk, I/O error, bad directory) to the caller."""
    directory = root / str(job.key[0])
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
    # A flush at 0 is a replica's first (or its first since a reset): nothing of an earlier
    # file counts, so it goes (its record, if one is left, then names more than the file holds
    # and `scan` skips it).
    truncate = os.O_TRUNC if job.offset == 0 else 0
    path = segment_path(root, job.key)
    fd, created, direct = _open_segment(path, truncate)
    try:
        if direct:
            direct_write.write_or_fall_back(fd, path, job.buffers, job.offset, job.meta.length)
        else:
            direct_write.pwrite_all(fd, job.buffers, job.offset)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    # A new file's name is durable only once its directory is synced; the record's own fsync
    # below is what commits the bytes.
    if write_meta(root, job.meta) or created:
        fsync_dir(directory)


def _open_segment(path: Path, flags: int) -> tuple[int, bool, bool]:
    """An fd of a replica file for writing, whether it was created, and whether it is O_DIRECT
    (kera.backup.direct_write); a filesystem without O_DIRECT (tmpfs) gets buffered writes."""
    if direct_write.works():
        try:
            return (*_open_or_create(path, flags | os.O_RDWR | os.O_DIRECT), True)
        except OSError as err:
            direct_write.give_up(err, path, "opening with O_DIRECT")
    return (*_open_or_create(path, flags | os.O_WRONLY), False)


def _open_or_create(path: Path, flags: int) -> tuple[int, bool]:
    """An fd of `path` (opened with `flags`), and whether this call created the file."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(path, flags), False


def run(root: Path, job) -> None:
    """The flusher thread's job: a FlushJob, or the removal of a dropped replica (DropJob)."""
    if isinstance(job, DropJob):
        remove(root, job.key)
    else:
        flush(root, job)


def remove(root: Path, key: Key) -> None:
    """Delete a replica's files: the metadata record first, so a crash in between leaves a
    `.seg` file no record names (ignored by `scan`). Each unlink is made durable (directory
    fsync) before the next, so that order holds after a machine crash too."""
    for path in (meta_path(root, key), segment_path(root, key)):
        unlink_durable(path)


def write_meta(root: Path, meta: Meta) -> bool:
    """Commit `meta` into the slot after the newest one on file and fdatasync it; returns
    whether the `.meta` file was created (its directory then needs an fsync). Raises OSError."""
    key = (meta.broker_id, meta.vlog, meta.vseg)
    fd, created = _open_or_create(meta_path(root, key), os.O_RDWR)
    try:
        seq = 0 if created else _next_seq(fd)
        record = meta_codec.encode(meta, seq)
        if os.pwrite(fd, record, meta_codec.slot_offset(seq)) != len(record):
            raise OSError(f"short write of the metadata record of {base_name(key)}")
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return created


def _next_seq(fd: int) -> int:
    """One past the newest valid record's seq; 0 when no slot holds one (nothing was committed,
    so either slot may be overwritten)."""
    try:
        return meta_codec.newest(os.pread(fd, meta_codec.FILE_BYTES_MAX, 0))[0] + 1
    except meta_codec.CorruptMeta:
        return 0


# --------------------------------------------------------------------------- reading

def read_meta(path: Path) -> Meta:
    with open(path, "rb") as f:
        return meta_codec.decode_file(f.read(meta_codec.FILE_BYTES_MAX + 1))


def scan(root: Path) -> list[Meta]:
    """Every replica recorded under `root` whose metadata record and file check out; anything
    else is logged and skipped (never deleted: an operator may want to look at it)."""
    found: list[Meta] = []
    if not root.is_dir():
        return found
    for directory in sorted(root.iterdir()):
        if not directory.is_dir() or not directory.name.isdigit():
            continue
        for path in sorted(directory.glob("*.meta")):
            try:
                record = read_meta(path)
                key = (record.broker_id, record.vlog, record.vseg)
                if meta_path(root, key) != path:
                    raise meta_codec.CorruptMeta(f"record names {key}, not this file")
                size = segment_path(root, key).stat().st_size
                if size < record.length:
                    raise meta_codec.CorruptMeta(f"segment file holds {size} of {record.length} bytes")
            except (OSError, meta_codec.CorruptMeta) as err:
                log.error("skipping replica record %s: %s", path, err)
                continue
            found.append(record)
    return found


def read_chunks(root: Path, job: DiskRead) -> list[memoryview]:
    """Whole chunks of the replica file from `job.offset`, verified again on the way out."""
    with open(segment_path(root, job.key), "rb", buffering=0) as f:
        first = os.pread(f.fileno(), chunk.HEADER_SIZE, job.offset)
        if len(first) < chunk.HEADER_SIZE or job.offset + chunk.HEADER_SIZE > job.limit:
            raise CorruptChunk(f"no chunk header at byte {job.offset} of {base_name(job.key)}")
        want = max(job.max_bytes, chunk.chunk_size(first))
        size = min(want, job.limit - job.offset)
        data = memoryview(os.pread(f.fileno(), size, job.offset))
    if len(data) < size:
        raise CorruptChunk(f"{base_name(job.key)} is shorter than its metadata record says")
    chunks: list[memoryview] = []
    at = 0
    while at + chunk.HEADER_SIZE <= len(data):
        end = at + chunk.chunk_size(data, at)
        if end > len(data):
            break  # the next chunk does not fit in max_bytes (or is cut by the limit)
        try:
            chunk.verify(data[at:end])
        except CorruptChunk as err:
            raise CorruptChunk(f"{base_name(job.key)} byte {job.offset + at}: {err.message} "
                               f"(not a chunk boundary, or the file is damaged)") from None
        chunks.append(data[at:end])
        at = end
    if not chunks:
        raise CorruptChunk(f"{base_name(job.key)}: the chunk at byte {job.offset} runs past "
                           f"the replica's {job.limit} bytes")
    return chunks
