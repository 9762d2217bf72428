"""The backup daemon as a real subprocess: replicate, flush, read back, bad input, disk errors.

No coordinator runs here unless a test plays one: the backup is pointed at an address nothing
listens on and must serve anyway while it keeps trying to register.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

from kera.codec import chunk
from kera.cli.local import free_port

from kera.net import rpc

from kera.codec import wire
from kera.config import MiB
from kera.backup import disk
from kera.backup.meta import Meta
from kera.errors import BadRequest, CorruptChunk, KeraError, StorageError

pytestmark = pytest.mark.timeout(120)


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.01)


class Backup:
    """One backup daemon process on a free port."""

    def __init__(self, data_dir: Path, coordinator: str | None = None, *extra: str):
        self.dir = data_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.coordinator = coordinator or f"127.0.0.1:{free_port()}"  # nothing listens there
        self.log_path = data_dir.parent / f"backup-{self.port}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kera.backup", "--coordinator", self.coordinator,
             "--port", str(self.port), "--dir", str(data_dir), "--node", "test-node", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.conn = rpc.Connection(self.address, timeout_s=5.0)
        wait_for(self._answers, 15.0, "backup answering stats")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        try:
            self.conn.call("stats", timeout_s=0.5)
            return True
        except KeraError:
            return False

    def call(self, op: str, fields: dict | None = None, frames=()):
        return self.conn.call(op, fields, frames)

    def replicate(self, broker_id, vlog, vseg, offset, frames, durability="memory", close=False):
        header, _ = self.call("replicate", {"broker_id": broker_id, "vlog": vlog, "vseg": vseg,
                                            "offset": offset, "durability": durability,
                                            "close": close}, frames)
        return header["length"]

    def stats(self) -> dict:
        return self.call("stats")[0]["stats"]

    def replicas(self, broker_id: int) -> list[dict]:
        return self.call("list_replicas", {"broker_id": broker_id})[0]["replicas"]

    def read_all(self, broker_id, vlog, vseg, max_bytes=1) -> list[bytes]:
        out, offset = [], 0
        while True:
            header, frames = self.call("read_replica", {"broker_id": broker_id, "vlog": vlog,
                                                        "vseg": vseg, "offset": offset,
                                                        "max_bytes": max_bytes})
            out += [f.bytes for f in frames]
            if header["end"] == header["length"]:
                return out
            assert frames and header["end"] > offset
            offset = header["end"]

    def stop(self, sig=signal.SIGTERM, wait_s: float = 30.0) -> int:
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def backup(tmp_path):
    started = []

    def start(*extra, coordinator=None, data_dir=None) -> Backup:
        b = Backup(data_dir or tmp_path / "data", coordinator, *extra)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop(signal.SIGKILL)


def make_chunks(count: int, start: int = 0, values: int = 20, size: int = 100) -> list[bytes]:
    return [chunk.encode(4, start + i, 11, 0, [os.urandom(size) for _ in range(values)])
            for i in range(count)]


def flushed(b: Backup) -> bool:
    s = b.stats()
    return s["unflushed_bytes"] == 0 and s["flush_jobs_out"] == 0


# --------------------------------------------------------------------------- replicate and flush

def test_replicated_chunks_reach_disk_byte_for_byte(backup, tmp_path):
    b = backup()
    data = make_chunks(30)
    offset = 0
    for i in range(0, 30, 3):
        offset = b.replicate(1, 0, 0, offset, data[i:i + 3])
    assert offset == sum(map(len, data))
    other = make_chunks(2, start=100)
    b.replicate(1, 3, 17, 0, other, close=True)
    wait_for(lambda: flushed(b), what="flusher idle")
    root = tmp_path / "data"
    assert (root / "1" / "0000-000000000000.seg").read_bytes() == b"".join(data)
    assert (root / "1" / "0003-000000000017.seg").read_bytes() == b"".join(other)
    assert disk.read_meta(root / "1" / "0003-000000000017.meta") == Meta(1, 3, 17, sum(map(len, other)), True)
    assert disk.read_meta(root / "1" / "0000-000000000000.meta") == Meta(1, 0, 0, offset, False)
    listing = {(r["vlog"], r["vseg"]): r for r in b.replicas(1)}
    assert listing[(0, 0)]["length"] == listing[(0, 0)]["disk_length"] == offset
    assert listing[(0, 0)]["in_memory"] and not listing[(0, 0)]["closed"]
    assert listing[(3, 17)]["closed"] and not listing[(3, 17)]["in_memory"]  # closed, on disk: dropped
    # Read back: the open replica from memory, the closed one from disk (verified again).
    assert b.read_all(1, 0, 0, max_bytes=5000) == data
    assert b.read_all(1, 3, 17) == other
    s = b.stats()
    assert s["replicate_writes"] == 11 and s["chunks_received"] == 32
    assert s["flushes"] >= 2 and s["flush_bytes"] == offset + sum(map(len, other))
    assert s["replicas_open"] == 1 and s["replicas_on_disk"] == 2


def test_disk_durability_acks_after_the_bytes_are_on_disk(backup, tmp_path):
    b = backup()
    root = tmp_path / "data"
    offset = 0
    written = b""
    for data in (make_chunks(2), make_chunks(3, start=2)):
        offset = b.replicate(2, 1, 5, offset, data, durability="disk")
        written += b"".join(data)
        # No waiting: the ack itself promises the fsynced bytes and their metadata record.
        assert (root / "2" / "0001-000000000005.seg").read_bytes() == written
        assert disk.read_meta(root / "2" / "0001-000000000005.meta").length == offset == len(written)
    assert b.replicate(2, 1, 5, offset, [], durability="disk", close=True) == offset
    assert disk.read_meta(root / "2" / "0001-000000000005.meta").closed


def test_retry_is_acknowledged_without_storing_twice(backup, tmp_path):
    b = backup()
    first, second = make_chunks(2), make_chunks(2, start=2)
    n = b.replicate(3, 0, 0, 0, first)
    assert b.replicate(3, 0, 0, n, second, close=True) == n + sum(map(len, second))
    assert b.replicate(3, 0, 0, n, second, close=True) == n + sum(map(len, second))
    with pytest.raises(BadRequest, match="offset mismatch"):
        b.replicate(3, 0, 0, n, first)
    wait_for(lambda: flushed(b))
    assert (tmp_path / "data" / "3" / "0000-000000000000.seg").read_bytes() == b"".join(first + second)


# --------------------------------------------------------------------------- bad input

def test_bad_checksum_refuses_the_write_and_stores_nothing(backup, tmp_path):
    b = backup()
    good = make_chunks(3)
    n = b.replicate(5, 0, 0, 0, good[:1])
    bad = bytearray(good[2])
    bad[200] ^= 0xFF
    with pytest.raises(CorruptChunk):
        b.replicate(5, 0, 0, n, [good[1], bytes(bad)])
    with pytest.raises(CorruptChunk):
        b.replicate(6, 0, 0, 0, [bytes(bad)])
    with pytest.raises(CorruptChunk):
        b.replicate(5, 0, 0, n, [good[1][:-1]])
    assert [(r["vseg"], r["length"]) for r in b.replicas(5)] == [(0, n)]
    assert b.replicas(6) == []
    wait_for(lambda: flushed(b))
    assert (tmp_path / "data" / "5" / "0000-000000000000.seg").read_bytes() == good[0]
    assert not (tmp_path / "data" / "6").exists()
    assert b.stats()["chunks_rejected"] == 4
    assert b.replicate(5, 0, 0, n, good[1:]) == sum(map(len, good))  # and service goes on


def fuzz_message(rng: random.Random, good: list[bytes]) -> list[bytes]:
    """One malformed request: garbage headers, mistyped fields, damaged chunk frames."""
    kind = rng.randrange(8)
    base = {"v": 1, "op": "replicate", "id": rng.randrange(2**31), "broker_id": 99,
            "vlog": rng.randrange(3), "vseg": rng.randrange(3), "offset": 0, "durability": "memory"}
    if kind == 0:
        return [os.urandom(rng.randrange(0, 200))]
    if kind == 1:
        return [msgpack.packb(rng.choice([[1, 2], "op", 3, None, b"x", {"id": "x"}, {}]))]
    if kind == 2:
        field = rng.choice(["v", "op", "id", "broker_id", "vlog", "vseg", "offset", "durability",
                            "close", "max_bytes"])
        base[field] = rng.choice([None, -1, 2**64 - 1, -2**63, "x", b"y", [1], {"a": 1}, True, 1.5, 2**32])
        base["op"] = base["op"] if field == "op" else rng.choice(["replicate", "read_replica",
                                                                  "list_replicas", "nope"])
        return [msgpack.packb(base), *rng.sample(good, 1)]
    c = bytearray(rng.choice(good))
    if kind == 3:
        c[rng.randrange(len(c))] ^= 1 << rng.randrange(8)          # one bit flipped
    elif kind == 4:
        c = c[:rng.randrange(len(c))]                                # truncated
    elif kind == 5:
        c = c + os.urandom(rng.randrange(1, 100))                    # trailing garbage
    elif kind == 6:
        c[rng.randrange(64)] = rng.randrange(256)                    # header byte replaced
    else:
        base["offset"] = rng.randrange(1, 10**6)                     # offset past the end
        return [msgpack.packb(base), bytes(c)]
    frames = [bytes(c)]
    if rng.random() < 0.5:
        frames.insert(0, rng.choice(good))                          # good chunk first: all or nothing
    return [msgpack.packb(base), *frames]


def test_fuzzed_requests_get_error_replies_and_service_goes_on(backup):
    seed = int(os.environ.get("KERA_FUZZ_SEED", random.randrange(2**32)))
    print(f"fuzz seed {seed} (KERA_FUZZ_SEED to reproduce)")
    rng = random.Random(seed)
    b = backup()
    good = make_chunks(4, values=5, size=30)
    n = b.replicate(1, 0, 0, 0, good[:2])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{b.address}")
    total, window, sent, received, errors = 3000, 100, 0, 0, 0
    deadline = time.monotonic() + 60
    try:
        while received < total:
            assert time.monotonic() < deadline, f"{received}/{total} replies (seed {seed})"
            while sent < total and sent - received < window:
                sock.send_multipart(fuzz_message(rng, good))
                sent += 1
            if sock.poll(5000):
                reply = wire.unpack_header(sock.recv_multipart()[0])
                received += 1
                errors += reply.get("ok") is not True
    finally:
        sock.close()
    assert b.proc.poll() is None
    assert errors >= total * 0.8, f"only {errors} of {total} fuzzed requests were refused (seed {seed})"
    # The real replica is untouched and accepts the next write; whatever the fuzzer stored for
    # broker 99 consists of valid chunks only.
    assert [r["length"] for r in b.replicas(1)] == [n]
    assert b.replicate(1, 0, 0, n, good[2:], close=True) == sum(map(len, good))
    assert b.read_all(1, 0, 0) == good
    for r in b.replicas(99):
        for c in b.read_all(99, r["vlog"], r["vseg"], max_bytes=10**6):
            chunk.verify(c)
    assert b.stats()["chunks_rejected"] > 0
    assert "internal error" not in b.log_path.read_text()  # every refusal was a deliberate one


# --------------------------------------------------------------------------- storage errors

def test_unwritable_replica_directory_reports_storage_error(backup, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "8").write_bytes(b"a file where broker 8's directory should be")
    b = backup()
    data = make_chunks(2)
    with pytest.raises(StorageError) as info:
        b.replicate(8, 0, 0, 0, data[:1], durability="disk")
    assert info.value.retriable
    # The bytes were buffered but cannot reach disk: further writes are refused too...
    with pytest.raises(StorageError):
        b.replicate(8, 0, 0, len(data[0]), data[1:])
    s = b.stats()
    assert s["storage_errors"] >= 1 and s["replicas_failed"] == 1
    # ...while other brokers' replicas are served as usual.
    assert b.replicate(9, 0, 0, 0, data, durability="disk") == sum(map(len, data))
    assert b.proc.poll() is None
    # Stopping does not wait out the shutdown flush timeout for a disk that keeps failing.
    assert b.stop(wait_s=20) == 0


# --------------------------------------------------------------------------- lifecycle

def test_sigterm_flushes_and_a_restart_serves_the_replicas_from_disk(backup, tmp_path):
    b = backup()
    data = make_chunks(20)
    b.replicate(4, 0, 9, 0, data[:10], close=True)
    b.replicate(4, 1, 0, 0, data[10:])
    assert b.stop() == 0
    for (vlog, vseg), expect, closed in (((0, 9), data[:10], True), ((1, 0), data[10:], False)):
        path = disk.segment_path(tmp_path / "data", (4, vlog, vseg))
        assert path.read_bytes() == b"".join(expect)
        assert disk.read_meta(path.with_suffix(".meta")).closed == closed
    b2 = backup()
    listing = b2.replicas(4)
    assert [(r["vlog"], r["vseg"], r["closed"], r["on_disk"], r["in_memory"]) for r in listing] == [
        (0, 9, True, True, False), (1, 0, False, True, False)]
    assert b2.read_all(4, 0, 9, max_bytes=3000) == data[:10]
    assert b2.read_all(4, 1, 0, max_bytes=10**6) == data[10:]
    # The open replica goes on from where it was.
    n = listing[1]["length"]
    more = make_chunks(1, start=50)
    assert b2.replicate(4, 1, 0, n, more) == n + len(more[0])
    assert b2.read_all(4, 1, 0, max_bytes=10**6) == data[10:] + more


def test_disk_acknowledged_writes_survive_sigkill(backup):
    b = backup()
    data = make_chunks(12)
    offset = 0
    for i in range(0, 12, 2):
        offset = b.replicate(6, 2, 3, offset, data[i:i + 2], durability="disk")
    b.replicate(6, 2, 4, 0, data[:1])  # memory durability: may or may not be on disk yet
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    b2 = backup()
    listing = {(r["vlog"], r["vseg"]): r for r in b2.replicas(6)}
    assert listing[(2, 3)]["length"] == offset
    assert b2.read_all(6, 2, 3, max_bytes=10**6) == data
    if (2, 4) in listing:  # whatever survived is whole and verified
        assert b2.read_all(6, 2, 4) in ([], data[:1])


def test_metrics_endpoint(backup):
    port = free_port()
    b = backup("--metrics-port", str(port))
    b.replicate(1, 0, 0, 0, make_chunks(1))

    def scrape():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return None
        return text if re.search(r"^kera_backup_replicate_writes\{.*\} 1\.0$", text, re.M) else None

    text = wait_for(scrape, what="metrics")
    assert "kera_backup_unflushed_bytes" in text


class FakeCoordinator:
    """A ROUTER socket in the test thread that answers register/heartbeat as told."""

    def __init__(self, port: int | None = None):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.address = f"127.0.0.1:{port}"

    def serve_until(self, done, answer, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "coordinator conversation did not finish"
            if self.sock.poll(100):
                identity, frame, *_ = self.sock.recv_multipart()
                header = msgpack.unpackb(frame)
                self.sock.send_multipart([identity, msgpack.packb(answer(header))])


def test_registers_heartbeats_and_registers_again_when_forgotten(backup):
    coord = FakeCoordinator()
    seen: list[dict] = []
    forget = []  # set: answer the next heartbeat `not_ready`, as a restarted coordinator does

    def answer(header):
        seen.append(header)
        reply = {"v": 1, "id": header["id"], "ok": True}
        if header["op"] == "register":
            return reply | {"daemon_id": 42, "heartbeat_interval_ms": 50}
        if forget:
            forget.clear()
            return {"v": 1, "id": header["id"], "ok": False, "code": "not_ready",
                    "message": "unknown backup 42", "retriable": True}
        return reply | {"metadata_version": 3}

    try:
        b = backup(coordinator=coord.address)
        coord.serve_until(lambda: sum(h["op"] == "heartbeat" for h in seen) >= 3, answer)
        register = seen[0]
        assert register["op"] == "register" and register["kind"] == "backup"
        assert register["address"] == b.address and register["node"] == "test-node"
        assert "daemon_id" not in register
        beats = [h for h in seen if h["op"] == "heartbeat"]
        assert all(h["kind"] == "backup" and h["daemon_id"] == 42 and h["metadata_version"] == 0
                   for h in beats)
        assert b.stats()["backup_id"] == 42 and b.stats()["registered"]
        forget.append(True)
        coord.serve_until(lambda: not forget and seen[-1]["op"] == "register", answer)
        assert seen[-1]["daemon_id"] == 42  # asks for the same identity again
        coord.serve_until(lambda: seen[-1]["op"] == "heartbeat", answer)
        assert b.proc.poll() is None
    finally:
        coord.sock.close()


def test_serves_while_the_coordinator_is_down_and_registers_when_it_appears(backup):
    port = free_port()
    b = backup(coordinator=f"127.0.0.1:{port}")
    assert b.replicate(1, 0, 0, 0, make_chunks(1)) > 0
    assert not b.stats()["registered"]
    coord = FakeCoordinator(port)
    seen: list[dict] = []

    def answer(header):
        seen.append(header)
        return {"v": 1, "id": header["id"], "ok": True, "daemon_id": 7, "heartbeat_interval_ms": 50,
                "metadata_version": 0}

    try:
        coord.serve_until(lambda: any(h["op"] == "heartbeat" for h in seen), answer, timeout_s=15)
        assert b.stats()["registered"]
    finally:
        coord.sock.close()


def test_registers_with_the_real_coordinator(backup, tmp_path):
    port = free_port()
    log = open(tmp_path / "coordinator.log", "wb")
    coord = subprocess.Popen([sys.executable, "-m", "kera", "coordinator", "--port", str(port),
                              "--dir", str(tmp_path / "coord"), "--heartbeat-interval-ms", "50"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        b = backup(coordinator=f"127.0.0.1:{port}")

        def alive():
            try:
                header, _ = rpc.call(f"127.0.0.1:{port}", "cluster", timeout_s=1.0)
            except KeraError:
                return None
            return [m for m in header["backups"] if m["address"] == b.address and m["alive"]]

        (member,) = wait_for(alive, 15.0, "backup alive in the coordinator's cluster view")
        assert member["node"] == "test-node"
        wait_for(lambda: b.stats()["backup_id"] == member["id"], what="backup knows its id")
    finally:
        coord.terminate()
        coord.wait(10)
        log.close()


# ---------------------------------------------------------------------- bounds (issue 10)

def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _entries(root: Path) -> int:
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(root))


def test_empty_replicate_writes_with_fresh_keys_create_nothing(backup, tmp_path):
    b = backup()
    entries_before = _entries(b.dir)
    for vseg in range(200):   # warm up the loop before measuring RSS
        b.replicate(9, 0, vseg, 0, [], durability="disk")
    rss_before = _rss_bytes(b.proc.pid)
    for vseg in range(10_000):
        assert b.replicate(vseg % 4096, vseg % 7, 1_000 + vseg, 0, [],
                           durability="disk" if vseg % 2 else "memory", close=vseg % 3 == 0) == 0
    wait_for(lambda: b.stats()["flush_jobs_out"] == 0, 10, "flusher idle")
    stats = b.stats()
    assert stats["replicas"] == 0 and stats["empty_writes"] == 10_200 and stats["disk_bytes"] == 0
    assert _entries(b.dir) == entries_before        # no replica, directory or file was created
    assert b.replicas(9) == []
    # A replica object, a directory and two files per key would be tens of MiB here.
    rss_after = _rss_bytes(b.proc.pid)
    print(f"10,000 empty writes: RSS {rss_before / MiB:.1f} -> {rss_after / MiB:.1f} MiB, "
          f"{_entries(b.dir)} files and directories")
    assert rss_after - rss_before < 8 * MiB


def test_backup_at_disk_limit_refuses_whole_writes_and_keeps_what_it_acknowledged(backup, tmp_path):
    b = backup("--disk-limit", "64KiB")
    acked: dict[int, list[bytes]] = {}
    refused = 0
    for vseg in range(40):
        frames = make_chunks(2, start=vseg * 2, values=5, size=200)
        try:
            assert b.replicate(1, 0, vseg, 0, frames, durability="disk", close=True) > 0
            acked[vseg] = frames
        except StorageError as err:
            assert "--disk-limit" in err.message
            refused += 1
    assert acked and refused
    stats = b.stats()
    assert stats["disk_bytes"] <= 64 * 1024
    held = {r["vseg"] for r in b.replicas(1)}
    assert held == set(acked)                       # no partial replica of a refused write
    b.stop(signal.SIGKILL)
    again = backup("--disk-limit", "64KiB", data_dir=b.dir)
    for vseg, frames in acked.items():
        assert again.read_all(1, 0, vseg, max_bytes=1 << 20) == frames
    with pytest.raises(StorageError):               # still full after the restart
        again.replicate(1, 0, 999, 0, make_chunks(2, values=5, size=200), durability="disk")


def test_replica_count_limit_is_a_clear_storage_error(backup):
    b = backup("--max-replicas-per-broker", "3")
    for vseg in range(3):
        b.replicate(5, 0, vseg, 0, make_chunks(1, start=vseg))
    with pytest.raises(StorageError, match="replicas of broker 5"):
        b.replicate(5, 0, 3, 0, make_chunks(1, start=3))
    assert len(b.replicas(5)) == 3
    b.replicate(6, 0, 0, 0, make_chunks(1))         # another broker's place is its own
