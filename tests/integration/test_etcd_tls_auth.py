"""A secure cluster's metadata on an etcd that serves TLS only, wants client certificates and
authentication (issue 37, item 2): a coordinator given the CA, its client certificate and an
etcd user keeps its streams there across a restart; one without the CA, or with a wrong
password, stops at once saying which flag to fix; and a client without kera's etcd user reads
and writes nothing of kera's, with or without a client certificate.

The etcd is Debian's etcd-server (tests/etcd_cluster.py, `secure=True`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kera.cli.local import free_port
from kera.coordinator.etcd_access import EtcdAccess, EtcdAccessError
from kera.coordinator.etcd_client import EtcdClient, b64, parse_url
from kera.coordinator.etcd_store import prefix_for
from kera.errors import StorageError
from tests.etcd_cluster import EtcdCluster, etcd_binary

PREFIX_NAME = "tls"
EXIT_TIMEOUT_S = 15.0        # a coordinator refused by etcd exits within its start's check
REFUSED_DEADLINE_S = 1.0     # an anonymous call: etcd closes the TLS connection, every try


@pytest.fixture
def secure_etcd(tmp_path_factory):
    binary, why = etcd_binary()
    if binary is None:
        pytest.skip(f"no etcd to test against: {why}")
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), binary=binary, secure=True)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def kera_access(etcd: EtcdCluster, **changes) -> EtcdAccess:
    fields = dict(tls=True, ca=str(etcd.tls.ca), cert=str(etcd.tls.cert),
                  key=str(etcd.tls.key), user=etcd.user, password=etcd.password)
    return EtcdAccess(**{**fields, **changes})


def stored_keys(etcd: EtcdCluster) -> list[str]:
    client = EtcdClient(parse_url(etcd.url), kera_access(etcd))
    try:
        return [k for k, _, _ in client.read_prefix(prefix_for(PREFIX_NAME))[0]]
    finally:
        client.close()


def test_a_secure_coordinator_keeps_its_streams_on_etcd_with_tls_and_auth(
        secure_etcd, fresh_cluster, tmp_path):
    args = secure_etcd.coordinator_args(tmp_path / "etcd-password")
    cluster = fresh_cluster(brokers=1, secure=True, log_level="WARNING",
                            extra_coordinator_args=[*args, "--metadata-prefix", PREFIX_NAME])
    with cluster.admin() as admin:
        admin.create_stream("kept", streamlets=1)
    assert f"/kera/{PREFIX_NAME}/streams/kept" in stored_keys(secure_etcd)
    cluster.kill_coordinator()
    shutil.rmtree(cluster.data_dir / "coordinator")   # what comes back is etcd's
    cluster.restart_coordinator()
    with cluster.admin() as admin:
        assert "kept" in [s["name"] for s in admin.list_streams()]


def run_coordinator(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KERA_ETCD_PASSWORD"}
    return subprocess.run([sys.executable, "-P", "-m", "kera", "coordinator", "--port", str(free_port()),
                           "--metadata-prefix", PREFIX_NAME, *args], env=env,
                          capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)


@pytest.mark.parametrize("case, expected", [
    ("no CA", "TLS certificate is not trusted (give --etcd-ca FILE"),
    ("wrong password", "refused the login of etcd user 'kera'"),
])
def test_a_coordinator_etcd_refuses_stops_at_once_naming_the_flag(secure_etcd, tmp_path, case,
                                                                   expected):
    args = secure_etcd.coordinator_args(tmp_path / "etcd-password")
    if case == "no CA":
        at = args.index("--etcd-ca")
        del args[at:at + 2]
    else:
        (tmp_path / "etcd-password").write_text("not-the-password\n")
    done = run_coordinator(args)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr, done.stderr


def test_without_kera_s_etcd_user_nothing_of_kera_s_is_read_or_written(secure_etcd):
    key = prefix_for(PREFIX_NAME) + "meta/acls"
    put = {"key": b64(key), "value": b64('[["*", "allow", "all", "stream", "", "prefixed"]]')}
    with_cert = EtcdClient(parse_url(secure_etcd.url), kera_access(secure_etcd, user=None,
                                                                   password=None))
    without_cert = EtcdClient(parse_url(secure_etcd.url), kera_access(
        secure_etcd, user=None, password=None, cert=None, key=None))
    wrong = EtcdClient(parse_url(secure_etcd.url), kera_access(secure_etcd, password="guess"))
    for client, refusal in [(with_cert, "requires authentication"),
                            (wrong, "refused the login")]:
        with pytest.raises(EtcdAccessError, match=refusal):
            client.call("kv/put", put)
        with pytest.raises(EtcdAccessError, match=refusal):
            client.read_prefix(prefix_for(PREFIX_NAME))
    with pytest.raises(StorageError, match="give --etcd-cert and --etcd-key"):
        without_cert.call("kv/put", put, REFUSED_DEADLINE_S)
    for client in (with_cert, without_cert, wrong):
        client.close()
    assert stored_keys(secure_etcd) == [], "nothing was written"


def test_an_expired_token_is_replaced_by_a_new_login(secure_etcd):
    client = EtcdClient(parse_url(secure_etcd.url), kera_access(secure_etcd))
    key = prefix_for(PREFIX_NAME) + "probe"
    client.call("kv/put", {"key": b64(key), "value": b64("1")})
    client.token = "stale.1"     # as etcd forgets a token after --auth-token-ttl
    assert client.get(key)[0] == "1"
    assert client.token != "stale.1"
    client.close()
