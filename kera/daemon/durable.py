"""Durable small files: write a temporary name, fsync, rename over the old one, fsync the folder;
remove files and fsync the folder.

A reader after a crash sees either the old content or the new, never a mix: the rule every
metadata file in kera follows (coordinator state, backup replica records, broker segment
records and markers). A removal is durable only once its directory is synced: without that, a
crash can bring a deleted file (or a deleted commit record) back. Small text files that carry
no checksum of their own (markers) get one here (`write_checked` / `read_checked`).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

_CHECK_PREFIX = "crc32 "


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


def unlink_durable(*paths: str | os.PathLike) -> int:
    """Remove files (missing ones are skipped), then fsync each directory that lost one, so the
    removals survive a crash; returns how many were removed. Raises OSError."""
    directories: dict[Path, None] = {}
    removed = 0
    for path in paths:
        path = Path(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        directories[path.parent] = None
        removed += 1
    for directory in directories:
        fsync_dir(directory)
    return removed


def write_checked(path: str | os.PathLike, text: str) -> None:
    """Atomically write a one-line text file followed by its CRC-32 line."""
    assert "\n" not in text, "a checked file holds one line"
    crc = zlib.crc32(text.encode())
    write_atomic(path, f"{text}\n{_CHECK_PREFIX}{crc:08x}\n".encode())


def read_checked(path: str | os.PathLike) -> str | None:
    """The line `write_checked` wrote, or None when the file is damaged (torn, edited, bit rot).
    Raises OSError (FileNotFoundError when absent)."""
    with open(path, "rb") as f:
        data = f.read(4096)
    try:
        text, check, rest = data.decode().split("\n")
    except (UnicodeDecodeError, ValueError):
        return None
    if rest or not check.startswith(_CHECK_PREFIX):
        return None
    if check[len(_CHECK_PREFIX):] != f"{zlib.crc32(text.encode()):08x}":
        return None
    return text
