"""The broker's memory budget: sizes as operators write them, and the default share of RAM.

The budget bounds the chunk bytes segments hold in memory (`--memory-limit`). Python objects,
per-chunk indexes and zmq buffers come on top; they are small next to the data (see
broker/README.md, "Memory").
"""

from __future__ import annotations

import os
import re

from kera.config import KiB, MiB

GiB = 1024 * MiB
TiB = 1024 * GiB
DEFAULT_RAM_SHARE = 0.25           # of physical memory, when --memory-limit is not given
FALLBACK_MEMORY_LIMIT_BYTES = 1 * GiB   # when physical memory cannot be read

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": KiB, "m": 1000**2, "mb": 1000**2,
          "mib": MiB, "g": 1000**3, "gb": 1000**3, "gib": GiB, "t": 1000**4, "tb": 1000**4,
          "tib": TiB}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*\Z")


def parse_size(text: str | int) -> int:
    """Bytes from "536870912", "512MiB", "1.5GiB", "64mb" (k/m/g/t are powers of 1000, the
    -iB forms powers of 1024); raises ValueError."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return text
    m = _SIZE_RE.match(str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 536870912, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_limit_bytes() -> int:
    ram = physical_memory_bytes()
    if not ram:
        return FALLBACK_MEMORY_LIMIT_BYTES
    return int(ram * DEFAULT_RAM_SHARE)


def resident_bytes(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and RssShmem of a process, in bytes (Linux /proc; {} elsewhere).
    Segments are anonymous *shared* maps: their resident pages count in RssShmem."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):

                    out[name] = int(rest.split()[0]) * KiB
    except OSError:
        pass
    return out
