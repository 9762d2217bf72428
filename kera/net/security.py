"""A daemon's side of CURVE: its keys, the ZAP handler that authenticates callers, and who they are.

pyzmq's `zmq.auth.Authenticator` answers ZeroMQ's ZAP requests; here it is driven by the daemon's
own loop (its socket registered with the shell's poller) instead of a thread, so a lookup never
races a reload. The handler accepts a client whose public key is in the keys directory
(kera.net.keys) and sets the connection's ZMTP `User-Id` to `ROLE:NAME:KEY`; the shell reads it from
every request it receives (`principal_of`). The directory is looked at again at most once per
KEYRING_RELOAD_INTERVAL_S, so `kera keys create` (or deleting a public key, to revoke it)
applies to new connections without a restart.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from kera.net import keys as keyfiles
from kera.daemon.repeat_log import RepeatedWarnings
from kera.net.keys import KeyPair, Principal

log = logging.getLogger(__name__)

ZAP_DOMAIN = "kera"
# How stale the daemon's view of the keys directory may be: a new or revoked key takes effect
# for connections made this long after the change, and a flood of unknown keys costs at most
# one directory scan per interval.
KEYRING_RELOAD_INTERVAL_S = 1.0
# ZAP requests answered per loop turn: each is one dict lookup; the cap keeps a connection
# storm from starving the requests of connected clients.
ZAP_BATCH_MAX = 256


class Keyring:
    """The keys directory's public keys, reloaded when a key file or folder changes (a key
    deleted, added or overwritten in place), looked at most every KEYRING_RELOAD_INTERVAL_S."""

    def __init__(self, keys_dir: str | os.PathLike, clock=time.monotonic):
        self.keys_dir = Path(keys_dir)
        self.clock = clock
        self._stamp: tuple = ()
        self._checked_s = float("-inf")
        self.principals: dict[bytes, Principal] = {}
        self.reload()

    def lookup(self, z85_key: bytes) -> Principal | None:
        self._refresh()
        return self.principals.get(z85_key)

    def holds(self, z85_key: bytes, principal: Principal) -> bool:
        """Whether `z85_key` is still `principal`'s key here: checked on every request, so a
        key deleted or overwritten stops being served on connections it opened before
        (revocation is immediate)."""
        return self.lookup(z85_key) == principal

    def _refresh(self) -> None:
        now = self.clock()
        if now - self._checked_s >= KEYRING_RELOAD_INTERVAL_S:
            self._checked_s = now
            if self._dir_stamp() != self._stamp:
                self.reload()

    def reload(self) -> None:
        stamp = self._dir_stamp()
        self.principals = keyfiles.load_principals(self.keys_dir)
        self._stamp = stamp
        log.info("keys directory %s: %d principals", self.keys_dir, len(self.principals))
        for folder in self._writable_by_others():
            log.warning("SECURITY: %s is writable by other users: whoever can write there can "
                        "add a key and be trusted with its role; chmod go-w it", folder)

    def _writable_by_others(self) -> list[Path]:
        """The keys directory and public-key folders that group or others may write."""
        root = self.keys_dir / keyfiles.PUBLIC_DIR
        out = []
        for folder in (self.keys_dir, root, *(root / role for role in keyfiles.ROLES)):
            try:
                if folder.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    out.append(folder)
            except OSError:
                continue   # a role folder that does not exist holds no key
        return out

    def _dir_stamp(self) -> tuple:
        root = self.keys_dir / keyfiles.PUBLIC_DIR
        out = []
        for role in keyfiles.ROLES:
            try:
                with os.scandir(root / role) as entries:
                    files = sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size, e.inode())
                                   for e in entries)
                out.append((role, tuple(files)))
            except OSError:
                out.append((role, None))
        return tuple(out)


class ZapHandler(zmq.auth.Authenticator):
    """pyzmq's ZAP handler with principals from a Keyring, run from the daemon's loop."""

    def __init__(self, ctx: zmq.Context, keyring: Keyring):
        super().__init__(ctx, log=log)
        self.keyring = keyring
        self.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        self.refused = 0
        # One line a minute however fast unknown keys knock (each new key would otherwise
        # write a line: gigabytes a day from one client looping on a wrong key).
        self._refusals = RepeatedWarnings()

    def callback(self, domain: str, z85_key: bytes) -> bool:
        known = self.keyring.lookup(z85_key) is not None
        if not known:
            self.refused += 1
            dropped = self._refusals.admit("unknown key", time.monotonic())
            if dropped is not None:
                more = f" ({dropped} more refusals since the last line)" if dropped else ""
                log.warning("refused a connection: public key %s is not in %s%s",
                            z85_key.decode(), self.keyring.keys_dir, more)
        return known

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        principal = self.keyring.lookup(key)
        # callback() has just found it; the key rides along so each request can be checked
        # against the current keyring (kera.net.server: revocation)
        return f"{principal.role}:{principal.name}:{key.decode()}"

    def on_readable(self) -> None:
        for _ in range(ZAP_BATCH_MAX):
            try:
                msg = self.zap_socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            _run_to_end(self.handle_zap_message(msg))


def _run_to_end(coroutine) -> None:
    """pyzmq's handler is a coroutine so an async credentials provider can be awaited; ours
    answers at once, so it finishes on its first step without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("the ZAP handler waited on something: the credentials provider must "
                       "answer at once")


def principal_of(frame: zmq.Frame) -> Principal | None:
    """Who sent `frame`, from the User-Id the ZAP handler gave its connection."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    role, _, name = _split_user(user or "")[0].partition(":")
    return Principal(name, role) if name else None


def key_of(frame: zmq.Frame) -> bytes | None:
    """The z85 public key that authenticated `frame`'s connection (from its User-Id)."""
    try:
        user = frame.get("User-Id") or ""
    except zmq.ZMQError:
        return None
    return _split_user(user)[1]


# A CURVE public key in z85: 32 bytes as 40 characters (':' among them, so it is cut by length).
Z85_KEY_CHARS = 40


def _split_user(user: str) -> tuple[str, bytes | None]:
    """("ROLE:NAME", key) of a User-Id "ROLE:NAME:KEY"."""
    if len(user) > Z85_KEY_CHARS and user[-Z85_KEY_CHARS - 1] == ":":
        return user[:-Z85_KEY_CHARS - 1], user[-Z85_KEY_CHARS:].encode()
    return user, None


@dataclass(frozen=True)
class Security:
    """What a secure daemon holds: the cluster's server pair, its own identity, the keyring."""
    server: KeyPair
    identity: KeyPair
    keys_dir: Path

    def keyring(self) -> Keyring:
        return Keyring(self.keys_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (CURVE; see docs/SECURITY.md)")
    group.add_argument("--keys-dir", type=Path, default=None, metavar="DIR",
                       help="keys directory (kera keys create): serve CURVE-encrypted and "
                            "authenticated; only keys under DIR/public may connect")
    group.add_argument("--key-file", type=Path, default=None, metavar="FILE",
                       help="this daemon's own key (DIR/NAME.key_secret), used when it calls "
                            "other daemons; its role must be the daemon's kind")
    group.add_argument("--insecure", action="store_true",
                       help="serve a routable --host without keys: anyone who reaches it may "
                            "read and delete every stream (refused unless given, as Redis's "
                            "protected mode; loopback needs no keys)")


def from_args(args: argparse.Namespace, kind: str) -> Security | None:
    """The daemon's Security from its flags, or None for plaintext."""
    if args.keys_dir is None:
        if args.key_file is not None:
            raise keyfiles.KeyFileError("--key-file needs --keys-dir (the cluster's keys)")
        host = getattr(args, "host", "127.0.0.1")
        if not is_loopback(host) and not getattr(args, "insecure", False):
            raise keyfiles.KeyFileError(
                f"the {kind} would serve {host} without authentication or encryption: anyone "
                f"who reaches it could read and delete every stream. Give it keys (--keys-dir, "
                f"--key-file: kera keys create), bind 127.0.0.1, or pass --insecure")
        return None   # the shell still warns when it binds beyond loopback
    if args.key_file is None:
        raise keyfiles.KeyFileError(f"--keys-dir needs --key-file: the {kind}'s own key "
                                    f"(kera keys create NAME --role {kind} --dir {args.keys_dir})")
    identity = keyfiles.load_key_file(args.key_file)
    if identity.role != kind:
        raise keyfiles.KeyFileError(f"{args.key_file} is a {identity.role or 'role-less'} key; "
                                    f"a {kind} needs a key created with --role {kind}")
    return Security(keyfiles.server_key_pair(args.keys_dir), identity, Path(args.keys_dir))


def warn_if_open(kind: str, host: str) -> None:
    if not is_loopback(host):
        log.warning("SECURITY: this %s binds %s WITHOUT authentication or encryption: anyone "
                    "who can reach it can read and delete every stream. Start it with "
                    "--keys-dir and --key-file (kera keys create) on any shared network.",
                    kind, host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a host name, or a wildcard such as "*" or "0.0.0.0"
