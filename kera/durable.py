"""Durable small files: write a temporary name, fsync, rename over the old one, fsync the folder.

A reader after a crash sees either the old content or the new, never a mix: the rule every
metadata file in kera follows (coordinator state, backup replica records, broker segment
records and markers).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably; raises OSError."""
    final = Path(path)
    temp = final.with_name(final.name + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, final)
    fsync_dir(final.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_durable(path: str | os.PathLike) -> None:
    """Unlink `path` (gone already is fine) and fsync its folder, so the removal survives a
    crash: a file that reappears after one could name data that no longer counts."""
    final = Path(path)
    try:
        os.unlink(final)
    except FileNotFoundError:
        return
    fsync_dir(final.parent)
