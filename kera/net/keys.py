"""CURVE key files and the keys directory: who a public key belongs to, and in which role.

A keys directory (`kera keys create`, `kera local --secure`) holds:

    DIR/cluster.key_secret          the key pair every daemon's listening socket presents
    DIR/cluster.key                 its public half, which clients pin
    DIR/public/ROLE/NAME.key        one principal's public key: the principal is NAME, its
                                    role the folder (broker, backup, coordinator, admin, client)
    DIR/NAME.key_secret             that principal's key pair (mode 0600), to hand to it alone

The files are ZeroMQ certificates written by pyzmq's `zmq.auth`; a principal's secret file also
names its principal, role and the cluster's public key in its metadata, so one file is all a
client needs (`key_file=`, `--key-file`, `$KERA_KEY_FILE`).

One server key pair for the whole cluster (rather than one per daemon) keeps clients simple:
they pin one key whatever broker the metadata sends them to, as with one CA. Each daemon still
authenticates as its own principal when it calls another, which is what authorization needs;
the cost is that a stolen daemon secret could also impersonate the listening side.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from kera.errors import BadRequest

ROLES = ("broker", "backup", "coordinator", "admin", "client")
MEMBER_ROLES = frozenset({"broker", "backup", "coordinator"})   # daemons of the cluster
KEY_FILE_ENV = "KERA_KEY_FILE"
CLUSTER_KEY = "cluster"
SECRET_SUFFIX = ".key_secret"
PUBLIC_DIR = "public"
# Principal names become file names and log fields: short, and no path separators.
NAME_CHARS_MAX = 64
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.@")
# Public keys read from one keys directory: it is read whole into memory on every change.
PRINCIPALS_MAX = 100_000


class KeyFileError(BadRequest):
    """A key file or keys directory is missing, malformed or not private enough."""
    code = "key_file_error"


@dataclass(frozen=True)
class KeyPair:
    """A principal's CURVE key pair (z85 bytes) and what its file says about it."""
    name: str
    role: str
    public: bytes
    secret: bytes
    server_key: bytes | None = None   # the cluster's public key, which this client pins


@dataclass(frozen=True)
class Principal:
    """Who is calling, as the keys directory says: NAME in ROLE."""
    name: str
    role: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


def check_name(name: str) -> str:
    if not name or len(name) > NAME_CHARS_MAX or not set(name) <= NAME_CHARS or name[0] == ".":
        raise KeyFileError(f"principal name {name!r} must be 1-{NAME_CHARS_MAX} characters of "
                           "letters, digits, '-', '_', '.', '@' (not starting with '.')")
    return name


def check_principal(name: str) -> str:
    """check_name for a principal named in a request (an ACL, a quota): bad_request, since no
    key file is involved."""
    try:
        return check_name(name)
    except KeyFileError as err:
        raise BadRequest(err.message) from None


def check_role(role: str) -> str:
    if role not in ROLES:
        raise KeyFileError(f"role {role!r} is not one of {', '.join(ROLES)}")
    return role


# ---------------------------------------------------------------------- writing
def create_cluster_key(keys_dir: Path) -> Path:
    """The cluster's server key pair, created once: its secret file's path."""
    keys_dir = _private_dir(keys_dir)
    secret = keys_dir / (CLUSTER_KEY + SECRET_SUFFIX)
    if not secret.exists():
        _write_pair(keys_dir, CLUSTER_KEY, {"role": "cluster"}, keys_dir / f"{CLUSTER_KEY}.key")
    return secret


def create_key(keys_dir: Path, name: str, role: str) -> Path:
    """A new principal: its secret file DIR/NAME.key_secret (0600) and its public key in
    DIR/public/ROLE/. Refuses a name already in use, whatever its role."""
    check_name(name)
    check_role(role)
    keys_dir = Path(keys_dir)
    create_cluster_key(keys_dir)
    if name == CLUSTER_KEY or (keys_dir / (name + SECRET_SUFFIX)).exists() or \
            any((keys_dir / PUBLIC_DIR / r / f"{name}.key").exists() for r in ROLES):
        raise KeyFileError(f"a key named {name!r} already exists in {keys_dir}; pick another "
                           "name or remove the old key's files first")
    server_key = zmq.auth.load_certificate(keys_dir / f"{CLUSTER_KEY}.key")[0]
    public_dir = keys_dir / PUBLIC_DIR / role
    public_dir.mkdir(parents=True, exist_ok=True)
    meta = {"name": name, "role": role, "server-key": server_key.decode()}
    _write_pair(keys_dir, name, meta, public_dir / f"{name}.key")
    return keys_dir / (name + SECRET_SUFFIX)


def _write_pair(keys_dir: Path, name: str, metadata: dict, public_path: Path) -> None:
    """Generate with zmq.auth into a private scratch folder, then move into place: the secret
    is never readable by others, not even between its write and a chmod."""
    scratch = tempfile.mkdtemp(dir=keys_dir, prefix=".new-")
    try:
        quoted = {k: f'"{v}"' for k, v in metadata.items()}
        public, secret = zmq.auth.create_certificates(scratch, name, metadata=quoted)
        os.chmod(secret, 0o600)
        os.replace(public, public_path)
        os.replace(secret, keys_dir / (name + SECRET_SUFFIX))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _private_dir(path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


# ---------------------------------------------------------------------- reading
def load_key_file(path: str | os.PathLike) -> KeyPair:
    """A principal's secret key file; refused if others may read it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"key file {path} is readable by others (mode {stat.S_IMODE(mode):04o});"
                           f" a secret key must be private: chmod 600 {path}")
    return _load_pair(path)


@functools.lru_cache(maxsize=64)
def _load_pair(path: Path) -> KeyPair:
    try:
        public, secret = zmq.auth.load_certificate(path)
        meta = _metadata(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path} is not a kera key file: {exc}") from None
    if secret is None:
        raise KeyFileError(f"{path} holds only a public key; pass the .key_secret file")
    server = meta.get("server-key")
    return KeyPair(meta.get("name", path.name.split(".")[0]), meta.get("role", ""), public,
                   secret, server.encode() if server else None)


def _metadata(path: Path) -> dict[str, str]:
    """The `metadata` section of a ZeroMQ certificate (zmq.auth reads only the keys)."""
    out: dict[str, str] = {}
    section = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.rstrip()
        if not line or line.lstrip().startswith("#"):   # z85 keys may hold '#': whole lines only
            continue
        if not raw[0].isspace():
            section = line.strip()
        elif section == "metadata" and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("'\"")
    return out


def client_keys(key_file: str | os.PathLike | None = None) -> KeyPair | None:
    """The key pair a client connects with: `key_file`, else $KERA_KEY_FILE, else None
    (plaintext). A file without the cluster's key cannot be used by a client."""
    path = key_file or os.environ.get(KEY_FILE_ENV) or None
    if path is None:
        return None
    keys = load_key_file(path)
    if keys.server_key is None:
        raise KeyFileError(f"key file {path} does not name the cluster's server key; create it "
                           "with `kera keys create`")
    return keys


def server_key_pair(keys_dir: str | os.PathLike) -> KeyPair:
    return load_key_file(Path(keys_dir) / (CLUSTER_KEY + SECRET_SUFFIX))


def load_principals(keys_dir: str | os.PathLike) -> dict[bytes, Principal]:
    """z85 public key -> Principal, from DIR/public/ROLE/NAME.key."""
    out: dict[bytes, Principal] = {}
    root = Path(keys_dir) / PUBLIC_DIR
    if not root.is_dir():
        raise KeyFileError(f"{keys_dir} has no {PUBLIC_DIR}/ folder of public keys; create keys "
                           "with `kera keys create NAME --role ROLE --dir DIR`")
    for role in ROLES:
        for path in sorted((root / role).glob("*.key")):
            if len(out) >= PRINCIPALS_MAX:
                raise KeyFileError(f"more than {PRINCIPALS_MAX} public keys under {root}")
            public, _ = zmq.auth.load_certificate(path)
            out[public] = Principal(path.name[:-len(".key")], role)
    return out


# ---------------------------------------------------------------------- sockets
def secure_client(sock: zmq.Socket, keys: KeyPair, server_key: bytes | None = None) -> None:
    """Make `sock` a CURVE client authenticating as `keys`, trusting only `server_key`."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key or keys.server_key


def secure_server(sock: zmq.Socket, server: KeyPair) -> None:
    sock.zap_domain = b"kera"
    sock.curve_secretkey = server.secret
    sock.curve_publickey = server.public
    sock.curve_server = True
