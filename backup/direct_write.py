"""File bytes written with O_DIRECT, through a reused page-aligned staging buffer per thread: a
backup's replica files (kera.backup.disk) and a broker's tiered segment files
(kera.broker.tier_files, which imports it from here: one implementation for both).

Why: a buffered write copies the data into page-cache pages that the kernel must allocate as the
files grow. On the machine kera is measured on (a Firecracker VM whose balloon hands free memory
back to the host), that copy cost 3.5-3.9 ms of CPU per MiB once the page cache had to grow,
against 0.2-0.3 ms through O_DIRECT from a warm buffer; it was half of each backup's CPU at
64 KiB chunks (perf, issue 15: `copy_folio_from_iter_atomic`); a whole flush, fdatasync and
`.meta` record included, costs 0.7 ms per MiB this way (bench/test_backup_flush.py). Storage
engines that keep their own cache (Redpanda's log, ScyllaDB) write with O_DIRECT too, and a
backup reads its files back only to serve recovery. A broker at its memory limit writes every
segment it takes in to its disk: 2.0 ms of CPU per MiB through the page cache against 0.15 ms
this way (bench/test_tier_write.py); it reads a tiered segment back only for a reader behind
what memory holds.

O_DIRECT wants the buffer address, the file offset and the length aligned to the device's
logical block (BLOCK_BYTES covers 512-byte and 4 KiB blocks). A flush that starts inside a block
reads that block's head back (bytes an earlier flush made durable) and writes it again,
unchanged, as the page cache would have. The last block is padded with zeros and the file is
then cut back to the data's end, so the file holds exactly the replica's bytes, as before; a
crash in between leaves a longer file, and only the `.meta` record's length counts.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading

BLOCK_BYTES = 4096                 # alignment of offsets, lengths and the buffer
STAGING_BYTES = 4 * 1024 * 1024    # per thread: one pwrite per 4 MiB (a 16 MiB flush: 4-5)
IOV_MAX = 1024                     # buffers per pwritev call (the Linux limit)
_ZEROS = bytes(BLOCK_BYTES)

_local = threading.local()
# False once a filesystem refused O_DIRECT (EINVAL: tmpfs, or a logical block larger than
# BLOCK_BYTES): from then on this process writes through the page cache (`works`, `give_up`).
_works = hasattr(os, "O_DIRECT")

log = logging.getLogger(__name__)


def works() -> bool:
    """Whether to try O_DIRECT: no filesystem of this process has refused it yet."""
    return _works


def give_up(err: OSError, path, what: str) -> None:
    """On EINVAL (O_DIRECT refused), write through the page cache from now on; raise the rest."""
    global _works
    if err.errno != errno.EINVAL:
        raise err
    _works = False
    log.info("files are written through the page cache from now on: %s was refused under %s "
             "(%s)", what, os.path.dirname(path), err)


def write_or_fall_back(fd: int, path, buffers, offset: int, end: int) -> None:
    """`write`, or through the page cache from now on if the device refuses the alignment (a
    logical block larger than BLOCK_BYTES): the fd loses O_DIRECT and the file is cut back to
    `end`, past which the refused attempt may have padded."""
    try:
        write(fd, buffers, offset)
    except OSError as err:
        give_up(err, path, "an O_DIRECT write")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        pwrite_all(fd, buffers, offset)
        os.ftruncate(fd, end)


def pwrite_all(fd: int, buffers, offset: int) -> None:
    """Write the concatenation of `buffers` at `offset` through the page cache (pwritev, short
    writes resumed)."""
    pending = [b for b in buffers if len(b)]
    while pending:
        batch = pending[:IOV_MAX]
        written = os.pwritev(fd, batch, offset)
        offset += written
        # Drop what was written; a short write leaves the tail of one buffer to go again.
        consumed = 0
        while consumed < len(batch) and written >= len(batch[consumed]):
            written -= len(batch[consumed])
            consumed += 1
        rest = pending[consumed:]
        if written:
            rest[0] = rest[0][written:]
        pending = rest


def _staging() -> memoryview:
    """This thread's staging buffer (anonymous mmap: page-aligned, reused so it stays warm)."""
    stage = getattr(_local, "stage", None)
    if stage is None or len(stage) < STAGING_BYTES:
        stage = _local.stage = memoryview(mmap.mmap(-1, STAGING_BYTES))
    return stage


def write(fd: int, buffers, offset: int) -> None:
    """Write the concatenation of `buffers` at `offset` of `fd` (opened O_RDWR | O_DIRECT).
    Raises OSError on an I/O error, a full disk or a file shorter than `offset`."""
    if not any(map(len, buffers)):
        return   # a flush that only closes the replica: its record changes, not its bytes
    stage = _staging()
    start = offset - offset % BLOCK_BYTES
    fill = offset - start            # the head of the first block, already on disk
    if fill:
        _read_head(fd, stage, start, fill)
    at = start
    for buf in buffers:
        n = len(buf)
        if fill + n < STAGING_BYTES:   # most buffers: one copy (a flush of 1 KiB chunks has many)
            stage[fill:fill + n] = buf
            fill += n
            continue
        view = memoryview(buf)
        while len(view):
            n = min(len(view), STAGING_BYTES - fill)
            stage[fill:fill + n] = view[:n]
            fill += n
            view = view[n:]
            if fill == STAGING_BYTES:
                _write_exact(fd, stage[:STAGING_BYTES], at)
                at += STAGING_BYTES
                fill = 0
    if fill % BLOCK_BYTES:
        pad = BLOCK_BYTES - fill % BLOCK_BYTES
        stage[fill:fill + pad] = _ZEROS[:pad]
        _write_exact(fd, stage[:fill + pad], at)
        os.ftruncate(fd, at + fill)  # the padding is not the replica's
    elif fill:
        _write_exact(fd, stage[:fill], at)


def _read_head(fd: int, stage: memoryview, start: int, head: int) -> None:
    got = os.preadv(fd, [stage[:BLOCK_BYTES]], start)
    if got < head:
        raise OSError(errno.EIO, f"replica file ends at byte {start + got}, before the "
                                 f"{start + head} bytes its last flush wrote")


def _write_exact(fd: int, view: memoryview, at: int) -> None:
    written = os.pwrite(fd, view, at)
    if written != len(view):   # O_DIRECT writes whole blocks or fail: short means a full disk
        raise OSError(errno.ENOSPC, f"wrote {written} of {len(view)} bytes at byte {at} "
                                    f"(disk full?)")
