"""A backup's disk, simulated: replica files and metadata records that outlive the process,
a flusher and a reader that take time, and seeded faults.

Mirrors kera/backup/disk.py (the server's `disk` module is pointed at a SimDisk, its `Worker`
threads at SimWorker): a flush writes the job's bytes at its offset, then the metadata
record (a crash in between leaves the old record, which names only bytes written before it);
`scan` finds the replicas whose record and file check out; `read_chunks` returns whole chunks
from an offset, verifying each one again. Faults: a flush that fails (OSError, nothing
committed: the store must answer `storage_error` and retry), and a byte flipped in what a flush
wrote while the flush reports success (silent corruption: the read-back checksum must catch it,
never serve it). `flips` remembers every flipped byte, so the checker can tell a corruption the
backup was right to report from one it made up.
"""

from __future__ import annotations

import random
from collections import deque

from kera.codec import chunk
from kera.backup.meta import Meta
from kera.backup.store import DiskRead, FlushJob
from kera.errors import CorruptChunk

FLUSH_DELAY_S = (0.0005, 0.005)
SLOW_FLUSH_DELAY_S = (0.05, 0.8)
READ_DELAY_S = (0.0001, 0.002)


class SimDisk:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.files: dict[tuple, bytearray] = {}
        self.metas: dict[tuple, Meta] = {}
        self.flips: dict[tuple, dict[int, int]] = {}   # key -> {position: original byte}
        self.error_rate = 0.0      # a flush fails
        self.flip_rate = 0.0       # a flush silently flips one byte it wrote
        self.slow_rate = 0.0       # a flush takes long
        self.flush_errors = 0
        self.flipped = 0

    def healthy(self) -> None:
        self.error_rate = self.flip_rate = self.slow_rate = 0.0

    # ------------------------------------------------------------------ the flusher's jobs
    def run(self, job) -> None:
        """kera.backup.disk.run: a FlushJob, or the removal of a dropped replica."""
        if isinstance(job, FlushJob):
            self.flush(job)
        else:
            self.remove(job.key)

    def flush(self, job: FlushJob) -> None:
        rng = self.rng
        if self.error_rate and rng.random() < self.error_rate:
            self.flush_errors += 1
            if rng.random() < 0.5:
                self.write(job, commit=False, flip=False)   # written, never committed
            raise OSError(5, "Input/output error (injected)")
        self.write(job, commit=True, flip=bool(self.flip_rate and rng.random() < self.flip_rate))

    def remove(self, key: tuple) -> None:
        self.metas.pop(key, None)
        self.files.pop(key, None)
        self.flips.pop(key, None)

    def flush_delay(self) -> float:
        slow = self.slow_rate and self.rng.random() < self.slow_rate
        return self.rng.uniform(*(SLOW_FLUSH_DELAY_S if slow else FLUSH_DELAY_S))

    def read_delay(self) -> float:
        return self.rng.uniform(*READ_DELAY_S)

    def write(self, job: FlushJob, commit: bool, flip: bool) -> None:
        """The job's bytes at its offset; then its metadata record if `commit`."""
        f = self.files.setdefault(job.key, bytearray())
        at = job.offset
        if at == 0:   # kera.backup.disk.flush truncates the file at a replica's first flush
            f.clear()
            self.flips.pop(job.key, None)
        data = b"".join(bytes(b) for b in job.buffers)
        end = at + len(data)
        if len(f) < at:
            f.extend(bytes(at - len(f)))   # a hole reads as zeros, as with pwrite past the end
        f[at:end] = data
        flips = self.flips.get(job.key)
        if flips:
            for pos in [p for p in flips if at <= p < end]:
                del flips[pos]             # rewritten: that damage is gone
        if flip and data:
            pos = self.rng.randrange(at, end)
            self.flips.setdefault(job.key, {})[pos] = f[pos]
            f[pos] ^= self.rng.randrange(1, 256)
            self.flipped += 1
        if commit:
            self.metas[job.key] = job.meta

    def damaged(self, key: tuple, start: int, end: int) -> bool:
        """Does any flipped byte lie in [start, end) of the replica file?"""
        flips = self.flips.get(key)
        return bool(flips) and any(start <= p < end for p in flips)

    # ------------------------------------------------------------------ reading
    def scan(self) -> list[Meta]:
        """kera.backup.disk.scan: every replica whose record and file check out, in the
        order the real scan lists them (broker directories by name, then file names)."""
        found = []
        for key in sorted(self.metas, key=lambda k: (str(k[0]), k[1], k[2])):
            meta = self.metas[key]
            if len(self.files.get(key, b"")) >= meta.length:
                found.append(meta)
        return found

    def read_chunks(self, job: DiskRead) -> list[memoryview]:
        """kera.backup.disk.read_chunks on the simulated file."""
        f = self.files.get(job.key)
        if f is None:
            raise FileNotFoundError(f"no replica file for {job.key}")
        first = bytes(f[job.offset:job.offset + chunk.HEADER_SIZE])
        if len(first) < chunk.HEADER_SIZE or job.offset + chunk.HEADER_SIZE > job.limit:
            raise CorruptChunk(f"no chunk header at byte {job.offset} of {job.key}")
        want = max(job.max_bytes, chunk.chunk_size(first))
        size = min(want, job.limit - job.offset)
        data = memoryview(bytes(f[job.offset:job.offset + size]))
        if len(data) < size:
            raise CorruptChunk(f"{job.key} is shorter than its metadata record says")
        chunks: list[memoryview] = []
        at = 0
        while at + chunk.HEADER_SIZE <= len(data):
            end = at + chunk.chunk_size(data, at)
            if end > len(data):
                break
            try:
                chunk.verify(data[at:end])
            except CorruptChunk as err:
                raise CorruptChunk(f"{job.key} byte {job.offset + at}: {err.message}") from None
            chunks.append(data[at:end])
            at = end
        if not chunks:
            raise CorruptChunk(f"{job.key}: the chunk at byte {job.offset} runs past the "
                               f"replica's {job.limit} bytes")
        return chunks


class SimWorker:
    """kera.backup.worker.Worker: one thread running jobs in submission order, each taking a
    while; outcomes go to `completions()`, and the daemon's `collect` is called (where the
    real loop would wake up on the worker's pipe). Created by the daemon's own __init__;
    `bind` attaches it to its process once that exists."""

    def __init__(self, name: str, run_job, max_jobs: int):
        self.name = name
        self._run_job = run_job
        self.max_jobs = max_jobs
        self.wake_fd = -1
        self.node = None
        self.collect = None
        self.delay = None
        self._queue: deque = deque()
        self._done: deque = deque()
        self._busy = False

    def bind(self, node, collect, delay) -> None:
        """Run on `node`'s events; `collect()` is the daemon's reading of `completions()`;
        `delay()` draws how long the next job takes."""
        self.node = node
        self.collect = collect
        self.delay = delay

    def submit(self, job) -> None:
        assert len(self._queue) < self.max_jobs + 1, f"{self.name}: more jobs than its bound"
        self._queue.append(job)
        if not self._busy:
            self._start()

    def _start(self) -> None:
        if not self._queue:
            return
        self._busy = True
        self.node.schedule(self.delay(), self._finish)

    def _finish(self) -> None:
        job = self._queue.popleft()
        try:
            outcome = (job, self._run_job(job), None)
        except Exception as exc:   # reported to the loop, as Worker._loop does
            outcome = (job, None, exc)
        self._done.append(outcome)
        self._busy = False
        self.collect()                  # may submit more
        if not self._busy:
            self._start()

    def completions(self) -> list:
        out = list(self._done)
        self._done.clear()
        return out

    def close(self, timeout_s: float = 0.0) -> None:
        pass


class DiskFunctions:
    """Stands in for the kera.backup.disk module inside kera.backup.server: every
    `disk.f(root, *args)` becomes `root.f(*args)` on the SimDisk passed as the data dir."""

    def __getattr__(self, name: str):
        def call(root, *args):
            return getattr(root, name)(*args)
        return call
