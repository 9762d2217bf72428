"""Splitting and verifying the chunk frames of a write, before any of it is stored.

A payload frame holds one chunk (the broker sends each chunk as its own frame) or several whole
chunks back to back; a frame that ends inside a chunk, or carries bytes after its last chunk, is
refused. Every chunk is verified (header sanity and both checksums) before the caller stores
anything, so a write is all or nothing. The chunks come back as zero-copy memoryview slices of
the frames: the store keeps the received buffers instead of copying them.
"""

from __future__ import annotations

from kera.codec import chunk
from kera.errors import CorruptChunk


def as_view(buf) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def split_chunks(frames) -> list[memoryview]:
    """The verified chunks of `frames`, in order; raises CorruptChunk naming the first bad one."""
    chunks: list[memoryview] = []
    for index, frame in enumerate(frames):
        view = as_view(frame)
        if not len(view):
            raise CorruptChunk(f"frame {index} is empty")
        at = 0
        while at < len(view):
            try:
                end = chunk.verified_end(view, at)
            except CorruptChunk as err:
                raise CorruptChunk(f"frame {index}, byte {at}: {err.message}") from None
            chunks.append(view[at:end])
            at = end
    return chunks
