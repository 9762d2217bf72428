"""Durable coordinator metadata: one JSON file replaced atomically.

Write a temporary file, fsync it, rename it over `coordinator.json`, fsync the directory: a crash
at any point leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kera.durable import write_atomic

STATE_FILE = "coordinator.json"
STATE_BYTES_MAX = 256 * 1024 * 1024  # refuse to parse anything absurd


def load(data_dir: str | os.PathLike) -> dict | None:
    """The last saved state, or None when the directory holds none (first start)."""
    path = Path(data_dir) / STATE_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(STATE_BYTES_MAX + 1)
    except FileNotFoundError:
        return None
    if len(raw) > STATE_BYTES_MAX:
        raise ValueError(f"{path} exceeds {STATE_BYTES_MAX} bytes")
    try:
        state = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return state


def save(data_dir: str | os.PathLike, state: dict) -> None:
    directory = Path(data_dir)
    data = json.dumps(state, separators=(",", ":"), sort_keys=True).encode()
    write_atomic(directory / STATE_FILE, data)
