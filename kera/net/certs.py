"""TLS certificates for the brokers' Kafka listeners: the cluster's CA, and one certificate
per broker signed by it (`kera keys kafka-cert`, `kera local --secure`).

Kafka clients trust the CA file (`ssl.ca.location`) and check that a broker's certificate
names the host they dialled, so a broker's certificate lists every name and address its
listener is advertised as. Files, under the keys directory:

    DIR/kafka/ca.crt            the CA certificate: give it to Kafka clients
    DIR/kafka/ca.key            the CA's private key (0600): stays with whoever issues certificates
    DIR/kafka/NAME.crt, .key    broker NAME's certificate and private key (0600)

Keys are ECDSA P-256 (what every TLS 1.2/1.3 client speaks, and cheap handshakes).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kera.net.kafka_users import KAFKA_DIR
from kera.net.keys import KeyFileError, check_name

CA_NAME = "ca"
# Validity: the CA outlives many broker certificates; a broker's is renewed by running
# `kera keys kafka-cert` again (clients keep trusting the same CA).
CA_VALID_DAYS = 3650
CERT_VALID_DAYS = 825          # the longest browsers and most TLS clients accept
BACKDATE = datetime.timedelta(minutes=5)   # clock skew between hosts
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def kafka_dir(keys_dir: str | os.PathLike) -> Path:
    return Path(keys_dir) / KAFKA_DIR


def ca_path(keys_dir: str | os.PathLike) -> Path:
    return kafka_dir(keys_dir) / f"{CA_NAME}.crt"


def cert_paths(keys_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """(certificate, private key) of broker `name`."""
    folder = kafka_dir(keys_dir)
    return folder / f"{name}.crt", folder / f"{name}.key"


def create_ca(keys_dir: str | os.PathLike) -> Path:
    """The cluster's CA, created once: its certificate's path."""
    folder = kafka_dir(keys_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    crt, key_path = folder / f"{CA_NAME}.crt", folder / f"{CA_NAME}.key"
    if crt.exists():
        return crt
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kera Kafka listener CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=CA_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM))
    return crt


def create_cert(keys_dir: str | os.PathLike, name: str, hosts=DEFAULT_HOSTS) -> tuple[Path, Path]:
    """Broker `name`'s certificate for `hosts` (names or IP addresses), signed by the CA
    (created on first use); replaces an older one. Returns (certificate, key) paths."""
    check_name(name)
    if name == CA_NAME:
        raise KeyFileError(f"{CA_NAME!r} names the CA; give the broker another name")
    hosts = list(dict.fromkeys(hosts)) or list(DEFAULT_HOSTS)
    create_ca(keys_dir)
    folder = kafka_dir(keys_dir)
    ca_key = serialization.load_pem_private_key((folder / f"{CA_NAME}.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((folder / f"{CA_NAME}.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=CERT_VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    crt_path, key_path = cert_paths(keys_dir, name)
    _write(key_path, _key_pem(key), private=True)
    _write(crt_path, cert.public_bytes(serialization.Encoding.PEM))
    return crt_path, key_path


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write to a temporary name (created 0600 when private), fsync, rename."""
    tmp = path.with_name(f".{path.name}.new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
