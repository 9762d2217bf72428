"""A Kafka listener is never opened where it would serve anyone: with CURVE keys (it has no
TLS/SASL yet), or on a routable address without --insecure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kera.cli.local import ClusterError, LocalCluster
from kera.net.keys import create_key


def _broker(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kera", "broker", "--coordinator",
                           "127.0.0.1:1", "--kafka-port", "0", *argv],
                          capture_output=True, text=True, timeout=60)


def test_a_broker_with_keys_refuses_a_kafka_port(tmp_path):
    secret = create_key(tmp_path, "broker-0", "broker")
    proc = _broker("--keys-dir", str(tmp_path), "--key-file", str(secret))
    assert proc.returncode == 2
    assert "never opens an unauthenticated port" in proc.stderr


def test_a_routable_kafka_host_needs_insecure():
    proc = _broker("--kafka-host", "0.0.0.0")
    assert proc.returncode == 2
    assert "--insecure" in proc.stderr and "0.0.0.0" in proc.stderr


def test_a_secure_local_cluster_refuses_a_kafka_port(tmp_path):
    with pytest.raises(ClusterError, match="secure cluster opens no unauthenticated port"):
        LocalCluster(tmp_path, brokers=1, secure=True, kafka_port=0)
    assert not (tmp_path / "logs").exists()   # refused before any daemon started
