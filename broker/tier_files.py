"""The broker's segment files: the blocking file I/O of tiering, run on the tier thread and at
startup, never on the server loop (mapping a file for reading is the one exception: it is a
cheap syscall, and the pages then fault in as readers touch them).

Layout under the broker's data dir (zero-padded names, so `ls` lists them in order)::

    DIR/segments/<stream_id:020d>-<streamlet:06d>/<group:010d>-<segment:06d>.seg
    DIR/segments/<...>/<group:010d>-<segment:06d>.meta
    DIR/segments/<...>/<group:010d>-<segment:06d>.live

A `.live` file is the commit log of a segment of an R=1 stream not yet tiered: before an R=1
produce is acknowledged, the loop writes the new chunk bytes into the `.seg` (at their segment
offset) and appends a record (the layout below) of the segment's acknowledged length to the
`.live` file, both to the page cache only (no fsync, as Kafka at its defaults): a kill -9 of the
broker's process keeps them, a crash of the machine may not. At reload a `.seg` with no `.meta`
counts up to the last whole record of its `.live` file; once the tier commits the `.meta`, the
`.live` file is ignored and removed.

A `.seg` file holds the segment's chunks back to back, exactly the bytes the segment holds in
memory (stamped, checksummed), written with O_DIRECT when new (`_open_segment_file` says
why). The `.meta` file is its commit record (below): the `.seg` counts only once its record
exists, and only its `length` bytes. Write order: chunk bytes, fdatasync, record to a
temporary name, fsync, rename, fsync the directory; a crash at any point leaves
either no record (the `.seg` is an orphan, removed at the next start) or a whole one. Deletion
removes the record first.

A compaction's rewrite of a segment (kera.broker.compactor) replaces its file whole, as
Kafka's cleaner does (`.cleaned`, `.swap`, rename): the new bytes go to `.cleaned` and are
fdatasynced, then the new record is written atomically as `.swap`, the commit point; then
`.cleaned` is renamed over `.seg` (directory fsynced), the record becomes the `.meta`, and the
`.live` log and the `.swap` are removed. At the next start (`scan`) a `.swap` is finished
(rolled forward) if its segment's `.seg` exists and removed otherwise; a `.cleaned` without a
`.swap` is a rewrite cut short and is removed. So a crash at any point leaves the segment wholly
as it was or wholly rewritten (both serve the same record numbers: docs/COMPACTION.md).

Record layout (little-endian, 88 bytes)::

     0  4s  magic b"KBSG"     4  u16 version      6  u16 flags (bit 0: group closed)
     8  u64 stream_id        16  u32 streamlet   20  u32 group   24  u32 segment   28 u32 slot
    32  u64 length           40  u32 chunks      44  u64 base_offset (group offset of 1st record)
    52  u64 end_offset       60  u64 created_ms  68  u64 last_ms  (group's first/latest append)
    76  u32 capacity_bytes   80  u32 chunks_crc  (CRC32C chained over the chunks' header CRCs)
    84  u32 crc32c of bytes 0..84
"""

from __future__ import annotations

import logging
import mmap
import os
import resource
import shutil
import struct
from array import array
from pathlib import Path
from typing import NamedTuple

from kera.codec import chunk
from kera.backup import direct_write
from kera.daemon.durable import fsync_dir, read_checked, unlink_durable, write_atomic, write_checked
from kera.errors import CorruptChunk, StorageError

log = logging.getLogger(__name__)

SEGMENTS_DIR = "segments"
MAGIC = b"KBSG"
VERSION = 1
FLAG_GROUP_CLOSED = 0x01
_BODY = struct.Struct("<4sHHQIIIIQIQQQQII")
_CRC = struct.Struct("<I")
RECORD_SIZE = _BODY.size + _CRC.size
assert RECORD_SIZE == 88



class CorruptSegment(StorageError):
    """A segment file or its record failed a checksum or layout check."""
    retriable = False


class SegmentRecord(NamedTuple):
    stream_id: int
    streamlet: int
    group: int
    segment: int
    slot: int
    length: int
    chunks: int
    base_offset: int
    end_offset: int
    created_ms: int
    last_ms: int
    capacity_bytes: int
    chunks_crc: int
    group_closed: bool

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.stream_id, self.streamlet, self.group, self.segment


def encode_record(r: SegmentRecord) -> bytes:
    body = _BODY.pack(MAGIC, VERSION, FLAG_GROUP_CLOSED if r.group_closed else 0, r.stream_id,
                      r.streamlet, r.group, r.segment, r.slot, r.length, r.chunks, r.base_offset,
                      r.end_offset, r.created_ms, r.last_ms, r.capacity_bytes, r.chunks_crc)
    return body + _CRC.pack(chunk.crc32c(body))


def decode_record(buf: bytes) -> SegmentRecord:
    if len(buf) != RECORD_SIZE:
        raise CorruptSegment(f"segment record of {len(buf)} bytes is not {RECORD_SIZE}")
    (crc,) = _CRC.unpack_from(buf, _BODY.size)
    if chunk.crc32c(buf[:_BODY.size]) != crc:
        raise CorruptSegment("segment record checksum mismatch")
    (magic, version, flags, sid, sl, g, seg, slot, length, chunks, base, end, created, last,
     capacity, chunks_crc) = _BODY.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or flags & ~FLAG_GROUP_CLOSED:
        raise CorruptSegment(f"bad segment record header {magic!r} v{version} flags {flags:#x}")
    if end < base or length > capacity or (chunks == 0) != (length == 0):
        raise CorruptSegment("segment record fields are inconsistent")
    return SegmentRecord(sid, sl, g, seg, slot, length, chunks, base, end, created, last,
                         capacity, chunks_crc, bool(flags & FLAG_GROUP_CLOSED))


# --------------------------------------------------------------------------- names

def streamlet_dir(root: Path, stream_id: int, streamlet: int) -> Path:
    return root / SEGMENTS_DIR / f"{stream_id:020d}-{streamlet:06d}"


def segment_base(group: int, segment: int) -> str:
    return f"{group:010d}-{segment:06d}"


def seg_path(root: Path, key) -> Path:
    return streamlet_dir(root, key[0], key[1]) / f"{segment_base(key[2], key[3])}.seg"


def meta_path(root: Path, key) -> Path:
    return streamlet_dir(root, key[0], key[1]) / f"{segment_base(key[2], key[3])}.meta"


def live_path(root: Path, key) -> Path:
    return streamlet_dir(root, key[0], key[1]) / f"{segment_base(key[2], key[3])}.live"


def cleaned_path(root: Path, key) -> Path:
    return streamlet_dir(root, key[0], key[1]) / f"{segment_base(key[2], key[3])}.cleaned"


def swap_path(root: Path, key) -> Path:
    return streamlet_dir(root, key[0], key[1]) / f"{segment_base(key[2], key[3])}.swap"


# --------------------------------------------------------------------------- jobs

class WriteJob(NamedTuple):
    """Write a sealed segment's bytes (`data`, a view of its memory) and commit its record."""
    segment: object          # the broker's Segment (only the loop looks at it)
    record: SegmentRecord
    data: memoryview
    # The first bytes of `data` an R=1 segment's live writes already put in its file, each
    # write complete before its ack (TierStore.live): not written again (write_segment).
    on_file_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.record.length


class LiveWrite(NamedTuple):
    """Before an R=1 ack: `data` (new chunk bytes) goes to the `.seg` at byte `at`, then the
    record of the segment's acknowledged length is appended to its `.live` file."""
    segment: object
    record: SegmentRecord
    at: int
    data: memoryview


# Open file pairs (.seg, .live) kept by LiveFiles at most: the open segments of busy R=1
# streamlets (one per active group) write without an open/close per request; more are reopened
# as needed. Reopening is what a write costs once more segments are busy than are kept: with 64
# kept and 256 busy R=1 streams, write_live took 60% of the broker's loop, opening files a fifth
# of it, and 256 streams acknowledged a third of what 64 did.
LIVE_FILES_OPEN_MAX = 4096   # pairs (8192 descriptors), however high the open-file limit
LIVE_FILES_OPEN_MIN = 16     # pairs, under a tiny open-file limit
# The share of the process's open-file limit (RLIMIT_NOFILE, soft) live files may hold, two
# descriptors a pair: the rest is for sockets and the tier's and reload's files.
LIVE_FILES_FD_SHARE = 0.25
# A segment's files are closed this long after its last write: a sealed segment is written no
# more, and a file deleted meanwhile (tiered, retention, its stream deleted) keeps its disk
# space for as long as a descriptor holds it.
LIVE_FILES_IDLE_S = 5.0


def live_files_open_max() -> int:
    """How many file pairs LiveFiles keeps open: LIVE_FILES_FD_SHARE of the open-file limit,
    within LIVE_FILES_OPEN_MIN..LIVE_FILES_OPEN_MAX (1024 descriptors, a common default, keep
    128 pairs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return LIVE_FILES_OPEN_MAX
    return max(LIVE_FILES_OPEN_MIN, min(LIVE_FILES_OPEN_MAX, int(soft * LIVE_FILES_FD_SHARE) // 2))


class LiveFiles:
    """Writes LiveWrites on the loop (page cache, no sync), keeping the newest segments' files
    open. A write at byte 0 starts a segment: its files are (re)created, never a stale fd's."""

    def __init__(self, root: Path, open_max: int | None = None):
        self.root = root
        self.open_max = live_files_open_max() if open_max is None else open_max
        if self.open_max < 1:
            raise ValueError(f"open_max must be >= 1 file pair, not {self.open_max}")
        # key -> ((seg fd, live fd), when last written), least recently written first
        self.open: dict = {}

    def write(self, w: LiveWrite, now: float) -> None:
        """Raises OSError (the files of that segment are then closed, reopened next time).
        `now`: the monotonic clock, for close_idle."""
        key = w.record.key
        entry = self.open.pop(key, None)
        fds = None if entry is None else entry[0]
        if fds is not None and w.at == 0:
            _close(fds)
            fds = None
        try:
            if fds is None:
                fds = self._open(key)
            direct_write.pwrite_all(fds[0], [w.data], w.at)
            os.write(fds[1], encode_record(w.record))
        except OSError:
            if fds is not None:
                _close(fds)
            raise
        self.open[key] = (fds, now)
        while len(self.open) > self.open_max:
            _close(self.open.pop(next(iter(self.open)))[0])

    def close_idle(self, now: float) -> None:
        """Close the files of the segments not written for LIVE_FILES_IDLE_S (the oldest come
        first: this stops at the first one written since)."""
        while self.open:
            key = next(iter(self.open))
            if self.open[key][1] > now - LIVE_FILES_IDLE_S:
                return
            _close(self.open.pop(key)[0])

    def _open(self, key) -> tuple[int, int]:
        path = seg_path(self.root, key)
        try:
            seg_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except FileNotFoundError:   # the streamlet's first segment file: make its directory
            path.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent.parent)
            seg_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            return seg_fd, os.open(live_path(self.root, key), flags, 0o644)
        except OSError:
            os.close(seg_fd)
            raise

    def close(self) -> None:
        while self.open:
            _close(self.open.pop(next(iter(self.open)))[0])


def _close(fds: tuple[int, int]) -> None:
    for fd in fds:
        os.close(fd)


def write_live(root: Path, w: LiveWrite) -> None:
    """One LiveWrite, its files opened and closed (tests, tools)."""
    files = LiveFiles(root)
    try:
        files.write(w, 0.0)
    finally:
        files.close()


def sync_live_segments(root: Path) -> int:
    """fdatasync every R=1 segment's `.seg` and `.live` files that no `.meta` committed (the
    settled ones, kera.broker.tier), then their directories: an orderly stop leaves every
    acknowledged R=1 chunk on the device, as committing its `.meta` would. Returns how many
    segments; raises OSError."""
    base = root / SEGMENTS_DIR
    lives = [p for p in base.glob("*/*.live") if not p.with_suffix(".meta").exists()] \
        if base.is_dir() else []
    for live in lives:
        for path in (live.with_suffix(".seg"), live):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
    for directory in {live.parent for live in lives}:
        fsync_dir(directory)
    return len(lives)


def read_live(path: Path) -> SegmentRecord | None:
    """The last whole record of a `.live` file (a torn or damaged tail is skipped)."""
    with open(path, "rb") as f:
        buf = f.read()
    for end in range(len(buf) - len(buf) % RECORD_SIZE, 0, -RECORD_SIZE):
        try:
            return decode_record(buf[end - RECORD_SIZE:end])
        except CorruptSegment:
            log.error("%s: damaged record at byte %d skipped", path, end - RECORD_SIZE)
    return None


class FirstGroupJob(NamedTuple):
    """Record a streamlet's first retained group (groups below were deleted by retention), so a
    restart numbers new groups after the deleted ones even when no file of it is left."""
    stream_id: int
    streamlet: int
    first_group: int


class DeleteJob(NamedTuple):
    """Remove one segment's record and file."""
    key: tuple[int, int, int, int]
    nbytes: int


class DeleteStreamJob(NamedTuple):
    """Remove every segment file of a deleted stream."""
    stream_id: int


class CleanJob(NamedTuple):
    """Write a compaction's rewrite of a segment beside its file and commit it (the `.cleaned`
    bytes, then the `.swap` record); the file is replaced by a SwapJob once memory swapped."""
    segment: object          # the new Segment (only the loop looks at it)
    record: SegmentRecord
    data: memoryview


class SwapJob(NamedTuple):
    """Finish a committed rewrite: `.cleaned` over `.seg`, the record as `.meta`."""
    segment: object
    record: SegmentRecord


class DiscardJob(NamedTuple):
    """Remove a rewrite that will not be swapped (its segment went meanwhile, a write failed)."""
    key: tuple[int, int, int, int]


def run(root: Path, job) -> None:
    """Run one tier job (on the tier thread); raises OSError to the caller."""
    if isinstance(job, WriteJob):
        write_segment(root, job.record, job.data, job.on_file_bytes)
    elif isinstance(job, DeleteJob):
        delete_segment(root, job.key)
    elif isinstance(job, DeleteStreamJob):
        delete_stream(root, job.stream_id)
    elif isinstance(job, FirstGroupJob):
        write_first_group(root, job.stream_id, job.streamlet, job.first_group)
    elif isinstance(job, CleanJob):
        write_cleaned(root, job.record, job.data)
    elif isinstance(job, SwapJob):
        finish_swap(root, job.record)
    elif isinstance(job, DiscardJob):
        discard_rewrite(root, job.key)
    else:
        raise TypeError(f"unknown tier job {job!r}")


def write_segment(root: Path, record: SegmentRecord, data, on_file_bytes: int = 0) -> None:
    """Write the segment's `record.length` bytes of `data` to its file, fdatasync, then commit
    its record. `on_file_bytes`: the first bytes an existing file already holds, as `data` has
    them (an R=1 segment's live writes); counted only if the file is that long."""
    key = record.key
    directory = streamlet_dir(root, key[0], key[1])
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)
    path = seg_path(root, key)
    view = memoryview(data)[:record.length]
    fd, direct, existed = _open_segment_file(path)
    try:
        if direct:
            direct_write.write_or_fall_back(fd, path, [view], 0, record.length)
        else:
            start = _bytes_kept(fd, min(on_file_bytes, record.length)) if existed else 0
            direct_write.pwrite_all(fd, [view[start:]], start)
        os.ftruncate(fd, record.length)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    write_atomic(meta_path(root, key), encode_record(record))
    live = live_path(root, key)
    if live.exists():
        unlink_durable(live)


def write_cleaned(root: Path, record: SegmentRecord, data) -> None:
    """A rewrite's bytes to `.cleaned`, fdatasync, then its record to `.swap` (atomically: the
    commit point; its directory fsync makes the `.cleaned` name durable too)."""
    key = record.key
    path = cleaned_path(root, key)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        direct_write.pwrite_all(fd, [memoryview(data)[:record.length]], 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    write_atomic(swap_path(root, key), encode_record(record))


def finish_swap(root: Path, record: SegmentRecord) -> None:
    """Replace a segment's file by its committed rewrite (again, if done before: every step
    may be repeated after a crash): `.cleaned` renamed over `.seg`, the directory fsynced, the
    record committed as `.meta`, then the `.live` log and the `.swap` removed."""
    key = record.key
    cleaned = cleaned_path(root, key)
    if cleaned.exists():
        os.replace(cleaned, seg_path(root, key))
        fsync_dir(cleaned.parent)
    write_atomic(meta_path(root, key), encode_record(record))
    unlink_durable(live_path(root, key), swap_path(root, key))


def discard_rewrite(root: Path, key) -> None:
    """Remove a rewrite's `.swap` (first: it is the commit) and `.cleaned`."""
    unlink_durable(swap_path(root, key))
    unlink_durable(cleaned_path(root, key))


def _open_segment_file(path: Path) -> tuple[int, bool, bool]:
    """An fd to write a segment's file, whether it is O_DIRECT, and whether the file existed.

    A new file is written with O_DIRECT where the filesystem takes it: through the page cache,
    writing 8 MiB segments cost the tier thread 2.0 ms of CPU per MiB on this project's VM
    while the page cache grew (kera.backup.direct_write says why), against 0.15 ms
    (bench/test_tier_write.py), and a broker at its memory limit tiers all it takes in.
    Readers then map the file and fault its pages in from the device, as reads of data older
    than the memory holds should. An existing file is an R=1 segment's (its live writes made
    it): no O_TRUNC, since its `.live` record vouches for those acknowledged bytes until the
    `.meta` exists, and through the page cache, which holds them already."""
    direct = direct_write.works()
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    try:
        return os.open(path, flags, 0o644), direct, False
    except FileExistsError:
        return os.open(path, os.O_WRONLY), False, True
    except OSError as err:
        if not direct:
            raise
        direct_write.give_up(err, path, "opening with O_DIRECT")
        return _open_segment_file(path)    # once: O_DIRECT is given up now


def _bytes_kept(fd: int, claimed: int) -> int:
    """`claimed` if the file holds at least that many bytes, else 0 (all is written again)."""
    return claimed if os.fstat(fd).st_size >= claimed else 0


FIRST_GROUP_FILE = "first_group"


def write_first_group(root: Path, stream_id: int, streamlet: int, first_group: int) -> None:
    directory = streamlet_dir(root, stream_id, streamlet)
    directory.mkdir(parents=True, exist_ok=True)
    write_checked(directory / FIRST_GROUP_FILE, str(first_group))


def read_first_groups(root: Path) -> dict[tuple[int, int], int]:
    """{(stream id, streamlet): first retained group} as recorded by retention."""
    out: dict[tuple[int, int], int] = {}
    base = root / SEGMENTS_DIR
    if not base.is_dir():
        return out
    for directory in base.iterdir():
        sid, _, sl = directory.name.partition("-")
        path = directory / FIRST_GROUP_FILE
        if not (sid.isdigit() and sl.isdigit()) or not path.is_file():
            continue
        try:
            text = read_checked(path)
        except OSError as err:
            log.error("cannot read %s: %s", path, err)
            continue
        if text is None or not (text.isdigit() and len(text) <= 10):
            # Without it, group numbers restart after the oldest group on disk: what retention
            # deleted below it is then reported lost, not silently renumbered.
            log.error("%s is damaged (checksum or content): ignored", path)
            continue
        out[(int(sid), int(sl))] = int(text)
    return out


def delete_segment(root: Path, key) -> None:
    discard_rewrite(root, key)               # a committed rewrite would bring the segment back
    unlink_durable(meta_path(root, key))     # the commit record first: a crash leaves an orphan
    live = live_path(root, key)
    if live.exists():
        unlink_durable(live)
    unlink_durable(seg_path(root, key))


def delete_stream(root: Path, stream_id: int) -> None:
    base = root / SEGMENTS_DIR
    if not base.is_dir():
        return
    prefix = f"{stream_id:020d}-"
    for directory in base.iterdir():
        if directory.name.startswith(prefix):
            # records first: a crash leaves orphans
            unlink_durable(*directory.glob("*.swap"), *directory.glob("*.meta"),
                           *directory.glob("*.live"))
            shutil.rmtree(directory, ignore_errors=True)
            fsync_dir(base)


MARKER_TEXT = "kera broker"


def write_marker(path: Path) -> None:
    """A marker file, durably created, with a checksum (`marker_ok` checks it)."""
    write_checked(path, MARKER_TEXT)


def marker_ok(path: Path) -> bool:
    """The marker exists and is whole (a torn or damaged one counts as absent)."""
    try:
        text = read_checked(path)
    except FileNotFoundError:
        return False
    except OSError as err:
        log.error("cannot read marker %s: %s", path, err)
        return False
    if text != MARKER_TEXT:
        log.error("marker %s is damaged: ignored", path)
    return text == MARKER_TEXT




# --------------------------------------------------------------------------- reading

def map_file(root: Path, key, length: int) -> tuple[mmap.mmap, memoryview]:
    """A read-only map of a segment file's first `length` bytes; raises OSError."""
    with open(seg_path(root, key), "rb") as f:
        mm = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ)
    return mm, memoryview(mm)


class LoadedSegment(NamedTuple):
    """A segment file checked at startup, with its per-chunk index rebuilt from the chunks."""
    record: SegmentRecord
    positions: array
    sizes: array
    bases: array
    counts: array
    producers: dict          # producer id -> (sequence, chunk index) of its newest chunk here


def scan(root: Path) -> list[SegmentRecord]:
    """Every segment whose record checks out, sorted by key. A compaction's committed rewrite
    is finished first (`finish_rewrites`); orphan files (a `.seg` without a record, a leftover
    temporary record, a `.cleaned` never committed) are removed; a damaged record is logged and
    skipped (never deleted: an operator may want to look at it)."""
    found: list[SegmentRecord] = []
    base = root / SEGMENTS_DIR
    if not base.is_dir():
        return found
    for directory in sorted(base.iterdir()):
        if not directory.is_dir():
            continue
        finish_rewrites(root, directory)
        for path in sorted(directory.iterdir()):
            if path.name.endswith((".meta.tmp", ".swap.tmp")) or (
                    path.suffix == ".cleaned" and not path.with_suffix(".swap").exists()):
                unlink_durable(path)     # a rewrite never committed: the segment is as it was
            elif path.suffix == ".seg" and not path.with_suffix(".meta").exists() \
                    and path.with_suffix(".live").exists():
                record = _live_record(root, path)
                if record is not None:
                    found.append(record)
            elif path.suffix == ".live" and path.with_suffix(".meta").exists():
                unlink_durable(path)     # the tier committed the segment: the log is done
            elif path.suffix == ".seg" and not path.with_suffix(".meta").exists():
                log.warning("removing %s: no commit record (a write cut short)", path)
                unlink_durable(path)
            elif path.suffix == ".meta":
                try:
                    with open(path, "rb") as f:
                        record = decode_record(f.read(RECORD_SIZE + 1))
                    if meta_path(root, record.key) != path:
                        raise CorruptSegment(f"record names {record.key}, not this file")
                    size = seg_path(root, record.key).stat().st_size
                    if size < record.length:
                        raise CorruptSegment(f"file holds {size} of {record.length} bytes")
                except (OSError, CorruptSegment) as err:
                    log.error("skipping segment record %s: %s", path, err)
                    continue
                found.append(record)
    found.sort(key=lambda r: r.key)
    return found


def finish_rewrites(root: Path, directory: Path) -> int:
    """At startup, before the segments are read: finish every committed rewrite (a `.swap`)
    whose segment still has its `.seg`; remove the others (the segment was deleted). A
    damaged `.swap` is removed with its `.cleaned` while that still exists (the segment is
    then as it was); otherwise it is left for an operator. Returns how many were finished."""
    finished = 0
    for swap in sorted(directory.glob("*.swap")):
        cleaned = swap.with_suffix(".cleaned")
        try:
            with open(swap, "rb") as f:
                record = decode_record(f.read(RECORD_SIZE + 1))
            if swap_path(root, record.key) != swap:
                raise CorruptSegment(f"record names {record.key}, not this file")
        except (OSError, CorruptSegment) as err:
            log.error("rewrite record %s is damaged (%s): %s", swap, err,
                      "the segment stays as it was" if cleaned.exists() else "left as it is")
            if cleaned.exists():
                discard_rewrite(root, _key_of_name(directory, swap))
            continue
        if not swap.with_suffix(".seg").exists():
            discard_rewrite(root, record.key)     # the segment was deleted after the commit
            continue
        try:
            finish_swap(root, record)
        except OSError as err:   # the segment's files disagree now: it is skipped, not lost
            log.error("cannot finish the compaction's rewrite of %s (%s): free or repair the "
                      "data dir and restart; the files are left as they are", swap, err)
            continue
        log.info("finished the compaction's rewrite of %s", swap.with_suffix(".seg"))
        finished += 1
    return finished


def _key_of_name(directory: Path, path: Path) -> tuple[int, int, int, int]:
    """A segment's key from its streamlet directory's and its file's names."""
    sid, _, sl = directory.name.partition("-")
    group, _, seg = path.stem.partition("-")
    return int(sid), int(sl), int(group), int(seg)


def _live_record(root: Path, seg: Path) -> SegmentRecord | None:
    """The acknowledged part of an R=1 segment not yet tiered (its `.live` commit log)."""
    try:
        record = read_live(seg.with_suffix(".live"))
        if record is None:
            return None
        if seg_path(root, record.key) != seg:
            raise CorruptSegment(f"live record names {record.key}, not this file")
        size = seg.stat().st_size
        if size < record.length:
            raise CorruptSegment(f"file holds {size} of {record.length} bytes")
    except (OSError, CorruptSegment) as err:
        log.error("skipping live segment %s: %s", seg, err)
        return None
    return record


def load(root: Path, record: SegmentRecord) -> LoadedSegment:
    """Map a segment file and verify every chunk (both checksums, the broker's stamps, dense
    offsets, the chained checksum of the record); raises CorruptSegment or OSError."""
    key = record.key
    mm, mv = map_file(root, key, record.length)
    try:
        return _index(record, mv)
    finally:
        try:
            mv.release()
            mm.close()
        except BufferError:
            pass   # a view is still held (by an exception's traceback): the GC unmaps it



def _index(record: SegmentRecord, mv: memoryview) -> LoadedSegment:
    positions, sizes, bases, counts = array("I"), array("I"), array("Q"), array("I")
    producers: dict[int, tuple[int, int]] = {}
    at = 0
    expect = record.base_offset
    crc = 0
    name = f"{segment_base(record.group, record.segment)} of stream {record.stream_id}/{record.streamlet}"
    while at < record.length:
        if record.length - at < chunk.HEADER_SIZE:
            raise CorruptSegment(f"{name}: {record.length - at} stray bytes at {at}")
        size = chunk.chunk_size(mv, at)
        if at + size > record.length:
            raise CorruptSegment(f"{name}: the chunk at {at} runs past {record.length} bytes")
        try:
            h = chunk.verify(mv[at:at + size])
        except CorruptChunk as err:
            raise CorruptSegment(f"{name}: chunk at byte {at}: {err.message}") from None
        if (h.stream_id, h.streamlet, h.group, h.segment) != key_of(record) or h.base_offset != expect:
            raise CorruptSegment(f"{name}: chunk at byte {at} is stamped {h.stream_id}/{h.streamlet} "
                                 f"group {h.group} segment {h.segment} offset {h.base_offset}")
        crc = chunk.crc32c(mv[at + 4:at + 8], crc)
        positions.append(at)
        sizes.append(size)
        bases.append(expect)
        covered = chunk.offsets_covered(h)   # a compacted chunk covers gaps too
        counts.append(covered)
        if not h.flags & chunk.FLAG_SPARSE:   # its sequence is no producer's
            producers[h.producer_id] = (h.sequence, len(positions) - 1)
        expect += covered
        at += size
    if len(positions) != record.chunks or expect != record.end_offset or crc != record.chunks_crc:
        raise CorruptSegment(f"{name}: {len(positions)} chunks up to offset {expect} do not match "
                             f"the record ({record.chunks} chunks up to {record.end_offset})")
    return LoadedSegment(record, positions, sizes, bases, counts, producers)


def key_of(record: SegmentRecord) -> tuple[int, int, int, int]:
    return record.stream_id, record.streamlet, record.group, record.segment


def chunks_crc(seg_mv, positions, n: int) -> int:
    """CRC32C chained over the header CRCs of the first n chunks (what a record stores)."""
    crc = 0
    for i in range(n):
        p = positions[i]
        crc = chunk.crc32c(seg_mv[p + 4:p + 8], crc)
    return crc
