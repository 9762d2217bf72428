"""A secure cluster (`kera local --secure`'s LocalCluster): CURVE on every socket, roles, ACLs.

Each test names what an attacker or a careless client tries, and asserts the cluster refuses it
with `not_authorized` (naming the principal, the operation and the resource) or does not let
it connect at all, while the same cluster serves the principals it should.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kera.codec import chunk

from kera.net import rpc
from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.errors import KeraError, NotAuthorized, Timeout
from kera.net.keys import KEY_FILE_ENV, create_key
from kera.producer import Producer

WAIT_S = 15.0
ACL_SPREAD_S = 10.0   # a grant reaches the brokers within a heartbeat; generous on a busy host
QUOTA_REQUEST_BYTES = 64 * 1024   # the quota test's produce requests: a quarter of its 1 s burst


@pytest.fixture(scope="module")
def cluster(local_cluster):
    c = local_cluster(brokers=2, backups=1, secure=True, log_level="WARNING",
                      heartbeat_interval_ms=100)
    os.environ.pop(KEY_FILE_ENV, None)   # every call below names its key
    return c


@pytest.fixture
def admin(cluster):
    with Admin(cluster.bootstrap, key_file=str(cluster.keys.admin)) as a:
        yield a


_names = iter(range(10**6))


def stream(admin, **kw) -> str:
    name = f"sec-{next(_names)}"
    admin.create_stream(name, **kw)
    return name


def client_conn(cluster, address: str, key="client", timeout_s: float = 5.0) -> rpc.Connection:
    return rpc.Connection(address, timeout_s=timeout_s, key_file=str(cluster.keys.secret(key)))


def consume(cluster, name: str, count: int, key: str = "client", **kw) -> list[bytes]:
    got: list[bytes] = []
    with Consumer(cluster.bootstrap, name, key_file=str(cluster.keys.secret(key)),
                  request_timeout_s=5.0, **kw) as c:
        deadline = time.monotonic() + WAIT_S
        while len(got) < count and time.monotonic() < deadline:
            record = c.poll(timeout_s=0.5)
            if record is not None:
                got.append(record.value)
    return got


def wait_for(check, what: str, timeout_s: float = ACL_SPREAD_S):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except NotAuthorized:
            if time.monotonic() > deadline:
                raise AssertionError(f"still not authorized after {timeout_s} s: {what}")
            time.sleep(0.1)


def wait_brokers_caught_up(cluster, admin) -> None:
    """Until every broker enforces the coordinator's current ACLs and quotas."""
    version = admin._call("acl_list")["acl_version"]
    deadline = time.monotonic() + ACL_SPREAD_S
    for b in cluster.brokers:
        while rpc.call(b.address, "stats", key_file=str(cluster.keys.admin))[0]["stats"][
                "acl_version"] < version:
            assert time.monotonic() < deadline, f"{b.name} never received ACL version {version}"
            time.sleep(0.05)


def test_a_client_without_a_known_key_cannot_connect(cluster, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(Timeout, match="CURVE"):
        rpc.call(cluster.bootstrap, "cluster", timeout_s=1.5)
    stranger = create_key(tmp_path, "stranger", "admin")   # a key the cluster never saw
    with pytest.raises(Timeout, match="keys directory"):
        rpc.call(cluster.bootstrap, "cluster", timeout_s=1.5, key_file=str(stranger))


def test_a_client_key_cannot_call_any_cluster_op(cluster):
    with client_conn(cluster, cluster.bootstrap) as conn:
        for op, fields in (("register", {"kind": "broker", "address": "127.0.0.1:1", "node": "x"}),
                           ("heartbeat", {"kind": "broker", "daemon_id": 0}),
                           ("broker_streams", {"broker_id": 0}),
                           ("replicas", {}), ("recovered", {}),
                           ("deregister", {"kind": "broker", "daemon_id": 0})):
            with pytest.raises(NotAuthorized, match="client:client"):
                conn.call(op, fields)
    with client_conn(cluster, cluster.backups[0].address) as conn:
        for op in ("replicate", "drop_replica", "list_replicas", "read_replica"):
            with pytest.raises(NotAuthorized, match=f"may not call '{op}'"):
                conn.call(op, {"broker_id": 0, "vlog": 0, "vseg": 0, "offset": 0})
    with client_conn(cluster, cluster.brokers[0].address) as conn:
        with pytest.raises(NotAuthorized, match="describe cluster"):
            conn.call("stats")
    with client_conn(cluster, cluster.backups[0].address, key="admin") as conn:
        conn.call("list_replicas", {"broker_id": 0})   # an operator may look...
        with pytest.raises(NotAuthorized, match="not fence"):
            conn.call("list_replicas", {"broker_id": 0, "fence": [1]})   # ...not fence


def test_a_client_key_cannot_delete_or_read_a_stream_without_a_grant(cluster, admin):
    name = stream(admin)
    with Producer(cluster.bootstrap, key_file=str(cluster.keys.admin)) as p:
        p.send_batch(name, [b"secret-%d" % i for i in range(10)])
        p.flush()
    with Admin(cluster.bootstrap, key_file=str(cluster.keys.client)) as client:
        with pytest.raises(NotAuthorized) as exc:
            client.delete_stream(name)
        assert "client:client" in exc.value.message and "delete" in exc.value.message \
            and repr(name) in exc.value.message
    with pytest.raises(NotAuthorized, match=f"read stream '{name}'|describe stream '{name}'"):
        consume(cluster, name, 10)
    admin.add_acls([["client", "allow", "read", "stream", name, "literal"]])
    got = wait_for(lambda: consume(cluster, name, 10), "read after the grant")
    assert sorted(got) == sorted(b"secret-%d" % i for i in range(10))
    assert name in [s["name"] for s in admin.list_streams()]


def test_a_broker_answers_a_stream_id_the_key_may_not_describe_as_an_unknown_one(cluster, admin):
    """Probing ids tells a client key nothing: a stream it may not describe is answered exactly
    as an id no stream has (same code, same message shape), on every broker op that takes an
    id; once it may describe the stream, a refusal names what is missing."""
    name = stream(admin, streamlets=2)   # one per broker: later tests' placements stay even
    info = admin.describe_stream(name)
    sid, owner = info["id"], info["brokers"][str(info["placement"][0])]
    absent = sid + 100_000

    def refusals(target: int) -> list:
        out = []
        with client_conn(cluster, owner) as conn:
            with pytest.raises(KeraError) as exc:
                conn.call("offsets", {"sid": target, "sl": 0})
            out.append((exc.value.code, exc.value.message))
            header, _ = conn.call("fetch", {"reads": [[target, 0, {"low": 0, "offsets": {}},
                                                       1 << 16]]})
            error = header["results"][0][0]
            out.append((error[0], error[1]))
            header, _ = conn.call("produce", None,
                                  [chunk.encode(77, 0, target, 0, [b"probe"])])
            result = header["results"][0]
            out.append((result[0], result[1]))
        return [(code, text.replace(str(target), "ID")) for code, text in out]

    hidden, unknown = refusals(sid), refusals(absent)
    assert hidden == unknown and all(code == "unknown_stream" for code, _ in hidden), hidden
    assert not any(name in text for _, text in hidden)
    admin.add_acls([["client", "allow", "describe", "stream", name, "literal"]])
    wait_brokers_caught_up(cluster, admin)
    with client_conn(cluster, owner) as conn:
        conn.call("offsets", {"sid": sid, "sl": 0})             # may describe: answered
        header, _ = conn.call("fetch", {"reads": [[sid, 0, {"low": 0, "offsets": {}}, 1 << 16]]})
        assert header["results"][0][0][0] == "not_authorized" and name in header["results"][0][0][1]


def test_a_deny_overrides_an_allow(cluster, admin):
    name = stream(admin)
    admin.add_acls([["client", "allow", "all", "stream", "sec-", "prefixed"]])

    def produce():
        with Producer(cluster.bootstrap, key_file=str(cluster.keys.client)) as p:
            p.send_batch(name, [b"a", b"b"])
            p.flush()

    wait_for(produce, "write after the prefixed grant")
    assert sorted(consume(cluster, name, 2)) == [b"a", b"b"]
    admin.add_acls([["client", "deny", "read", "stream", name, "literal"]])
    deadline = time.monotonic() + ACL_SPREAD_S
    while True:
        try:
            consume(cluster, name, 2)
        except NotAuthorized as err:
            assert f"read stream '{name}'" in err.message
            break
        assert time.monotonic() < deadline, "the deny never took effect"
        time.sleep(0.1)
    produce()   # the deny is of reading only


def test_a_broker_key_cannot_act_as_another_broker(cluster, admin):
    # Four streamlets: broker 0 owns some (its replicas are read below) however uneven the
    # module's earlier streams left the placement.
    name = stream(admin, replication=2, streamlets=4)
    values = [b"kept-%d" % i for i in range(200)]
    with Producer(cluster.bootstrap, key_file=str(cluster.keys.admin)) as p:
        p.send_batch(name, values)
        p.flush()
    with client_conn(cluster, cluster.backups[0].address, key="broker-1") as conn:
        for op in ("drop_replica", "replicate"):
            with pytest.raises(NotAuthorized, match="belong to principal 'broker-0'"):
                conn.call(op, {"broker_id": 0, "vlog": 0, "vseg": 0, "offset": 0})
        # Fencing broker 0's live incarnation (and the next ones) would stop its writes: a
        # broker key fences only what the coordinator failed over and signed for it.
        epoch = rpc.call(cluster.bootstrap, "recovery_status",
                         key_file=str(cluster.keys.admin))[0]["epochs"]
        live = dict(map(tuple, epoch))[0]
        with pytest.raises(NotAuthorized, match="failed none of them over"):
            conn.call("list_replicas", {"broker_id": 0, "fence": [live, live + 1]})
        with pytest.raises(NotAuthorized, match="failed none of them over"):
            conn.call("list_replicas", {"broker_id": 0, "fence": [live],
                                        "fence_tokens": ["0" * 32]})
        assert conn.call("list_replicas", {"broker_id": 0})[0]["replicas"]   # reading is open
    with client_conn(cluster, cluster.bootstrap, key="broker-1") as conn:
        with pytest.raises(NotAuthorized, match="bound to principal 'broker-0'"):
            conn.call("register", {"kind": "broker", "daemon_id": 0,
                                   "address": "127.0.0.1:1", "node": "forged"})
    with client_conn(cluster, cluster.bootstrap, key="backup-0") as conn:
        with pytest.raises(NotAuthorized, match="cannot act as a broker"):
            conn.call("register", {"kind": "broker", "address": "127.0.0.1:1", "node": "x"})
    assert sorted(consume(cluster, name, len(values), key="admin")) == sorted(values)
    with Producer(cluster.bootstrap, key_file=str(cluster.keys.admin)) as p:   # still writable
        p.send_batch(name, [b"after"] * 10)
        p.flush(timeout=30)


class Relay:
    """A TCP relay that keeps every byte passing through, both ways: what a wiretap sees."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(WAIT_S)
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target, timeout=WAIT_S)
        peers = {client: server, server: client}
        while not self._stop.is_set():
            ready, _, _ = select.select(list(peers), [], [], 0.1)
            for sock in ready:
                data = sock.recv(65536)
                if not data:
                    return
                self.captured += data
                peers[sock].sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.listener.close()


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "plaintext"])
def test_a_captured_connection_holds_record_bytes_only_in_plaintext(local_cluster, secure):
    c = local_cluster(brokers=1, secure=secure, log_level="WARNING")
    os.environ.pop(KEY_FILE_ENV, None)
    key = str(c.keys.admin) if secure else None
    with Admin(c.bootstrap, key_file=key) as a:
        sid = a.create_stream("tapped")["id"]
    marker = b"THE-RECORD-" + os.urandom(16).hex().encode()
    relay = Relay(c.brokers[0].address)
    try:
        with rpc.Connection(relay.address, timeout_s=WAIT_S, key_file=key) as conn:
            header, _ = conn.call("produce", {}, [chunk.encode(7, 0, sid, 0, [marker] * 3)])
        assert not isinstance(header["results"][0][0], str), header
    finally:
        relay.close()
    assert len(relay.captured) > 3 * len(marker)
    assert (marker in relay.captured) is not secure
    with Consumer(c.bootstrap, "tapped", key_file=key) as consumer:
        deadline = time.monotonic() + WAIT_S
        got: list = []
        while len(got) < 3 and time.monotonic() < deadline:
            record = consumer.poll(timeout_s=0.5)
            if record is not None:
                got.append(record.value)
    assert got == [marker] * 3


def test_a_principal_over_its_quotas_is_slowed_not_dropped(cluster, admin):
    name = stream(admin)
    admin.add_acls([["client", "allow", "all", "stream", name, "literal"]])
    rate = 256 * 1024
    assert admin.set_quota("client", produce_bytes_per_s=rate)["client"] == {"produce": rate}
    wait_brokers_caught_up(cluster, admin)
    values = [b"q%05d" % i + b"." * 1000 for i in range(1000)]   # ~1 MiB: 4 s of quota

    def produce():
        # Requests of at most 64 KiB: a quota is checked as each request arrives (and charged
        # after), so the ~1 MiB must come in many requests for one to meet a bucket in debt;
        # with the default 1 MiB requests, runs of chunks may carry it all in one or two.
        with Producer(cluster.bootstrap, key_file=str(cluster.keys.client),
                      send_timeout_s=60.0, request_size_bytes=QUOTA_REQUEST_BYTES) as p:
            for i in range(0, len(values), 50):
                p.send_batch(name, values[i:i + 50])
            p.flush()

    wait_for(produce, "write with the grant and the quota in place")
    throttled = sum(rpc.call(b.address, "stats", key_file=str(cluster.keys.admin))[0]["stats"]
                    .get("quota_throttled_produce", 0) for b in cluster.brokers)
    assert throttled > 0, "the producer never hit its quota"
    # One request larger than the bucket (rate x 1 s) is refused, not let into deep debt.
    with Producer(cluster.bootstrap, key_file=str(cluster.keys.client),
                  send_timeout_s=30.0) as p:
        future = p.send(name, b"x" * (rate + 64 * 1024))
        with pytest.raises(KeraError, match="larger than principal 'client'"):
            p.flush()
        assert future.exception() is not None
    got = consume(cluster, name, len(values), key="admin")
    assert sorted(got) == sorted(values)          # every record, once
    admin.set_quota("client", produce_bytes_per_s=0, fetch_bytes_per_s=rate)
    wait_brokers_caught_up(cluster, admin)
    # Small fetches: the quota bites after the first 256 KiB, not after one fetch of it all.
    got = consume(cluster, name, len(values), key="client", fetch_max_bytes=32 * 1024)
    assert sorted(got) == sorted(values)          # slowed, not cut short
    throttled = sum(rpc.call(b.address, "stats", key_file=str(cluster.keys.admin))[0]["stats"]
                    .get("quota_throttled_fetch", 0) for b in cluster.brokers)
    assert throttled > 0, "the consumer never hit its fetch quota"
    admin.set_quota("client", fetch_bytes_per_s=0)
    assert "client" not in admin.list_quotas()


def test_kera_local_secure_prints_its_keys_and_the_cli_uses_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != KEY_FILE_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "kera", "local", "--dir", str(tmp_path),
                             "--port", "0", "--brokers", "1", "--secure", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        bootstrap = proc.stdout.readline().strip()
        lines = [proc.stdout.readline() for _ in range(5)]
        admin_key = tmp_path / "keys" / "admin.key_secret"
        assert any(str(admin_key) in line for line in lines), lines
        assert oct(admin_key.stat().st_mode & 0o777) == "0o600"

        def kera(*args, key=None):
            run_env = dict(env, **({KEY_FILE_ENV: str(key)} if key else {}))
            return subprocess.run([sys.executable, "-m", "kera", *args, "--bootstrap", bootstrap,
                                   "--timeout-s", "3"], capture_output=True, text=True,
                                  env=run_env, timeout=60)

        made = kera("stream", "create", "cli-s", key=admin_key)
        assert made.returncode == 0, made.stderr
        refused = kera("stream", "delete", "cli-s", key=tmp_path / "keys" / "client.key_secret")
        assert refused.returncode != 0 and "not_authorized" in refused.stderr
        assert "principal client:client" in refused.stderr
        no_key = kera("stream", "list")
        assert no_key.returncode != 0 and "--key-file" in no_key.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("daemon", [["coordinator", "--dir", "{tmp}/c"],
                                    ["broker", "--coordinator", "127.0.0.1:1"],
                                    ["backup", "--coordinator", "127.0.0.1:1", "--dir", "{tmp}/b"]])
def test_a_routable_address_without_keys_is_refused_unless_insecure(tmp_path, daemon):
    """Protected mode: a daemon without keys binds a routable address only with --insecure
    (the test hosts' clusters pass it: tests/hosts)."""
    args = [a.format(tmp=tmp_path) for a in daemon]
    proc = subprocess.run([sys.executable, "-m", "kera", *args, "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "without authentication or encryption" in proc.stderr
    assert "--insecure" in proc.stderr


@pytest.mark.parametrize("how", ["deleted", "overwritten in place"])
def test_a_revoked_key_is_refused_on_the_connection_it_already_has(cluster, how):
    name = f"revokee-{next(_names)}"
    secret = create_key(cluster.keys.dir, name, "client")
    public = cluster.keys.dir / "public" / "client" / f"{name}.key"
    with _admitted_connection(cluster.bootstrap, secret) as conn:
        if how == "deleted":
            public.unlink()
        else:   # the same file, another key's bytes: the connection's key is no longer there
            other = create_key(cluster.keys.dir, f"{name}-other", "client")
            other_public = cluster.keys.dir / "public" / "client" / f"{name}-other.key"
            public.write_bytes(other_public.read_bytes())
            assert other.exists()
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                conn.call("cluster")
            except NotAuthorized as exc:
                assert "revoked" in exc.message and name in exc.message
                break
            assert time.monotonic() < deadline, "the revoked key was still served"
            time.sleep(0.1)


def _admitted_connection(address: str, secret) -> rpc.Connection:
    """A connection with a key just created: daemons look at the keys directory at most once
    a second (kera.net.security.KEYRING_RELOAD_INTERVAL_S), so connect until admitted."""
    deadline = time.monotonic() + WAIT_S
    while True:
        conn = rpc.Connection(address, timeout_s=1.5, key_file=str(secret))
        try:
            conn.call("cluster")
            return conn
        except Timeout:
            conn.close()
            assert time.monotonic() < deadline, "a new key was never admitted"


def test_a_group_consumer_without_the_group_acl_raises_from_poll(cluster, admin, caplog):
    name = stream(admin)
    admin.add_acls([["client", "allow", "read", "stream", name, "literal"]])
    wait_brokers_caught_up(cluster, admin)
    group = f"g-{name}"
    with Consumer(cluster.bootstrap, name, group=group, key_file=str(cluster.keys.client),
                  request_timeout_s=5.0) as c:
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(NotAuthorized, match=repr(group)):
            while time.monotonic() < deadline:
                c.poll(timeout_s=0.5)
        with pytest.raises(NotAuthorized):   # and on every later call
            c.poll(timeout_s=0.1)
    refusals = [r for r in caplog.records if group in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]


def test_a_pattern_subscription_holds_only_streams_the_member_may_read(cluster, admin):
    # Names of their own: earlier tests grant the client prefixes of stream()'s names.
    n = next(_names)
    readable, hidden = f"pat-{n}-open", f"pat-{n}-hidden"
    admin.create_stream(readable)
    admin.create_stream(hidden)
    group = f"g-pattern-{readable}"
    admin.add_acls([["client", "allow", "read", "stream", readable, "literal"],
                    ["client", "allow", "read", "group", group, "literal"]])
    wait_brokers_caught_up(cluster, admin)
    with Consumer(cluster.bootstrap, [], group=group, pattern=f"pat-{n}-.*",
                  key_file=str(cluster.keys.client), request_timeout_s=5.0) as c:
        deadline = time.monotonic() + WAIT_S
        while not c.assignment():
            assert time.monotonic() < deadline, "nothing assigned"
            c.poll(timeout_s=0.2)
        assigned = {s for s, _sl in c.assignment()}
    assert readable in assigned and hidden not in assigned, assigned


@pytest.mark.parametrize("daemon_kind", ["coordinator", "broker"])
def test_a_connection_that_never_finishes_its_handshake_is_closed(cluster, daemon_kind):
    """A silent connection holds a descriptor only CURVE_HANDSHAKE_MS, not zmq's 30 s."""
    from kera.net.server import CURVE_HANDSHAKE_MS
    daemon = cluster.coordinator if daemon_kind == "coordinator" else cluster.brokers[0]
    host, port = daemon.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5.0) as silent:
        silent.settimeout(CURVE_HANDSHAKE_MS / 1000 + 10.0)
        started = time.monotonic()
        while silent.recv(4096):   # the server's greeting, then EOF when it gives up on us
            pass
        waited_s = time.monotonic() - started
    assert waited_s < CURVE_HANDSHAKE_MS / 1000 + 5.0
