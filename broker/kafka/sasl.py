"""SASL on the Kafka listener: SaslHandshake and SaslAuthenticate, and the rule that a
connection of a secure listener does nothing else until its user is authenticated.

A secure cluster's listener is SASL_SSL: TLS first (kera.broker.kafka.connection), then a
SASL login, PLAIN or SCRAM-SHA-256 (kera.net.scram), against the users file of the keys
directory (kera.net.kafka_users). Before the login a connection may send ApiVersions,
SaslHandshake and SaslAuthenticate only; anything else closes it, as Kafka does. A failed
login is answered SASL_AUTHENTICATION_FAILED, with why, and the connection is closed once the
answer is sent. The authenticated user is the kera principal ROLE:NAME that ACLs and quotas
name (kera.broker.kafka.authorize). Every later request checks the user is still in the
users file with the same password: removing a user refuses it at once, on every connection.
"""

from __future__ import annotations

import logging
import secrets
import ssl
from dataclasses import dataclass

from kio.schema.errors import ErrorCode

from kera.broker.kafka.connection import Connection
from kera.broker.kafka.context import Call, Context
from kera.net.access import Guard
from kera.net.kafka_users import User, Users
from kera.net.keys import Principal
from kera.net.scram import MECHANISMS, PLAIN, AuthenticationFailed, ScramServer, check_plain

log = logging.getLogger(__name__)

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
BEFORE_LOGIN = frozenset({API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE})
# How long a connection may take from accept to a completed login (TLS handshake included);
# then it is closed. Kafka's clients log in within a few round trips; a client that stalls
# holds a descriptor, and CONNECTIONS_MAX bounds how many.
LOGIN_TIMEOUT_S = 10.0


@dataclass
class KafkaSecurity:
    """What a SASL_SSL listener holds: its TLS context, the users, and the broker's Guard
    (the ACLs and quotas the coordinator sends the broker, kera.net.access)."""
    tls: ssl.SSLContext
    users: Users
    guard: Guard
    # Keys the decoy salts of unknown SCRAM users (kera.net.scram.ScramServer._decoy).
    decoy_key: bytes = b""

    def __post_init__(self):
        self.decoy_key = self.decoy_key or secrets.token_bytes(32)


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """The listener's TLS context: TLS 1.2 or later, the broker's certificate and key."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def principal(conn: Connection) -> Principal | None:
    """Who a connection logged in as (None: not logged in, or a plaintext listener)."""
    return conn.state.get("principal")


def admit(ctx: Context, conn: Connection, api_key: int) -> bool:
    """Whether the request may go on: False (and the connection closed) for anything but the
    login's requests before the login, or from a user removed since it logged in."""
    security = ctx.settings.security
    if security is None:
        return True
    user: User | None = conn.state.get("user")
    if user is None:
        if api_key in BEFORE_LOGIN:
            return True
        why = f"api key {api_key} before a SASL login: authenticate first (SASL_SSL)"
    elif security.users.holds(user):
        return True
    else:
        why = f"Kafka user {user.name!r} was removed or its password changed: log in again"
    log.info("kafka listener: closing %s: %s", conn.peer, why)
    conn.close(why)
    return False


def handle_sasl_handshake(ctx: Context, call: Call) -> None:
    mechanisms = list(MECHANISMS) if ctx.settings.security is not None else []
    state = call.conn.state
    mechanism = call.body.mechanism
    if "user" in state or "mechanism" in state:
        _refuse(call, ErrorCode.illegal_sasl_state, "SaslHandshake after a login began",
                {"mechanisms": mechanisms})
        return
    if mechanism not in mechanisms:
        why = (f"SASL mechanism {mechanism!r} is not enabled here (enabled: "
               f"{', '.join(mechanisms) or 'none: this listener is plaintext'})")
        _refuse(call, ErrorCode.unsupported_sasl_mechanism, why, {"mechanisms": mechanisms})
        return
    state["mechanism"] = mechanism
    if mechanism != PLAIN:
        security = ctx.settings.security
        state["scram"] = ScramServer(security.users.credential, security.decoy_key)
    call.answer({"error_code": ErrorCode.none, "mechanisms": mechanisms})


def handle_sasl_authenticate(ctx: Context, call: Call) -> None:
    state = call.conn.state
    if "mechanism" not in state or "user" in state:
        _refuse(call, ErrorCode.illegal_sasl_state,
                "SaslAuthenticate needs a SaslHandshake first, and comes before a login ends")
        return
    try:
        reply, name = _step(ctx, state, bytes(call.body.auth_bytes))
        if name is not None:
            _logged_in(ctx, call.conn, name)
    except AuthenticationFailed as exc:
        log.info("kafka listener: SASL login from %s failed: %s", call.conn.peer, exc)
        _refuse(call, ErrorCode.sasl_authentication_failed, str(exc))
        return
    call.answer({"error_code": ErrorCode.none, "auth_bytes": reply, "session_lifetime": 0})


def _step(ctx: Context, state: dict, message: bytes) -> tuple[bytes, str | None]:
    """(bytes to answer, the user once the login is done) of one SASL message."""
    users = ctx.settings.security.users
    if state["mechanism"] == PLAIN:
        return b"", check_plain(message, users.credential)
    scram: ScramServer = state["scram"]
    if "scram_first" not in state:
        state["scram_first"] = True
        return scram.first(message), None
    return scram.final(message), scram.user


def _logged_in(ctx: Context, conn: Connection, name: str) -> None:
    user = ctx.settings.security.users.lookup(name)
    if user is None:   # removed between the two SCRAM messages
        raise AuthenticationFailed(f"Kafka user {name!r} no longer exists")
    conn.state["user"] = user
    conn.state["principal"] = Principal(user.name, user.role)
    for key in ("scram", "scram_first"):
        conn.state.pop(key, None)
    log.info("kafka listener: %s logged in as %s (%s)", conn.peer, conn.state["principal"],
             conn.state["mechanism"])


def expired(conn: Connection, now: float) -> bool:
    """Whether a connection is past LOGIN_TIMEOUT_S without a login (closed by the listener)."""
    return "user" not in conn.state and now - conn.state["opened_s"] > LOGIN_TIMEOUT_S


def _refuse(call: Call, code: ErrorCode, why: str, more: dict | None = None) -> None:
    call.answer({"error_code": code, "error_message": why, **(more or {})})
    call.conn.close_after_replies(why)
