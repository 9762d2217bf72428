"""Packing whole chunks into fewer frames: what every sender of chunks does before zmq.

The protocol lets a payload frame hold several whole chunks back to back (receivers cut them by
their headers' sizes, kera.chunk.frame_chunks), and it matters: each frame costs a Python-level
send, a Frame on the receiving side and zmq's own per-part work, 10-15 us together on this
machine, more than copying a 4 KiB chunk. Short pieces are therefore joined, in order, into one
new frame (one copy, which zmq made anyway below its zero-copy threshold), while long ones stay
as they are and leave zero-copy. Used by replication writes (broker -> backups), produce
requests (producer -> broker) and fetch replies (broker -> consumer).
"""

from __future__ import annotations

# Pieces shorter than this are packed with their neighbours: the same figure as the zero-copy
# threshold of our sockets (kera.server.ZERO_COPY_MIN_BYTES), below which zmq copies anyway.
# Non-adjacent 4 KB chunks, 16 per write: 8.9 us per chunk sent as frames, 5.3 us packed
# (bench/test_send_frames.py).
PACK_RUN_BYTES_MAX = 32 * 1024
# A packed frame is cut at this size: bounds the copy a message holds while it is in flight.
PACKED_FRAME_BYTES_MAX = 1024 * 1024


def pack(pieces: list) -> list:
    """`pieces` (each one or more whole chunks) in order: each of PACK_RUN_BYTES_MAX or more
    as it is, consecutive shorter ones joined into frames of at most PACKED_FRAME_BYTES_MAX
    (a lone short piece is not copied)."""
    frames: list = []
    short: list = []
    short_bytes = 0
    for piece in pieces:
        size = len(piece)
        if size >= PACK_RUN_BYTES_MAX or short_bytes + size > PACKED_FRAME_BYTES_MAX:
            _put_short(frames, short)
            short, short_bytes = [], 0
        if size >= PACK_RUN_BYTES_MAX:
            frames.append(piece)
        else:
            short.append(piece)
            short_bytes += size
    _put_short(frames, short)
    return frames


def _put_short(frames: list, short: list) -> None:
    if len(short) == 1:
        frames.append(short[0])     # a lone piece: a copy would gain nothing
    elif short:
        frames.append(b"".join(short))
