"""How a coordinator reaches and logs in to etcd: the `--metadata` URL and the `--etcd-*` flags.

    --metadata etcds://HOST:PORT[,...]   TLS to every member (etcd:// is plaintext)
    --etcd-ca FILE                       the CA that signed etcd's server certificates
    --etcd-cert FILE --etcd-key FILE     a client certificate, when etcd asks for one
    --etcd-user NAME                     an etcd user; its password from --etcd-password-file
                                         FILE (private: mode 0600) or $KERA_ETCD_PASSWORD,
                                         never the command line (other users see it in ps)

Whoever can write kera's keys on etcd can grant ACLs and forge fences, so a secure coordinator
(one with --keys-dir) refuses an etcd beyond loopback unless it is reached over TLS and as an
etcd user: an open etcd would undo every check the coordinator makes (docs/SECURITY.md).

No etcd library is imported here: the file store needs none.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kera.errors import StorageError

log = logging.getLogger(__name__)

PASSWORD_ENV = "KERA_ETCD_PASSWORD"
TLS_SCHEME = "etcds"
# A password file holds one line; anything longer is not a password file (bounds the read).
PASSWORD_BYTES_MAX = 4096
# The start's one read of etcd: short, since an etcd that is down is the campaigns' to wait for.
ACCESS_CHECK_DEADLINE_S = 2.0


class EtcdAccessError(StorageError):
    """The etcd flags are incomplete or unsafe, or etcd refused them: a configuration error,
    not worth retrying (the metadata cannot be reached until an operator fixes it)."""
    retriable = False


@dataclass(frozen=True)
class EtcdAccess:
    """TLS files and the etcd user a client presents; the defaults are plaintext, anonymous."""
    tls: bool = False
    ca: str | None = None           # None with tls: the CAs `requests` trusts by default
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """What an error message says of how etcd was reached (never the password)."""
        parts = ["TLS" if self.tls else "plaintext"]
        parts += [f"CA {self.ca}"] if self.ca else []
        parts += [f"client certificate {self.cert}"] if self.cert else []
        parts.append(f"as etcd user {self.user}" if self.user else "anonymously")
        return ", ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("etcd access (with --metadata etcds://...; see "
                                      "docs/SECURITY.md)")
    group.add_argument("--etcd-ca", metavar="FILE",
                       help="the CA certificate that signed etcd's server certificates")
    group.add_argument("--etcd-cert", metavar="FILE",
                       help="a client certificate for etcd (with --etcd-key)")
    group.add_argument("--etcd-key", metavar="FILE", help="the client certificate's private key")
    group.add_argument("--etcd-user", metavar="NAME",
                       help=f"log in to etcd as NAME; the password comes from "
                            f"--etcd-password-file or ${PASSWORD_ENV}")
    group.add_argument("--etcd-password-file", metavar="FILE",
                       help="a private file (mode 0600) holding --etcd-user's password")


def from_args(args: argparse.Namespace) -> EtcdAccess:
    """The access the flags describe. Raises EtcdAccessError when they are incomplete, or
    unsafe for a secure coordinator."""
    tls = args.metadata.partition("://")[0] == TLS_SCHEME
    files = {"--etcd-ca": args.etcd_ca, "--etcd-cert": args.etcd_cert,
             "--etcd-key": args.etcd_key}
    given = [flag for flag, value in files.items() if value]
    if given and not tls:
        raise EtcdAccessError(f"{' '.join(given)} need TLS: --metadata {TLS_SCHEME}://...")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise EtcdAccessError("--etcd-cert and --etcd-key go together (a client certificate "
                              "and its private key)")
    for flag, value in files.items():
        if value and not os.path.isfile(value):
            raise EtcdAccessError(f"{flag} {value}: no such file")
    access = EtcdAccess(tls, args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user,
                        _password(args))
    if getattr(args, "keys_dir", None) is not None:
        _refuse_open_etcd(args.metadata, access)
    return access


def open_client(args: argparse.Namespace, check_prefix: str | None = None):
    """An EtcdClient for --metadata as the flags say. With `check_prefix`, it reads that prefix
    once first, so that flags etcd refuses stop the coordinator at its start (instead of every
    campaign failing); an etcd that does not answer yet is left to the campaigns."""
    from kera.coordinator.etcd_client import EtcdClient, parse_url

    client = EtcdClient(parse_url(args.metadata), from_args(args))
    if check_prefix is not None:
        try:
            client.check_access(check_prefix, ACCESS_CHECK_DEADLINE_S)
        except EtcdAccessError:
            client.close()
            raise
        except StorageError as exc:
            log.warning("etcd does not answer yet (%s): standing by until it does", exc)
    return client


def _password(args: argparse.Namespace) -> str | None:
    if args.etcd_password_file and not args.etcd_user:
        raise EtcdAccessError("--etcd-password-file needs --etcd-user (whose password it is)")
    if not args.etcd_user:
        return None
    if args.etcd_password_file:
        return read_password_file(args.etcd_password_file)
    password = os.environ.get(PASSWORD_ENV)
    if not password:
        raise EtcdAccessError(f"--etcd-user {args.etcd_user} needs its password: "
                              f"--etcd-password-file FILE (mode 0600) or ${PASSWORD_ENV}")
    return password


def read_password_file(path: str | os.PathLike) -> str:
    """The password in `path` (its first line); refused if others may read the file."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        with open(path, "rb") as f:
            raw = f.read(PASSWORD_BYTES_MAX + 1)
    except OSError as exc:
        raise EtcdAccessError(f"cannot read --etcd-password-file {path}: {exc.strerror}") \
            from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise EtcdAccessError(f"--etcd-password-file {path} is readable by others (mode "
                              f"{stat.S_IMODE(mode):04o}): chmod 600 {path}")
    password = raw.decode("utf-8", "replace").split("\n", 1)[0].rstrip("\r")
    if not password or len(raw) > PASSWORD_BYTES_MAX:
        raise EtcdAccessError(f"--etcd-password-file {path}: expected the password on its "
                              f"first line")
    return password


def _refuse_open_etcd(url: str, access: EtcdAccess) -> None:
    """A secure coordinator keeps its ACLs and fences on etcd: beyond loopback, only over TLS
    and as an etcd user."""
    from kera.coordinator.etcd_client import parse_url
    from kera.net.security import is_loopback

    remote = [f"{h}:{p}" for h, p in parse_url(url) if not is_loopback(h)]
    if not remote or (access.tls and access.user):
        return
    lacking, give = [], []
    if not access.tls:
        lacking.append("without TLS")
        give.append(f"--metadata {TLS_SCHEME}://... --etcd-ca FILE")
    if not access.user:
        lacking.append("without authentication")
        give.append("--etcd-user NAME --etcd-password-file FILE")
    raise EtcdAccessError(
        f"etcd at {','.join(remote)} would hold this secure cluster's ACLs and fences "
        f"{' and '.join(lacking)}: whoever reaches it could grant themselves any stream. "
        f"Give {' and '.join(give)} (docs/SECURITY.md, 'etcd'), or run etcd on this host "
        f"(127.0.0.1)")
