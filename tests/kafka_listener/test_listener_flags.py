"""A Kafka listener is never opened where it would serve anyone: a secure broker (CURVE keys)
opens SASL_SSL only, never a plaintext port (and refuses to start without its TLS
certificate); a plaintext one never binds a routable address without --insecure."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys

from kera.cli.local import LocalCluster
from kera.net import certs
from kera.net.keys import create_key


def _broker(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kera", "broker", "--coordinator",
                           "127.0.0.1:1", "--kafka-port", "0", *argv],
                          capture_output=True, text=True, timeout=60)


def test_a_broker_with_keys_and_no_certificate_opens_no_kafka_port(tmp_path):
    secret = create_key(tmp_path, "broker-0", "broker")
    proc = _broker("--keys-dir", str(tmp_path), "--key-file", str(secret))
    assert proc.returncode == 2
    assert "serves TLS only" in proc.stderr and "kera keys kafka-cert broker-0" in proc.stderr


def test_tls_flags_without_keys_are_refused(tmp_path):
    crt, key = certs.create_cert(tmp_path, "broker-0")
    proc = _broker("--kafka-tls-cert", str(crt), "--kafka-tls-key", str(key))
    assert proc.returncode == 2
    assert "need keys" in proc.stderr


def test_a_routable_kafka_host_needs_insecure():
    proc = _broker("--kafka-host", "0.0.0.0")
    assert proc.returncode == 2
    assert "--insecure" in proc.stderr and "0.0.0.0" in proc.stderr


def test_a_secure_local_cluster_opens_no_plaintext_kafka_port(tmp_path):
    """Each broker's Kafka port of `kera local --secure --kafka-port` speaks TLS only: a
    plaintext ApiVersions request is never answered as Kafka."""
    with LocalCluster(tmp_path, brokers=1, secure=True, kafka_port=0) as cluster:
        assert cluster.kafka_properties["security.protocol"] == "SASL_SSL"
        host, port = cluster.kafka_addresses[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"\0\0\0\x0a\0\x12\0\0\0\0\0\x01\xff\xff")   # ApiVersions v0
            s.settimeout(5)
            try:
                reply = s.recv(4096)
            except ConnectionResetError:
                reply = b""
        assert reply[:4] != b"\0\0\0\x0e" and (not reply or reply[:1] == b"\x15"), reply
        ctx = ssl.create_default_context(cafile=cluster.kafka_properties["ssl.ca.location"])
        with socket.create_connection((host, int(port)), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            assert s.version() in ("TLSv1.2", "TLSv1.3")
