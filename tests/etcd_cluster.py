"""A real etcd for tests: 1 or 3 members on free 127.0.0.1 ports, private data dirs.

    cluster = EtcdCluster(tmp_dir, members=3).start()   # waits until every member is healthy
    cluster.url                      # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
    cluster.kill(0)                  # SIGKILL one member
    cluster.stop()                   # kills them all and removes their data

`EtcdCluster(tmp_dir, secure=True)` serves TLS only (client certificates required, signed by a
CA of its own: `cluster.tls`) with authentication on: a `root` user, and the user `kera` whose
role may read and write /kera/ and nothing else (`cluster.user`, `cluster.password`);
`cluster.url` is then etcds://... and `cluster.coordinator_args()` the flags a coordinator needs.

`etcd_binary()` installs Debian's `etcd-server` when no `etcd` is on the PATH (the tests run as
root); it returns None when that fails, and the fixture skips with the reason.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kera.cli.local import free_port
from tests.debian import install_if_missing

HOST = "127.0.0.1"
HEALTHY_TIMEOUT_S = 30.0     # members started -> every one answers /health with a leader
POLL_INTERVAL_S = 0.1
HTTP_TIMEOUT_S = 1.0         # one /health probe
STOP_TIMEOUT_S = 10.0
# etcd's own knobs for tests: quick elections on loopback, and a history compacted as it goes
# (a coordinator commits every loop turn).
HEARTBEAT_INTERVAL_MS = 50
ELECTION_TIMEOUT_MS = 500
COMPACTION_RETENTION_REVISIONS = 10_000
CERT_VALID = datetime.timedelta(days=1)    # certificates live as long as one test run
KERA_USER = "kera"
KERA_ROLE = "kera"
KERA_KEY_PREFIX = "/kera/"                 # what the kera role may read and write


def etcd_binary() -> tuple[str | None, str]:
    """(path of `etcd`, "") or (None, why it cannot be had)."""
    return install_if_missing("etcd-server", lambda: shutil.which("etcd"))


class EtcdCluster:
    def __init__(self, data_dir: str | os.PathLike, members: int = 1, binary: str = "etcd",
                 hosts: list[tuple[str, list[str]]] | None = None, secure: bool = False):
        """`hosts`: member i runs on hosts[i] = (its address, a command prefix such as
        `ip netns exec NAME`; tests/hosts), else all on 127.0.0.1. `secure`: TLS and
        authentication (see the module's docstring)."""
        self.dir = Path(data_dir)
        self.secure = secure
        self.tls: TlsFiles | None = None
        self.user = KERA_USER
        self.password = secrets.token_urlsafe(16)
        self.root_password = secrets.token_urlsafe(16)
        self.binary = binary
        self.hosts = hosts or [(HOST, [])] * members
        taken: set[int] = set()
        self.ports: list[tuple[int, int]] = []   # (client, peer) per member
        for _ in range(members):
            client = free_port(HOST, taken)
            taken.add(client)
            peer = free_port(HOST, taken)
            taken.add(peer)
            self.ports.append((client, peer))
        self.procs: list[subprocess.Popen | None] = [None] * members

    @property
    def url(self) -> str:
        return self.url_from(0)

    def url_from(self, first: int) -> str:
        """The members' etcd:// URL listing member `first` first (a client asks it first)."""
        order = list(range(first, len(self.ports))) + list(range(first))
        scheme = "etcds" if self.secure else "etcd"
        return f"{scheme}://" + ",".join(f"{self.hosts[i][0]}:{self.ports[i][0]}" for i in order)

    def leader(self) -> int:
        """The index of the member the raft leader is (asked of a running member)."""
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                continue
            with self._urlopen(self.client_url(i) + "/v3/maintenance/status", {}) as reply:
                status = json.loads(reply.read())
            return self._member_ids().index(status["leader"])
        raise RuntimeError("no etcd member running")

    def _member_ids(self) -> list[str]:
        """Each member's raft id, in index order (from /v3/cluster/member/list)."""
        members = self.api("cluster/member/list", {})["members"]
        by_name = {m["name"]: m["ID"] for m in members}
        return [by_name[f"m{i}"] for i in range(len(self.ports))]

    def _running(self) -> int:
        return next(i for i, p in enumerate(self.procs) if p is not None and p.poll() is None)

    def client_url(self, i: int) -> str:
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.hosts[i][0]}:{self.ports[i][0]}"

    def coordinator_args(self, password_file: str | os.PathLike) -> list[str]:
        """A coordinator's flags for this etcd (its password written to `password_file`)."""
        if not self.secure:
            return ["--metadata", self.url]
        Path(password_file).write_text(self.password + "\n")
        os.chmod(password_file, 0o600)
        return ["--metadata", self.url, "--etcd-ca", str(self.tls.ca),
                "--etcd-cert", str(self.tls.cert), "--etcd-key", str(self.tls.key),
                "--etcd-user", self.user, "--etcd-password-file", str(password_file)]

    def _urlopen(self, url: str, body: dict | None = None, token: str | None = None):
        """POST `body` (GET without one) over TLS with the client certificate when secure."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": token} if token else {}
        request = urllib.request.Request(url, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        context = None
        if self.secure:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=context)

    def api(self, path: str, body: dict, token: str | None = None) -> dict:
        """One v3 gateway call on a running member, e.g. api("auth/user/add", {...})."""
        try:
            with self._urlopen(f"{self.client_url(self._running())}/v3/{path}", body,
                               token) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:   # etcd's reason is in the body
            raise RuntimeError(f"etcd {path}: {exc.code} {exc.read()[:500]!r}") from None

    def _enable_auth(self) -> None:
        """Users root and kera (kera may read and write /kera/ only), then authentication on."""
        prefix = base64.b64encode(KERA_KEY_PREFIX.encode()).decode()
        end = base64.b64encode(KERA_KEY_PREFIX[:-1].encode() + b"0").decode()
        for path, body in [
                ("auth/user/add", {"name": "root", "password": self.root_password}),
                ("auth/user/grant", {"user": "root", "role": "root"}),
                ("auth/role/add", {"name": KERA_ROLE}),
                ("auth/role/grant", {"name": KERA_ROLE, "perm": {
                    "permType": "READWRITE", "key": prefix, "range_end": end}}),
                ("auth/user/add", {"name": self.user, "password": self.password}),
                ("auth/user/grant", {"user": self.user, "role": KERA_ROLE}),
                ("auth/enable", {})]:
            self.api(path, body)

    def _args(self, i: int) -> list[str]:
        client, peer = self.ports[i]
        initial = ",".join(f"m{j}=http://{self.hosts[j][0]}:{p}" for j, (_, p) in enumerate(self.ports))
        tls = [] if not self.secure else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return [self.binary, *tls, "--name", f"m{i}", "--data-dir", str(self.dir / f"m{i}"),
                "--listen-client-urls", self.client_url(i),
                "--advertise-client-urls", self.client_url(i),
                "--listen-peer-urls", f"http://{self.hosts[i][0]}:{peer}",
                "--initial-advertise-peer-urls", f"http://{self.hosts[i][0]}:{peer}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"kera-test-{os.getpid()}",
                "--heartbeat-interval", str(HEARTBEAT_INTERVAL_MS),
                "--election-timeout", str(ELECTION_TIMEOUT_MS),
                "--auto-compaction-mode", "revision",
                "--auto-compaction-retention", str(COMPACTION_RETENTION_REVISIONS)]

    def start(self) -> "EtcdCluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.secure and self.tls is None:
            self.tls = make_tls(self.dir / "tls", sorted({h for h, _ in self.hosts}))
        for i in range(len(self.ports)):
            self.start_member(i)
        self.wait_healthy()
        if self.secure:
            self._enable_auth()
        return self

    def start_member(self, i: int) -> None:
        with open(self.dir / f"m{i}.log", "ab") as logf:
            self.procs[i] = subprocess.Popen([*self.hosts[i][1], *self._args(i)], stdin=subprocess.DEVNULL,
                                             stdout=logf, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def healthy(self, i: int) -> bool:
        try:
            with self._urlopen(self.client_url(i) + "/health") as reply:
                return b'"health":"true"' in reply.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]
            if running and all(self.healthy(i) for i in running):
                return
            time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"etcd members not healthy after {timeout_s} s: see {self.dir}/m*.log")

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)
        self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    cert: Path              # a client certificate the CA signed (no common name)
    key: Path


def make_tls(folder: Path, hosts: list[str]) -> TlsFiles:
    """A CA, etcd's server certificate for `hosts` and a client certificate, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kera test etcd CA")])
    ca = (_builder(ca_name, ca_name, ca_key)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    _write_pem(folder / "ca.crt", ca.public_bytes(serialization.Encoding.PEM))
    names = [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]
    # etcd's gateway calls its own gRPC server with the server certificate: client use too.
    server = _issue(folder / "server", "etcd", ca, ca_key,
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                    [*names, x509.DNSName("localhost")])
    # No common name: with authentication on, etcd's gateway refuses a client certificate
    # that has one (it would not log in as that name).
    client = _issue(folder / "client", None, ca, ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    return TlsFiles(folder / "ca.crt", *server, *client)


def _builder(subject: x509.Name, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + CERT_VALID))


def _issue(stem: Path, cn: str | None, ca, ca_key, usages, alt_names) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else [])
    builder = _builder(subject, ca.subject, key)
    builder = (builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    crt, key_path = stem.with_suffix(".crt"), stem.with_suffix(".key")
    _write_pem(crt, cert.public_bytes(serialization.Encoding.PEM))
    _write_pem(key_path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return crt, key_path


def _write_pem(path: Path, data: bytes) -> None:
    path.write_bytes(data)
