"""The coordinator's etcd flags (kera.coordinator.etcd_access): etcds:// URLs, the password
from a private file or the environment, and a secure coordinator's refusal of an etcd beyond
loopback reached without TLS or without an etcd user."""

from __future__ import annotations

import argparse
import os

import pytest

from kera.coordinator import etcd_access
from kera.coordinator.etcd_access import PASSWORD_ENV, EtcdAccessError
from kera.coordinator.etcd_client import parse_url

REMOTE = "etcds://10.0.0.5:2379,10.0.0.6:2379"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--metadata")
    parser.add_argument("--keys-dir")
    etcd_access.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "etcd-password"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def ca(tmp_path):
    path = tmp_path / "ca.crt"
    path.write_text("a CA")
    return str(path)


def test_etcds_urls_list_their_endpoints_and_mean_tls(password_file):
    assert parse_url("etcds://a:1,b") == [("a", 1), ("b", 2379)]
    access = etcd_access.from_args(parse("--metadata", "etcds://a:1", "--etcd-user", "kera",
                                         "--etcd-password-file", password_file))
    assert access.tls and access.user == "kera" and access.password == "s3cret"
    assert "s3cret" not in repr(access) and "s3cret" not in access.describe()


def test_the_password_comes_from_the_environment_when_no_file_is_named(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    access = etcd_access.from_args(parse("--metadata", "etcds://a:1", "--etcd-user", "kera"))
    assert access.password == "from-env"
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(EtcdAccessError, match="needs its password"):
        etcd_access.from_args(parse("--metadata", "etcds://a:1", "--etcd-user", "kera"))


def test_a_password_file_others_may_read_is_refused(password_file):
    os.chmod(password_file, 0o644)
    with pytest.raises(EtcdAccessError, match="readable by others.*chmod 600"):
        etcd_access.from_args(parse("--metadata", "etcds://a:1", "--etcd-user", "kera",
                                    "--etcd-password-file", password_file))


@pytest.mark.parametrize("argv, refusal", [
    (["--metadata", "etcd://a:1", "--etcd-ca", "x"], "need TLS: --metadata etcds://"),
    (["--metadata", "etcds://a:1", "--etcd-cert", "x"], "go together"),
    (["--metadata", "etcds://a:1", "--etcd-ca", "/nonexistent/ca.crt"], "no such file"),
])
def test_incomplete_flags_are_refused_naming_them(argv, refusal):
    with pytest.raises(EtcdAccessError, match=refusal):
        etcd_access.from_args(parse(*argv))


@pytest.mark.parametrize("url, user, refusal", [
    ("etcd://10.0.0.5:2379", False, "without TLS and without authentication"),
    ("etcd://10.0.0.5:2379", True, "without TLS"),
    (REMOTE, False, "without authentication"),
    ("etcds://127.0.0.1:2379,10.0.0.6:2379", False, "10.0.0.6:2379"),
])
def test_a_secure_coordinator_refuses_an_open_etcd_beyond_loopback(url, user, refusal,
                                                                   password_file):
    argv = ["--metadata", url, "--keys-dir", "keys"]
    argv += ["--etcd-user", "kera", "--etcd-password-file", password_file] if user else []
    with pytest.raises(EtcdAccessError, match=refusal) as refused:
        etcd_access.from_args(parse(*argv))
    assert "--etcd-user" in str(refused.value) or "etcds://" in str(refused.value)


def test_a_secure_coordinator_accepts_tls_and_a_user_or_a_loopback_etcd(password_file, ca):
    secure = ["--keys-dir", "keys"]
    access = etcd_access.from_args(parse("--metadata", REMOTE, *secure, "--etcd-ca", ca,
                                         "--etcd-user", "kera",
                                         "--etcd-password-file", password_file))
    assert access.tls and access.ca == ca
    assert etcd_access.from_args(parse("--metadata", "etcd://127.0.0.1:2379", *secure)).tls is False
    # Without keys the daemon itself is open: the etcd beyond loopback is not refused there.
    assert etcd_access.from_args(parse("--metadata", "etcd://10.0.0.5:2379")).user is None
