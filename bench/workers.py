"""Producer and consumer worker processes (multiprocessing spawn), the same for both systems.

The parent starts every worker, waits until each reports "ready" (client connected), then
publishes the schedule in `Control.times` = (start, window_start, window_end) as wall-clock
seconds and sets `go`. A sampler thread in each worker records (time, count, CPU) exactly at the
window's edges, so rates are measured over the window whatever the main loop is blocked on.
Producers stop sending at window_end and flush; consumers keep reading until the parent, having
summed what producers had acknowledged, sets `stop`.

Messages to the parent on `Control.messages`: ("ready", role, index, None),
("result", role, index, dict) or ("error", role, index, traceback text).
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np

from .clients import make_consumer, make_producer
from .latency import LatencyHistogram, stamp_rows
from .procstat import self_cpu_s
from .workload import Workload, consumer_partitions, producer_streams

GO_TIMEOUT_S = 300.0          # a worker that is never told to start gives up
FLUSH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 300.0        # consumers give up waiting for `stop` after the window


@dataclass
class Control:
    """Shared between the parent and every worker of one trial (multiprocessing objects)."""
    go: object                # Event: the schedule in `times` is set
    stop: object              # Event: consumers finish
    times: object             # Array('d', 3): start, window_start, window_end (time.time())
    consumed: object          # Array('q', consumers): running record count of each consumer
    messages: object          # Queue

    @classmethod
    def create(cls, ctx, consumers: int) -> "Control":
        return cls(ctx.Event(), ctx.Event(), ctx.Array("d", 3, lock=False),
                   ctx.Array("q", max(1, consumers), lock=False), ctx.Queue())


class WindowSampler(threading.Thread):
    """Samples (wall time, count(), own CPU seconds) at window_start and window_end."""

    def __init__(self, count, window_start: float, window_end: float):
        super().__init__(daemon=True, name="window-sampler")
        self.count = count
        self.edges = (window_start, window_end)
        self.samples: list[tuple[float, int, float]] = []

    def run(self) -> None:
        for edge in self.edges:
            delay = edge - time.time()
            if delay > 0:
                time.sleep(delay)
            self.samples.append((time.time(), self.count(), self_cpu_s()))

    def window(self) -> dict:
        self.join(timeout=max(0.0, self.edges[1] - time.time()) + 5.0)
        if len(self.samples) < 2:
            return {"seconds": 0.0, "count": 0, "cpu_s": 0.0}
        (t0, n0, c0), (t1, n1, c1) = self.samples
        return {"seconds": t1 - t0, "count": n1 - n0, "cpu_s": c1 - c0}


def _wait_schedule(ctl: Control) -> tuple[float, float, float]:
    if not ctl.go.wait(GO_TIMEOUT_S):
        raise TimeoutError(f"no start signal within {GO_TIMEOUT_S:.0f} s")
    start, window_start, window_end = ctl.times[:]
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)
    return start, window_start, window_end


def payload(w: Workload, seed: int) -> np.ndarray:
    """One send unit: `records_per_chunk` records (stamped before each send), random bytes or
    text (w.payload)."""
    rng = np.random.default_rng(seed)
    shape = (w.records_per_chunk, w.record_size_bytes)
    if w.payload == "random":
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    text = b" ".join(TEXT_WORDS[i] for i in rng.integers(0, len(TEXT_WORDS), size=shape[0] * shape[1] // 4))
    return np.frombuffer(text[:shape[0] * shape[1]].ljust(shape[0] * shape[1]), dtype=np.uint8
                         ).reshape(shape).copy()


# The vocabulary of `payload="text"` records: event-like words and field names.
TEXT_WORDS = tuple(b'"user_id": "status": "ok" "error" "region": "eu-west-1" "us-east-2" GET POST '
                   b'/api/v1/orders /api/v1/users 200 404 500 "latency_ms": "item": "cart" '
                   b'"checkout" "session": true false null "ts": "device": "mobile" "web"'.split())


def producer_main(system: str, bootstrap: str, prefix: str, w: Workload, index: int,
                  ctl: Control) -> None:
    client = None
    try:
        client = make_producer(system, bootstrap, prefix, w, index)
        streams = producer_streams(w, index)
        values = payload(w, seed=index)
        unit = len(values)
        ctl.messages.put(("ready", "producer", index, None))
        start, window_start, window_end = _wait_schedule(ctl)
        sampler = WindowSampler(client.acked, window_start, window_end)
        sampler.start()
        sent = 0
        k = 0
        interval_s = unit / w.rate_records_per_s if w.rate_records_per_s else 0.0
        while True:
            now = time.time()
            if now >= window_end:
                break
            if interval_s:
                due = start + k * interval_s
                if due > now:
                    time.sleep(min(due - now, window_end - now))
                    continue
            stamp_rows(values, int(now * 1e6))
            client.send(streams[k % len(streams)], values)
            sent += unit
            k += 1
        window = sampler.window()
        client.flush(FLUSH_TIMEOUT_S)
        result = {"sent": sent, "acked": client.acked(), "failed": client.failed(),
                  "window": window}
        client.close()
        client = None
        ctl.messages.put(("result", "producer", index, result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the trial
        ctl.messages.put(("error", "producer", index, traceback.format_exc()))
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - already reporting the first error
                pass


def consumer_main(system: str, bootstrap: str, prefix: str, w: Workload, index: int,
                  ctl: Control) -> None:
    client = None
    try:
        client = make_consumer(system, bootstrap, prefix, w, consumer_partitions(w, index), index)
        ctl.messages.put(("ready", "consumer", index, None))
        _, window_start, window_end = _wait_schedule(ctl)
        total = 0
        sampler = WindowSampler(lambda: total, window_start, window_end)
        sampler.start()
        hist = LatencyHistogram()
        in_window = 0
        give_up = window_end + STOP_TIMEOUT_S
        while not ctl.stop.is_set():
            stamps = client.poll()
            now = time.time()
            if stamps is None:
                if now > give_up:
                    raise TimeoutError("no stop signal from the parent")
                continue
            total += len(stamps)
            ctl.consumed[index] = total
            if window_start <= now < window_end:
                in_window += len(stamps)
                hist.add(now * 1e6 - stamps)
        window = sampler.window()
        window["count"] = in_window  # records received inside the window, by receive time
        result = {"consumed": total, "window": window, "latency_hist": hist.to_list()}
        client.close()
        client = None
        ctl.messages.put(("result", "consumer", index, result))
    except BaseException:  # noqa: BLE001
        ctl.messages.put(("error", "consumer", index, traceback.format_exc()))
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
