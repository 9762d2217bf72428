"""CPU seconds and disk writes from /proc, without psutil: per process (all its threads) and
for the machine.

The machine is shared, so every measurement also records how busy the whole machine was:
CPU used by processes outside the system under test is noise the results should show.
"""

from __future__ import annotations

import os

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (every thread), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # Field 2 (comm) may hold spaces and parentheses: split after its closing one.
    fields = text[text.rindex(b")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    return (utime + stime) / CLOCK_TICKS_PER_S


def processes_cpu_s(pids) -> float:
    """Summed CPU seconds of `pids` (a process that is gone counts 0)."""
    return sum(process_cpu_s(pid) or 0.0 for pid in pids)


def process_write_bytes(pid: int) -> int | None:
    """Bytes process `pid` has sent, or dirtied in the page cache, to storage (its
    /proc/PID/io `write_bytes`: O_DIRECT and buffered writes alike), None if it is gone or
    not readable."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def processes_write_bytes(pids) -> int:
    """Summed `process_write_bytes` of `pids` (a process that is gone counts 0)."""
    return sum(process_write_bytes(pid) or 0 for pid in pids)


def machine_cpu_s() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine since boot, all cores."""
    with open("/proc/stat", "rb") as f:
        first = f.readline().split()
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)   # idle + iowait
    total = sum(values[:8])                                      # guest time is inside user
    return (total - idle) / CLOCK_TICKS_PER_S, total / CLOCK_TICKS_PER_S


def self_cpu_s() -> float:
    """This process's user + system CPU seconds (all threads)."""
    t = os.times()
    return t.user + t.system


def cpu_ms_per_mib(benchmark, write_round, rounds: int) -> tuple[float, float]:
    """Run `write_round(i)` (i = 0, 1, ...; returns the bytes it wrote) `rounds` times under
    pytest-benchmark; returns (this process's CPU ms per MiB over all rounds, MiB written): the
    figure of a write path's benchmark, its cost to the machine rather than its wall time."""
    totals: list[tuple[int, float]] = []

    def round_():
        cpu = self_cpu_s()
        written = write_round(len(totals))
        totals.append((written, self_cpu_s() - cpu))

    benchmark.pedantic(round_, rounds=rounds, iterations=1, warmup_rounds=0)
    mib = sum(w for w, _ in totals) / (1 << 20)
    return sum(c for _, c in totals) * 1000 / mib, mib
