"""Which streamlet a keyed record goes to: CRC32C of the key modulo the streamlet count.

Stable across processes, machines and Python versions (never Python's salted `hash`), so a
key always lands in the same streamlet and its records stay in order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from crc32c import crc32c


def streamlet_for_key(key: bytes, streamlets: int) -> int:
    return crc32c(key) % streamlets


def streamlets_for_keys(keys: Sequence[bytes | None], streamlets: int) -> np.ndarray:
    """int64 streamlet per key; -1 for a None key (the caller places keyless records)."""
    return np.fromiter((-1 if k is None else crc32c(k) % streamlets for k in keys),
                       dtype=np.int64, count=len(keys))
