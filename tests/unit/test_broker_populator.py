"""kera.broker.populator: fresh segment memory faulted in by a worker thread beside the loop."""

import ctypes
import dataclasses
import errno
import mmap
import time

import pytest

from kera import chunk
from kera import server as kera_server
from kera.backup.worker import Worker
from kera.broker.populator import POPULATE_JOBS_MAX, Populator, populate
from kera.broker.segment import Segment, anonymous_buffer
from kera.broker.segment_pool import SegmentPool, in_use
from kera.broker.server import BrokerDaemon
from kera.daemon_env import DaemonEnv

WAIT_S = 10.0          # for the worker thread to finish the windows asked of it


def make(n=10, value=b"v" * 20):
    return chunk.encode(3, 0, 9, 1, [value] * n)


def _drain(populator: Populator) -> None:
    deadline = time.monotonic() + WAIT_S
    while populator.queued and time.monotonic() < deadline:
        time.sleep(0.005)
        populator.collect()
    assert populator.queued == 0, "the populator thread did not finish its windows"


class HeldWorker:
    """A worker that finishes jobs only when told, with the outcome it is told."""

    def __init__(self):
        self.jobs, self.done = [], []

    def submit(self, job):
        self.jobs.append(job)

    def finish_all(self, error=None):
        self.done += [(job, None, error) for job in self.jobs]
        self.jobs = []

    def completions(self):
        out, self.done = self.done, []
        return out


def _resident(buf) -> list[bool]:
    """Which pages of `buf` are resident (mincore(2); /proc's Rss would count a neighbouring
    anonymous map the kernel merged with this one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = len(buf) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    anchor = ctypes.c_char.from_buffer(buf)
    assert libc.mincore(ctypes.addressof(anchor), len(buf), vec) == 0, ctypes.get_errno()
    del anchor
    return [b & 1 == 1 for b in vec.raw]


def test_populate_faults_the_window_in_and_leaves_the_rest_of_the_map_alone():
    page = mmap.PAGESIZE
    buf = anonymous_buffer(1024 * page)
    assert not any(_resident(buf))
    try:
        populate((buf, 256 * page, 512 * page))
    except OSError as err:
        pytest.skip(f"this kernel refuses MADV_POPULATE_WRITE ({err}); CI's does not")
    assert _resident(buf) == [False] * 256 + [True] * 512 + [False] * 256
    assert not in_use(buf)            # the call's export of the map is gone once it returns


def test_a_segment_whose_pool_has_a_populator_gets_its_windows_faulted_by_the_thread():
    pool = SegmentPool(16 * 1024 * 1024)
    pool.populator = populator = Populator(Worker("populate-test", populate, POPULATE_JOBS_MAX))
    try:
        seg = Segment(None, 0, 8 * 1024 * 1024, pool)
        c = make(180)
        for i in range(300):
            seg.append(c, len(c), 0, 180 * i, 180)
        assert populator.requested >= 5 and populator.skipped == 0
        _drain(populator)
        assert populator.works
        # Every window asked for is resident, though this thread never faulted ahead.
        assert seg.populated_bytes > seg.used_bytes
        assert all(_resident(seg.memory)[:seg.populated_bytes // mmap.PAGESIZE])
        assert [chunk.Chunk(seg.view(i)).values() for i in (0, 299)] == [[b"v" * 20] * 180] * 2
    finally:
        populator.close()


def test_windows_past_the_bound_are_left_to_the_appends_until_the_queue_drains():
    worker = HeldWorker()
    populator = Populator(worker)
    buf = anonymous_buffer(1024 * 1024)
    for i in range(POPULATE_JOBS_MAX + 5):
        populator.request(buf, i * 4096, 4096)
    assert len(worker.jobs) == POPULATE_JOBS_MAX and populator.skipped == 5
    worker.finish_all()
    populator.collect()
    assert populator.queued == 0
    populator.request(buf, 0, 4096)                    # room again after the bound
    assert len(worker.jobs) == 1 and populator.queued == 1


def test_a_kernel_that_refuses_stops_the_requests_and_the_segment_still_holds_its_chunks():
    worker = HeldWorker()
    pool = SegmentPool(16 * 1024 * 1024)
    pool.populator = populator = Populator(worker)
    seg = Segment(None, 0, 1024 * 1024, pool)
    c = make()
    seg.append(c, len(c), 0, 0, 10)
    assert worker.jobs, "a fresh segment asks for its first window"
    worker.finish_all(OSError(errno.EINVAL, "Invalid argument"))
    populator.collect()
    assert populator.works is False and populator.queued == 0
    for i in range(1, 200):
        seg.append(c, len(c), 0, 10 * i, 10)
    assert worker.jobs == []                           # asked once, then never again
    assert chunk.Chunk(seg.view(199)).values() == [b"v" * 20] * 10


def test_a_bug_in_a_populate_job_is_raised_on_the_loop():
    worker = HeldWorker()
    populator = Populator(worker)
    populator.request(anonymous_buffer(4096), 0, 4096)
    worker.finish_all(TypeError("a bug"))
    with pytest.raises(TypeError):
        populator.collect()


def test_the_broker_daemon_takes_its_populator_thread_from_env():
    started: list[str] = []

    def worker(name, run_job, max_jobs):
        started.append(name)
        return Worker(name, run_job, max_jobs)

    env = dataclasses.replace(DaemonEnv.real(), worker=worker, server=kera_server.Server)
    daemon = BrokerDaemon("127.0.0.1:1", env=env)
    try:
        assert started == ["broker-populate"]
        assert daemon.core.segment_pool.populator is daemon.populator
        assert daemon.populator.worker.name == "broker-populate"
    finally:
        daemon.populator.close()
        daemon.server.close()

