"""Helpers of the fault tests (real daemons killed with SIGKILL under a running workload).

A workload of producers and a consumer in threads whose records carry their identity
(producer, sequence); the exactly-once check; waits on the daemons' state. Every wait polls a
condition with a generous deadline: the machine may be loaded.
"""

from __future__ import annotations

import os
import random
import struct
import threading
import time

import numpy as np

from kera import Consumer, Producer
from kera.client.coordinator_client import CoordinatorClient
from kera.errors import KeraError

ID = struct.Struct("<IQ")      # producer index, sequence
VALUE_BYTES = 64
WAIT_S = 90.0                  # a failover, a restart: generous on a loaded 2-core machine


def seeded(name: str) -> random.Random:
    """A seeded generator (KERA_FAULT_SEED overrides the seed); the seed is printed."""
    seed = int(os.environ.get("KERA_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"{name}: seed {seed} (rerun with KERA_FAULT_SEED={seed})")
    return random.Random(seed)


def wait_for(predicate, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except KeraError as err:   # a daemon restarting: ask again
            last = err
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} "
                                 f"(last error: {last})")
        time.sleep(poll_s)


def call(address: str, op: str, fields: dict | None = None, timeout_s: float = 2.0) -> dict:
    """`op` of the coordinator at `address` (a bootstrap list: of its leader)."""
    client = CoordinatorClient(address, timeout_s=timeout_s)
    try:
        return client.call(op, fields)[0]
    finally:
        client.close()


def values(producer: int, start: int, n: int) -> np.ndarray:
    out = np.zeros((n, VALUE_BYTES), dtype=np.uint8)
    ids = np.zeros(n, dtype=[("p", "<u4"), ("s", "<u8")])
    ids["p"] = producer
    ids["s"] = np.arange(start, start + n)
    out[:, :12] = ids.view(np.uint8).reshape(n, 12)
    out[:, 12:] = (np.arange(start, start + n) % 251).astype(np.uint8)[:, None]
    return out


def decode(batch) -> list[tuple[int, int, int]]:
    """(producer, sequence, streamlet) of each record of a Batch; checks the filler bytes."""
    n = len(batch)
    off = batch.value_offsets.astype(np.int64)
    assert (np.diff(off) == VALUE_BYTES).all(), "a value of the wrong size"
    grid = np.frombuffer(batch.values_blob, dtype=np.uint8, count=n * VALUE_BYTES).reshape(n, VALUE_BYTES)
    ids = grid[:, :12].copy().view([("p", "<u4"), ("s", "<u8")]).reshape(n)
    assert (grid[:, 12:] == (ids["s"] % 251).astype(np.uint8)[:, None]).all(), "value bytes differ"
    return [(int(p), int(s), batch.streamlet) for p, s in zip(ids["p"], ids["s"])]


class Workload:
    """Producers sending numbered records and a consumer reading them, each in a thread.

    A producer sends a batch, then every few batches flushes: records sent before a flush that
    returned are *acknowledged*; those of a flush that raised are *uncertain* (they may be
    stored once, or not at all, never twice)."""

    def __init__(self, bootstrap: str, stream: str, producers: int = 2, batch: int = 40,
                 pause_s: float = 0.01, flush_every: int = 5):
        self.bootstrap, self.stream = bootstrap, stream
        self.acked: list[int] = [0] * producers     # sequences below are acknowledged
        self.uncertain: list[set] = [set() for _ in range(producers)]
        self.sent = [0] * producers
        self.errors: list[str] = []
        self.read: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._stop_reading = threading.Event()
        self._threads = [threading.Thread(target=self._produce, args=(i, batch, pause_s, flush_every),
                                          daemon=True, name=f"producer-{i}")
                         for i in range(producers)]
        self._reader = threading.Thread(target=self._consume, daemon=True, name="consumer")

    def start(self) -> "Workload":
        for t in self._threads:
            t.start()
        self._reader.start()
        return self

    def _produce(self, i: int, batch: int, pause_s: float, flush_every: int) -> None:
        p = Producer(self.bootstrap, request_timeout_s=3.0, retries_max=1000, linger_ms=2,
                     send_timeout_s=120.0)
        try:
            k = 0
            while not self._stop.is_set():
                p.send_batch(self.stream, values(i, self.sent[i], batch))
                self.sent[i] += batch
                k += 1
                if k % flush_every == 0:
                    self._flush(p, i)
                time.sleep(pause_s)
            self._flush(p, i)
        except Exception as exc:   # noqa: BLE001 - reported by check()
            self.errors.append(f"producer {i}: {exc!r}")
        finally:
            p.close(timeout=30)

    def _flush(self, p: Producer, i: int) -> None:
        try:
            p.flush(timeout=120.0)
        except KeraError as err:
            self.errors.append(f"producer {i} flush: {err!r}")   # allowed, but reported
            self.uncertain[i].update(range(self.acked[i], self.sent[i]))
        else:
            self.acked[i] = self.sent[i]

    def _consume(self) -> None:
        c = Consumer(self.bootstrap, self.stream, request_timeout_s=3.0)
        try:
            while not self._stop_reading.is_set():
                for b in c.poll_batch(timeout_s=0.2):
                    self.read.extend(decode(b))
        except Exception as exc:   # noqa: BLE001
            self.errors.append(f"consumer: {exc!r}")
        finally:
            c.close()

    def stop_producing(self, timeout_s: float = 180.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
            assert not t.is_alive(), f"{t.name} did not stop"

    def drain(self, timeout_s: float = WAIT_S) -> None:
        """Let the consumer read until it saw every acknowledged record, then stop it."""
        def caught_up():
            seen = {(p, s) for p, s, _ in self.read}
            return all((i, s) in seen for i, n in enumerate(self.acked) for s in range(n))
        try:
            wait_for(caught_up, "the consumer to read every acknowledged record", timeout_s, 0.2)
        finally:
            time.sleep(0.5)   # anything duplicated right after would show now
            self._stop_reading.set()
            self._reader.join(30)


def check_exactly_once(read: list[tuple[int, int, int]], acked: list[int], uncertain: list[set],
                       who: str) -> None:
    """Every acknowledged record once, nothing twice, each producer's records per streamlet
    in the order sent."""
    counts: dict[tuple[int, int], int] = {}
    for p, s, _ in read:
        counts[(p, s)] = counts.get((p, s), 0) + 1
    dups = sorted(k for k, n in counts.items() if n > 1)
    assert not dups, f"{who}: {len(dups)} records read more than once, e.g. {dups[:5]}"
    missing = [(i, s) for i, n in enumerate(acked) for s in range(n) if (i, s) not in counts]
    assert not missing, f"{who}: {len(missing)} acknowledged records never read, e.g. {missing[:5]}"
    extra = [(p, s) for p, s in counts if s >= acked[p] and s not in uncertain[p]]
    # Records sent after the last acknowledgement may be stored (their ack was on its way).
    last: dict[tuple[int, int], int] = {}
    for p, s, sl in read:
        prev = last.get((p, sl), -1)
        assert s > prev, f"{who}: producer {p} streamlet {sl}: sequence {s} after {prev}"
        last[(p, sl)] = s
    print(f"{who}: {len(read)} records read, {sum(acked)} acknowledged, "
          f"{len(extra)} beyond the last acknowledgement")


def numbers(batch, active_groups: int) -> list[tuple[int, int, int]]:
    """(streamlet, slot, record number) of each record of a Batch."""
    slot = batch.chunk.header.producer_id % active_groups
    assert batch.numbers is not None, "a record without a number"
    return [(batch.streamlet, slot, int(n)) for n in batch.numbers]


def check_numbers_dense(numbered: list[tuple[int, int, int]], who: str) -> None:
    """Each (streamlet, slot)'s record numbers, read back whole, are exactly 0..N-1: dense,
    gap-free and never given twice, whatever failed over meanwhile."""
    by_unit: dict[tuple[int, int], list[int]] = {}
    for sl, slot, n in numbered:
        by_unit.setdefault((sl, slot), []).append(n)
    for unit, ns in sorted(by_unit.items()):
        ns.sort()
        assert ns == list(range(len(ns))), (
            f"{who}: streamlet {unit[0]} slot {unit[1]}: {len(ns)} records numbered "
            f"{ns[:3]}..{ns[-3:]}, not 0..{len(ns) - 1}")
    print(f"{who}: {len(numbered)} record numbers dense in {len(by_unit)} slots")


def read_everything(bootstrap: str, stream: str, expected: int, timeout_s: float = WAIT_S,
                    numbered: tuple[list, int] | None = None):
    """A fresh consumer from the beginning, until `expected` records (then a little more).
    `numbered` = (list, active groups): the records' numbers are added to the list."""
    out: list = []
    with Consumer(bootstrap, stream, request_timeout_s=3.0) as c:
        deadline = time.monotonic() + timeout_s
        quiet_until = None
        while True:
            got = c.poll_batch(timeout_s=0.3)
            for b in got:
                out.extend(decode(b))
                if numbered is not None:
                    numbered[0].extend(numbers(b, numbered[1]))
            now = time.monotonic()
            if len(out) >= expected:
                quiet_until = quiet_until or now + 1.0
                if now > quiet_until:
                    return out
            assert now < deadline, f"read {len(out)} of at least {expected} records"



def memory_kib(pid: int) -> tuple[int, int]:
    """(peak, retained) resident memory of a process in KiB: VmHWM and VmRSS of /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0])
    return fields["VmHWM"], fields["VmRSS"]


# What a daemon log shows when a handler, hook or callback raised something unexpected.
LOG_PROBLEM_MARKS = ("Traceback (most recent call last)", "internal error")


def log_problems(cluster, lines_max: int = 40) -> dict[str, list[str]]:
    """Per daemon, the log lines (with the next few) that report an unexpected exception."""
    out: dict[str, list[str]] = {}
    for d in cluster.daemons:
        try:
            lines = d.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        hits = [i for i, line in enumerate(lines) if any(m in line for m in LOG_PROBLEM_MARKS)]
        if hits:
            out[d.name] = [line for i in hits[:3] for line in lines[i:i + lines_max // 3]]
    return out


class DeadPorts:
    """`with DeadPorts(n) as ports:` n TCP ports bound on every address and never listened on,
    for as long as the block runs: a connection to any host's such port is refused, and no
    other process (another test's daemon on this shared machine) can take the port meanwhile."""

    def __init__(self, n: int):
        import socket
        self._socks = []
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("0.0.0.0", 0))
            self._socks.append(sock)

    def __enter__(self) -> list[int]:
        return [sock.getsockname()[1] for sock in self._socks]

    def __exit__(self, *exc) -> None:
        for sock in self._socks:
            sock.close()
