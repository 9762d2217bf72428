"""Kafka clients' SASL users: the file in the keys directory that holds their credentials, and
the broker's view of it, reloaded when it changes.

`DIR/kafka/users` (mode 0600), one user a line, written by `kera keys kafka-user`:

    NAME ROLE SCRAM-SHA-256 ITERATIONS SALT STORED_KEY SERVER_KEY     (the last three base64)

A user is the kera principal ROLE:NAME (ROLE `client`, or `admin` for a super user), so
`kera acl` and `kera quota` rules name it as they name a CURVE key's principal. Only SCRAM's
salted, hashed form is stored (kera.net.scram). Brokers look at the file again at most once
per USERS_RELOAD_INTERVAL_S, and check each request's user against it, so a user removed
(or whose password changed) is refused on its next request, on connections it opened before.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kera.net.keys import KeyFileError, check_name
from kera.net.scram import ITERATIONS_MAX, ITERATIONS_MIN, SCRAM_SHA_256, Credential, derive

log = logging.getLogger(__name__)

KAFKA_DIR = "kafka"            # under the keys directory: users, CA, broker certificates
USERS_FILE = "users"
ROLES = ("client", "admin")
# How stale a broker's view of the users file may be (as kera.net.security's keyring).
USERS_RELOAD_INTERVAL_S = 1.0
USERS_MAX = 100_000            # the file is read whole into memory on every change
FIELDS = 7


@dataclass(frozen=True)
class User:
    name: str
    role: str
    credential: Credential


def users_path(keys_dir: str | os.PathLike) -> Path:
    return Path(keys_dir) / KAFKA_DIR / USERS_FILE


def parse(text: str, where: str = USERS_FILE) -> dict[str, User]:
    """The users of a users file's text; KeyFileError naming the line of any malformed one."""
    users: dict[str, User] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            user = _parse_line(line)
        except (ValueError, binascii.Error, KeyFileError) as exc:
            raise KeyFileError(f"{where} line {number}: {exc}; rewrite it with "
                               f"`kera keys kafka-user NAME`") from None
        if len(users) >= USERS_MAX:
            raise KeyFileError(f"{where}: more than {USERS_MAX} users")
        users[user.name] = user
    return users


def _parse_line(line: str) -> User:
    fields = line.split()
    if len(fields) != FIELDS:
        raise ValueError(f"expected {FIELDS} fields: NAME ROLE {SCRAM_SHA_256} ITERATIONS SALT "
                         f"STORED_KEY SERVER_KEY")
    name, role, mechanism, iterations, salt, stored, server = fields
    check_name(name)
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if mechanism != SCRAM_SHA_256:
        raise ValueError(f"mechanism {mechanism!r} is not {SCRAM_SHA_256}")
    rounds = int(iterations)
    if not ITERATIONS_MIN <= rounds <= ITERATIONS_MAX:
        raise ValueError(f"iterations {rounds} outside {ITERATIONS_MIN}-{ITERATIONS_MAX}")
    salt_b, stored_b, server_b = (base64.b64decode(v, validate=True)
                                  for v in (salt, stored, server))
    cred = Credential(salt_b, rounds, stored_b, server_b)
    if len(cred.stored_key) != 32 or len(cred.server_key) != 32:
        raise ValueError("stored and server keys must be 32 bytes (SHA-256)")
    return User(name, role, cred)


def format_users(users: dict[str, User]) -> str:
    lines = ["# kera Kafka SASL users: NAME ROLE MECHANISM ITERATIONS SALT STORED_KEY "
             "SERVER_KEY (kera keys kafka-user)"]
    for u in sorted(users.values(), key=lambda u: u.name):
        c = u.credential
        b64 = [base64.b64encode(v).decode() for v in (c.salt, c.stored_key, c.server_key)]
        lines.append(" ".join([u.name, u.role, SCRAM_SHA_256, str(c.iterations), *b64]))
    return "\n".join(lines) + "\n"


def load(keys_dir: str | os.PathLike) -> dict[str, User]:
    """The users of a keys directory (none when it has no users file)."""
    path = users_path(keys_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise KeyFileError(f"cannot read {path}: {exc.strerror}") from None
    return parse(text, str(path))


def set_user(keys_dir: str | os.PathLike, name: str, password: str | None,
             role: str = "client") -> None:
    """Add or replace user `name` (its password `password`); None removes it."""
    check_name(name)
    if role not in ROLES:
        raise KeyFileError(f"a Kafka user's role is one of {', '.join(ROLES)}, not {role!r}")
    users = load(keys_dir)
    if password is None:
        if users.pop(name, None) is None:
            raise KeyFileError(f"no Kafka user {name!r} in {users_path(keys_dir)}")
    else:
        users[name] = User(name, role, derive(password))
    _write_private(users_path(keys_dir), format_users(users))


def _write_private(path: Path, text: str) -> None:
    """Write to a private temporary name, fsync, rename: never half a file, never readable
    by others."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".users-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Users:
    """A broker's view of the users file, reloaded when the file changes (looked at most
    every USERS_RELOAD_INTERVAL_S). A file that stops parsing keeps the last good view, with
    a warning, rather than letting everyone in or locking everyone out."""

    def __init__(self, keys_dir: str | os.PathLike, clock=time.monotonic):
        self.path = users_path(keys_dir)
        self.keys_dir = Path(keys_dir)
        self.clock = clock
        self._stamp: tuple | None = None
        self._checked_s = float("-inf")
        self.users: dict[str, User] = {}
        self._refresh()

    def lookup(self, name: str) -> User | None:
        self._refresh()
        return self.users.get(name)

    def credential(self, name: str) -> Credential | None:
        user = self.lookup(name)
        return None if user is None else user.credential

    def holds(self, user: User) -> bool:
        """Whether `user` (as it authenticated) is still in the file, with that password."""
        return self.lookup(user.name) == user

    def _refresh(self) -> None:
        now = self.clock()
        if now - self._checked_s < USERS_RELOAD_INTERVAL_S:
            return
        self._checked_s = now
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return
        try:
            self.users = load(self.keys_dir)
        except KeyFileError as exc:
            log.warning("Kafka users file not reloaded, keeping %d users: %s", len(self.users),
                        exc.message)
        self._stamp = stamp
        log.info("Kafka users file %s: %d users", self.path, len(self.users))
