"""The sans-IO parts of the Kafka listener's security: SCRAM-SHA-256 and PLAIN against stored
credentials, the users file (parsing, writing, reloading), the broker certificates, and the
per-API authorization that narrows a request and amends its answer."""

from __future__ import annotations

import base64
import select
import socket
import ssl
import stat
import struct
import threading

import pytest
from kio.index import load_request_schema
from kio.schema.errors import ErrorCode

from kera.broker.kafka import authorize
from kera.broker.kafka.connection import READ_BYTES, Connection
from kera.broker.kafka.context import Call, Context, Settings
from kera.broker.kafka.messages import KafkaRequest, build
from kera.broker.kafka.sasl import KafkaSecurity, server_context
from kera.net import certs, kafka_users, scram
from kera.net.access import Guard
from kera.net.acl import Acl
from kera.net.keys import KeyFileError, Principal


# ---------------------------------------------------------------------- SCRAM and PLAIN
def _lookup(users: dict):
    return lambda name: users.get(name)


def test_scram_exchange_with_the_right_password_proves_both_sides():
    cred = scram.derive("s3cret")
    server = scram.ScramServer(_lookup({"bob": cred}))
    final = scram.client_exchange("bob", "s3cret", server)
    assert final.startswith("v=") and server.user == "bob"


def test_scram_with_a_wrong_password_fails_at_the_proof():
    server = scram.ScramServer(_lookup({"bob": scram.derive("s3cret")}))
    with pytest.raises(scram.AuthenticationFailed, match="wrong user name or password"):
        scram.client_exchange("bob", "guess", server)


def test_scram_for_an_unknown_user_looks_the_same_until_the_proof():
    key = b"k" * 32
    firsts = [scram.ScramServer(_lookup({}), key).first(b"n,,n=nobody,r=abc").decode()
              for _ in range(2)]
    salts = {dict(p.split("=", 1) for p in f.split(","))["s"] for f in firsts}
    assert len(salts) == 1, "an unknown user's salt changes between attempts"
    with pytest.raises(scram.AuthenticationFailed):
        scram.client_exchange("nobody", "x", scram.ScramServer(_lookup({}), key))


@pytest.mark.parametrize("first", [b"", b"p=tls-unique,,n=bob,r=x", b"n,,r=x", b"\xff\xfe",
                                   b"n,,n=bob,r=" + b"x" * scram.MESSAGE_BYTES_MAX])
def test_a_malformed_client_first_is_refused(first):
    with pytest.raises(scram.AuthenticationFailed):
        scram.ScramServer(_lookup({})).first(first)


def test_a_client_final_with_another_nonce_or_binding_is_refused():
    server = scram.ScramServer(_lookup({"bob": scram.derive("pw")}), nonce="SERVER")
    server.first(b"n,,n=bob,r=CLIENT")
    proof = base64.b64encode(b"\0" * 32).decode()
    with pytest.raises(scram.AuthenticationFailed, match="nonce"):
        server.final(f"c=biws,r=CLIENTOTHER,p={proof}".encode())
    with pytest.raises(scram.AuthenticationFailed, match="channel binding"):
        server.final(f"c=eSws,r=CLIENTSERVER,p={proof}".encode())


def test_plain_checks_the_password_against_the_scram_credential():
    lookup = _lookup({"bob": scram.derive("pw")})
    assert scram.check_plain(b"\0bob\0pw", lookup) == "bob"
    assert scram.check_plain(b"bob\0bob\0pw", lookup) == "bob"
    for bad in (b"\0bob\0nope", b"\0eve\0pw", b"bob\0pw", b"eve\0bob\0pw"):
        with pytest.raises(scram.AuthenticationFailed):
            scram.check_plain(bad, lookup)


# ---------------------------------------------------------------------- the users file
def test_users_file_round_trips_and_is_private(tmp_path):
    kafka_users.set_user(tmp_path, "alice", "pw-a")
    kafka_users.set_user(tmp_path, "ops", "pw-o", "admin")
    path = kafka_users.users_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    users = kafka_users.load(tmp_path)
    assert {u.name: u.role for u in users.values()} == {"alice": "client", "ops": "admin"}
    assert "pw-a" not in path.read_text()
    assert scram.check_plain(b"\0alice\0pw-a", lambda n: users[n].credential) == "alice"
    assert kafka_users.parse(kafka_users.format_users(users)) == users
    kafka_users.set_user(tmp_path, "alice", None)
    assert set(kafka_users.load(tmp_path)) == {"ops"}
    with pytest.raises(KeyFileError, match="no Kafka user"):
        kafka_users.set_user(tmp_path, "alice", None)


@pytest.mark.parametrize("line", [
    "bob client SCRAM-SHA-256 4096 c2FsdA==",                          # fields missing
    "bob root SCRAM-SHA-256 4096 c2FsdA== " + "QUFB" * 11 + "QQ== " + "QUFB" * 11 + "QQ==",
    "bob client SCRAM-SHA-1 4096 c2FsdA== AAAA AAAA",
    "bob client SCRAM-SHA-256 10 c2FsdA== AAAA AAAA",                   # too few iterations
    "bob client SCRAM-SHA-256 4096 c2FsdA== !!!! AAAA",                 # not base64
    "b/ob client SCRAM-SHA-256 4096 c2FsdA== AAAA AAAA",                # not a principal name
])
def test_a_malformed_users_line_is_named(line):
    with pytest.raises(KeyFileError, match="line 2"):
        kafka_users.parse("# users\n" + line + "\n")


def test_users_view_reloads_on_change_and_keeps_the_last_good_one(tmp_path):
    now = [0.0]
    kafka_users.set_user(tmp_path, "bob", "one")
    users = kafka_users.Users(tmp_path, clock=lambda: now[0])
    bob = users.lookup("bob")
    assert users.holds(bob)
    kafka_users.set_user(tmp_path, "bob", "two")          # a new password: the old login goes
    assert users.holds(bob), "looked at again before the reload interval"
    now[0] += kafka_users.USERS_RELOAD_INTERVAL_S
    assert not users.holds(bob)
    kafka_users.users_path(tmp_path).write_text("garbage line\n")
    now[0] += kafka_users.USERS_RELOAD_INTERVAL_S
    assert users.lookup("bob") is not None, "a broken file locked everyone out"


# ---------------------------------------------------------------------- certificates
def test_a_broker_certificate_is_trusted_through_the_ca(tmp_path):
    crt, key = certs.create_cert(tmp_path, "broker-0", ["127.0.0.1", "kafka.example"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    server = server_context(str(crt), str(key))
    client = ssl.create_default_context(cafile=str(certs.ca_path(tmp_path)))
    for host in ("127.0.0.1", "kafka.example"):
        _handshake(client, server, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(client, server, "other.example")


def _handshake(client_ctx, server_ctx, host: str) -> None:
    """A TLS handshake between two contexts through memory BIOs (no sockets)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client_ctx.wrap_bio(c_in, c_out, server_hostname=host)
    s = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, end in enumerate((c, s)):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done):
            return
    raise AssertionError("the handshake did not finish")


# ---------------------------------------------------------------------- authorization
class FakeConn:
    def __init__(self, principal):
        self.state = {"principal": principal}
        self.filled: list = []
        self.closed = None
        self.peer = "test"

    def fill(self, slot, reply) -> None:
        self.filled.append(reply)

    def close(self, why) -> None:
        self.closed = why


class Clock:
    def monotonic(self) -> float:
        return 0.0


def _context(*grants: list) -> Context:
    guard = Guard(daemon="broker")
    guard.acls.replace(Acl.parse(g) for g in grants)
    security = KafkaSecurity(tls=None, users=None, guard=guard)
    return Context(core=None, catalog=None, clock=Clock(), wake_at=lambda t: None,
                   settings=Settings(security=security))


def _call(key: int, version: int, body: dict, principal=Principal("bob", "client")) -> Call:
    entity = build(load_request_schema(key, version), body)
    return Call(FakeConn(principal), KafkaRequest(key, version, 1, "t", entity), slot=None)


def _produce(topics: list[str]) -> Call:
    return _call(0, 9, {"acks": -1, "timeout": 1000, "topic_data": [
        {"name": t, "partition_data": [{"index": 0, "records": b"xyz"}]} for t in topics]})


def test_a_produce_is_narrowed_to_the_topics_the_user_may_write():
    ctx = _context(["bob", "allow", "write", "stream", "mine", "literal"])
    call = _produce(["mine", "theirs"])
    assert authorize.admit(ctx, call)
    assert [t.name for t in call.body.topic_data] == ["mine"]
    answer = call.amend({"responses": [{"name": "mine", "partition_responses": [
        {"index": 0, "error_code": 0}]}]})
    refused = answer["responses"][1]
    assert refused["name"] == "theirs"
    assert refused["partition_responses"][0]["error_code"] == ErrorCode.topic_authorization_failed
    assert "kera acl add --principal bob --operation write --stream theirs" in \
        refused["partition_responses"][0]["error_message"]


def test_a_produce_to_no_allowed_topic_is_answered_without_the_handler():
    call = _produce(["theirs"])
    assert not authorize.admit(_context(), call)
    assert len(call.conn.filled) == 1


def test_an_admin_user_is_not_narrowed():
    call = _produce(["theirs"])
    assert authorize.admit(_context(), call.__class__(
        FakeConn(Principal("root", "admin")), call.req, None))


def test_a_join_group_without_read_on_the_group_is_group_authorization_failed():
    ctx = _context(["bob", "allow", "read", "stream", "t", "literal"])
    call = _call(11, 7, {"group_id": "g", "session_timeout": 10000, "rebalance_timeout": 10000,
                         "member_id": "", "protocol_type": "consumer", "protocols": []})
    assert not authorize.admit(ctx, call)
    assert call.conn.filled   # answered GROUP_AUTHORIZATION_FAILED


def test_a_metadata_listing_leaves_out_what_the_user_may_not_describe():
    ctx = _context(["bob", "allow", "read", "stream", "seen", "literal"])
    call = _call(3, 12, {"topics": None, "allow_auto_topic_creation": False})
    assert authorize.admit(ctx, call)
    answer = call.amend({"brokers": [], "topics": [{"name": "seen"}, {"name": "hidden"}]})
    assert [t["name"] for t in answer["topics"]] == ["seen"]


def test_describe_configs_of_the_broker_needs_describe_on_the_cluster():
    call = _call(32, 4, {"resources": [{"resource_type": 4, "resource_name": "0",
                                        "configuration_keys": None}]})
    assert not authorize.admit(_context(), call)
    assert call.conn.filled


def test_an_api_not_classified_closes_the_connection_of_a_client():
    call = _call(22, 4, {"transactional_id": None, "transaction_timeout": 1000})
    saved = authorize.RULES.pop(22)
    try:
        assert not authorize.admit(_context(), call)
    finally:
        authorize.RULES[22] = saved
    assert call.conn.closed


def test_every_advertised_api_is_classified():
    """A new API in apis.py needs its row in authorize.RULES, or secure clusters' clients
    (admins aside) have their connection closed when they call it."""
    from kera.broker.kafka import apis
    assert set(apis.APIS) | {apis.API_VERSIONS} == set(authorize.RULES)


def test_plaintext_is_not_authorized():
    call = _produce(["theirs"])
    ctx = _context()
    ctx.settings.security = None
    assert authorize.admit(ctx, call) and call.amend is None


# ---------------------------------------------------------------------- command line
def test_kera_keys_kafka_user_prints_the_client_properties(tmp_path, capsys):
    from kera.cli.main import main
    assert main(["keys", "kafka-cert", "broker-0", "--dir", str(tmp_path)]) == 0
    assert main(["keys", "kafka-user", "alice", "--dir", str(tmp_path), "--kafka-bootstrap",
                 "h:9092"]) == 0
    out = capsys.readouterr().out
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and
                 not line.startswith(("grant", " ")))
    assert props["security.protocol"] == "SASL_SSL" and props["sasl.username"] == "alice"
    assert props["bootstrap.servers"] == "h:9092"
    assert props["ssl.ca.location"] == str(certs.ca_path(tmp_path))
    users = kafka_users.load(tmp_path)
    password = props["sasl.password"].encode()
    assert scram.check_plain(b"\0alice\0" + password, lambda n: users[n].credential) == "alice"
    assert main(["keys", "kafka-user", "alice", "--dir", str(tmp_path), "--remove"]) == 0
    assert kafka_users.load(tmp_path) == {}


def test_a_secure_local_cluster_with_a_kafka_port_prints_sasl_ssl_properties(tmp_path):
    from kera.cli.local import KAFKA_USER, LocalCluster
    cluster = LocalCluster(tmp_path, brokers=2, secure=True, kafka_port=0, start=False)
    summary = cluster.kafka_summary()
    for line in ("security.protocol=SASL_SSL", "sasl.mechanism=SCRAM-SHA-256",
                 f"sasl.username={KAFKA_USER}", f"bootstrap.servers={cluster.kafka_bootstrap}",
                 f"ssl.ca.location={certs.ca_path(cluster.keys.dir)}"):
        assert line in summary.splitlines(), (line, summary)
    for i in range(2):
        assert certs.cert_paths(cluster.keys.dir, f"broker-{i}")[0].exists()
    assert KAFKA_USER in kafka_users.load(cluster.keys.dir)


# ---------------------------------------------------------------------- TLS connection shell
class FakeLoop:
    """What a Connection needs of kera.net.server.Server: watch and unwatch a descriptor."""

    def __init__(self):
        self.events = 0

    def watch(self, fd, on_event, events) -> None:
        self.events = events

    def unwatch(self, fd) -> None:
        self.events = 0


def test_a_tls_connection_handshakes_and_frames_on_the_loop(tmp_path):
    """The handshake and a request larger than one read (many TLS records, the last split
    across reads) go through a non-blocking Connection driven by readiness alone."""
    crt, key = certs.create_cert(tmp_path, "broker-0")
    ours, theirs = socket.socketpair()
    loop, frames, replies = FakeLoop(), [], []
    conn = Connection(ours, "peer", loop, lambda c, f: (frames.append(len(f)),
                                                       c.fill(c.reserve(), b"\0\0\0\x02ok")),
                      lambda c: None, server_context(str(crt), str(key)))
    payload = b"y" * (READ_BYTES + 5000)

    def client() -> None:
        ctx = ssl.create_default_context(cafile=str(certs.ca_path(tmp_path)))
        with ctx.wrap_socket(theirs, server_hostname="127.0.0.1") as s:
            s.sendall(struct.pack(">i", len(payload)))   # a record of its own: the later
            s.sendall(payload)                            # ones straddle READ_BYTES
            replies.append(s.recv(6))
    thread = threading.Thread(target=client)
    thread.start()
    for _ in range(10_000):
        if not thread.is_alive():
            break
        want_read, want_write = bool(loop.events & 1), bool(loop.events & 2)
        fd = conn.sock   # the TLS socket (wrapping detached `ours`)
        r, w, _ = select.select([fd] if want_read else [], [fd] if want_write else [], [], 0.05)
        if r or w:
            conn.on_event((1 if r else 0) | (2 if w else 0))
    thread.join(5)
    assert frames == [len(payload)] and replies == [b"\0\0\0\x02ok"]
    conn.close("done")
