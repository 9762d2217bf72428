"""Bounds on what one connection, or one source, holds in a daemon before it has read
anything: a peer that sends more than one message's worth without completing a message is cut
off, and a source's connections that send nothing are capped.

libzmq hands a multipart message to the daemon only once all of its frames have arrived, and
buffers every frame until then; ZMQ_MAXMSGSIZE bounds each frame, not the message, so a
header followed by any number of frames under that limit was kept whole (24 x 64 MiB frames
raised a daemon's resident memory by 1.5 GiB; issue 37 item 3). Nothing in libzmq bounds a
message's frames, so this module watches each accepted connection from outside: the kernel
counts the bytes a TCP connection has received (TCP_INFO's tcpi_bytes_received); the daemon
knows which connection each message it reads came from (the frame's ZMQ_SRCFD). A connection
that has received more than `unread_bytes_max` since the daemon last read a message from it,
at a moment the daemon has read every whole message waiting, is holding (at most) one
incomplete message that large: its TCP connection is shut down, libzmq drops the connection
and frees what it buffered, and the peer may connect again.

A source address may hold SILENT_PER_SOURCE_MAX connections that have sent no message for
SILENT_GRACE_S (mostly unfinished CURVE handshakes, issue 37 item 9); beyond that its newest
are closed the same way.

The byte bound is per connection, in bytes on the wire: what one connection can make a daemon hold
is `unread_bytes_max` plus what arrives between two checks (CHECK_INTERVAL_S at the link's
rate). Linux only (TCP_INFO layout); elsewhere nothing is watched and a warning says so.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from kera.daemon.repeat_log import RepeatedWarnings

log = logging.getLogger(__name__)

# How often connections are checked (at most; a check also waits for the daemon to have read
# every whole message waiting). Between two checks a hostile connection adds what the link
# carries in this time: ~50 MiB at 10 Gbit/s, ~100 MiB on this VM's loopback.
CHECK_INTERVAL_S = 0.02
# Slack over the daemon's message limit before a connection is cut: a legitimate connection's
# unread bytes are one message in progress (ZMTP/CURVE framing adds ~45 bytes per frame, 0.4
# MiB at wire.MAX_FRAMES frames) plus the bytes that arrived between the daemon's last read
# and the check (microseconds apart): far below this.
UNREAD_SLACK_BYTES = 16 * 1024 * 1024
# struct tcp_info (linux/tcp.h): tcpi_bytes_received is the u64 at this offset (Linux >= 4.1).
_TCP_INFO_BYTES = 136
_BYTES_RECEIVED_OFFSET = 128
# Cost of checking one connection (a getsockopt, ~0.9 us here) and the share of the loop's
# time checks may take: beyond CHECK_INTERVAL_S x CHECK_CPU_SHARE / CHECK_COST_S connections
# (200 with these) the interval grows with their number (100 ms at 1000 connections).
CHECK_COST_S = 1e-6
CHECK_CPU_SHARE = 0.01
# Connections one source address may hold that have sent no message for SILENT_GRACE_S
# (their CURVE handshake unfinished, or finished and idle): beyond this the newest are closed.
# Without it one host could hold a descriptor per connection it opens for the handshake
# interval (kera.net.server.CURVE_HANDSHAKE_MS), thousands a second. Clients send their first
# request as soon as they are connected (milliseconds), so the grace spares connection bursts
# (a pool of clients starting on one host), and the cap a host of many idle clients.
SILENT_PER_SOURCE_MAX = 128
SILENT_GRACE_S = 1.0
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class _Conn:
    __slots__ = ("sock", "peer", "read_at_bytes", "read", "silent_since")

    def __init__(self, sock: socket.socket, received: int, now: float):
        # A duplicate of libzmq's descriptor: the same TCP connection whatever number libzmq's
        # descriptor is given later; closed when libzmq reports the connection gone (until
        # then the connection's end waits for it: at most a loop turn).
        self.sock = sock
        self.peer = sock.getpeername()
        self.read_at_bytes = received   # bytes received when the daemon last read a message
        self.read = False               # a message was read from it since the last check
        self.silent_since: float | None = now   # accepted, no message read from it yet


class InflowWatch:
    """Watches the connections accepted by `router` (a ROUTER socket, before it binds)."""

    def __init__(self, router: zmq.Socket, name: str, unread_bytes_max: int):
        self.name = name
        self.unread_bytes_max = unread_bytes_max
        self.conns: dict[int, _Conn] = {}   # by libzmq's descriptor (a message's ZMQ_SRCFD)
        self.cut_total = 0
        self.silent_closed_total = 0
        # A line per source and kind once a minute, with a count, however often it recurs.
        self._warnings = RepeatedWarnings()
        self._next_check = 0.0
        self._port = None   # the router's port, once bound: accepted connections have it
        self._router = router
        self.monitor: zmq.Socket | None = None
        if not sys.platform.startswith("linux"):
            log.warning("%s: unread bytes per connection are not watched on %s: a peer can make "
                        "this daemon buffer a message of any size", name, sys.platform)
            return
        address = f"inproc://inflow-{id(self)}"
        router.monitor(address, _EVENTS)
        self.monitor = router.context.socket(zmq.PAIR)
        # Unbounded: libzmq's I/O thread blocks on a full monitor queue, so events must never
        # wait for this daemon's loop (two per connection; the loop reads them every turn).
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.connect(address)

    def bound(self, port: int) -> None:
        self._port = port

    def on_events(self) -> None:
        """Take the monitor's connection events (accepted, disconnected) waiting."""
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._forget(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(event["value"])

    def _accepted(self, fd: int) -> None:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return   # already closed: its disconnect event follows
        try:
            if sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == self._port:
                self.conns[fd] = _Conn(sock, _bytes_received(sock), time.monotonic())
                return
        except OSError:
            pass
        sock.close()   # the number was given to another descriptor before this event was read

    def _forget(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        if conn is not None:
            conn.sock.close()

    def read_from(self, frame: zmq.Frame) -> None:
        """The daemon read a whole message, `frame` one of its frames."""
        conn = self.conns.get(frame.get(zmq.SRCFD))
        if conn is not None:
            conn.read = True
            conn.silent_since = None

    def check(self, now: float) -> None:
        """Call when every whole message waiting has been read: cut the connections holding
        more than unread_bytes_max of a message not yet whole."""
        if now < self._next_check:
            return
        # Each connection costs ~1 us a check: with many, checks are spaced so that they take
        # at most CHECK_CPU_SHARE of the loop (a longer interval lets more through first).
        self._next_check = now + max(CHECK_INTERVAL_S,
                                     len(self.conns) * CHECK_COST_S / CHECK_CPU_SHARE)
        silent: dict[str, list[int]] = {}   # source address -> its silent connections
        for fd, conn in list(self.conns.items()):
            try:
                received = _bytes_received(conn.sock)
            except OSError:
                self._forget(fd)
                continue
            if conn.read:
                conn.read, conn.read_at_bytes = False, received
            elif received - conn.read_at_bytes > self.unread_bytes_max:
                self._cut(fd, conn, received - conn.read_at_bytes)
            elif conn.silent_since is not None and now - conn.silent_since > SILENT_GRACE_S:
                silent.setdefault(conn.peer[0], []).append(fd)
        for source, fds in silent.items():
            if len(fds) > SILENT_PER_SOURCE_MAX:
                self._close_silent(source, fds)

    def _close_silent(self, source: str, fds: list[int]) -> None:
        """Close the newest of `source`'s silent connections beyond SILENT_PER_SOURCE_MAX."""
        fds.sort(key=lambda fd: self.conns[fd].silent_since)
        excess = fds[SILENT_PER_SOURCE_MAX:]
        self.silent_closed_total += len(excess)
        dropped = self._warnings.admit(("silent", source), time.monotonic())
        if dropped is not None:
            log.warning("%s: closed %d connections from %s that sent nothing for %.0f s (more "
                        "than %d)%s", self.name, len(excess), source, SILENT_GRACE_S,
                        SILENT_PER_SOURCE_MAX, self._warnings.note(dropped))
        for fd in excess:
            _shutdown(self.conns[fd].sock)
            self._forget(fd)

    def _cut(self, fd: int, conn: _Conn, unread: int) -> None:
        self.cut_total += 1
        dropped = self._warnings.admit(("cut", conn.peer[0]), time.monotonic())
        if dropped is not None:
            log.warning("%s: cut off %s: %d bytes received without completing a message "
                        "(limit %d)%s", self.name, conn.peer, unread, self.unread_bytes_max,
                        self._warnings.note(dropped))
        _shutdown(conn.sock)
        self._forget(fd)

    def close(self) -> None:
        """Call before the router closes: libzmq sends monitor events blocking, from its I/O
        thread, so an event (a disconnect while the router closes) sent after this end closed
        would stop every socket of the context."""
        if self.monitor is not None:
            self._router.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        for fd in list(self.conns):
            self._forget(fd)


def _shutdown(sock: socket.socket) -> None:
    """End the TCP connection under libzmq: it sees the end, drops the connection and frees
    what it buffered of it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass   # already ended


def _bytes_received(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    if len(info) < _BYTES_RECEIVED_OFFSET + 8:
        raise OSError("TCP_INFO without tcpi_bytes_received (Linux before 4.1)")
    return struct.unpack_from("=Q", info, _BYTES_RECEIVED_OFFSET)[0]
