"""Packing whole chunks into fewer frames: what every sender of chunks does before zmq.

The protocol lets a payload frame hold several whole chunks back to back (receivers cut them by
their headers' sizes, kera.codec.chunk.frame_chunks), and it matters: each frame costs a Python-level
send, a Frame on the receiving side and zmq's own per-part work, 10-15 us together on this
machine, more than copying a 4 KiB chunk. Pieces shorter than PACK_RUN_BYTES_MAX are therefore
joined, in order, into one new frame (one copy, which zmq made anyway below its zero-copy
threshold, and which up to that bound cost the whole system less than frames of their own),
while long ones stay as they are and leave zero-copy. Used by replication writes (broker ->
backups), produce requests (producer -> broker) and fetch replies (broker -> consumer).
"""

from __future__ import annotations

# Pieces shorter than this are packed with their neighbours. Below the zero-copy threshold of
# our sockets (kera.net.server.ZERO_COPY_MIN_BYTES) zmq copies them anyway: non-adjacent 4 KB
# chunks, 16 per write, 8.9 us per chunk sent as frames, 5.3 us packed
# (bench/test_send_frames.py). Between that and this size, a copy costs a sender about what
# the frame would (64000-byte chunks there: 21-25 us per chunk either way, two runs), but
# each frame left zero-copy also wakes zmq's I/O threads and pyzmq's collector thread in a
# busy daemon. Raised from 32 KiB to 128 KiB: the throughput preset at R=3 with 64 KiB chunks
# (one frame per chunk in replication writes, produce requests and fetch replies) went 1.15x
# records/s with 0.91x the CPU (rounds 1.12-1.17x; 16 KiB chunks 1.06x, 4 KiB 1.01x), the
# broker's zmq I/O thread from 8.1k to 2.6k context switches a second and its collector
# thread from 5.2k to 1.7k.
PACK_RUN_BYTES_MAX = 128 * 1024
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
