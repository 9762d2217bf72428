"""SASL for Kafka clients, sans-IO: the server's side of PLAIN and SCRAM-SHA-256 (RFC 5802,
RFC 7677) against stored SCRAM credentials.

Only the salted, hashed form of a password is stored (`Credential`: salt, iterations,
StoredKey, ServerKey), as Kafka stores SCRAM users; PLAIN derives the same keys from the
password it is sent and compares them, so one stored form serves both mechanisms and no
password is kept anywhere. An exchange is an object fed the client's messages (bytes in),
answering the bytes to send back; a wrong password or a malformed message raises
`AuthenticationFailed` with a message fit for the client (it never says whether the user
exists).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

PLAIN = "PLAIN"
SCRAM_SHA_256 = "SCRAM-SHA-256"
MECHANISMS = (PLAIN, SCRAM_SHA_256)
# PBKDF2 rounds of a new credential: Kafka's default for SCRAM users is 4096 (RFC 7677's
# minimum); each login costs the broker this many HMACs (~2 ms), each guess an attacker the same.
ITERATIONS = 4096
ITERATIONS_MIN = 4096
ITERATIONS_MAX = 1_000_000    # a stored count above it is refused: one login must stay cheap
SALT_BYTES = 16
NONCE_BYTES = 18
# A SASL message larger than this is refused: a SCRAM message is a few hundred bytes.
MESSAGE_BYTES_MAX = 4096
PASSWORD_BYTES = 18           # a generated password: 144 random bits, 24 URL-safe characters


class AuthenticationFailed(Exception):
    """The client did not prove who it says it is (answered SASL_AUTHENTICATION_FAILED)."""


@dataclass(frozen=True)
class Credential:
    """A user's stored SCRAM-SHA-256 credential (RFC 5802 section 3)."""
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes


def new_password() -> str:
    return secrets.token_urlsafe(PASSWORD_BYTES)


def derive(password: str, salt: bytes | None = None, iterations: int = ITERATIONS) -> Credential:
    """The stored credential of `password` (a new random salt unless given)."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = _hmac(salted, b"Client Key")
    return Credential(salt, iterations, hashlib.sha256(client_key).digest(),
                      _hmac(salted, b"Server Key"))


def check_plain(message: bytes, lookup) -> str:
    """The user a PLAIN message (`authzid NUL user NUL password`) authenticates, checked
    against `lookup(user) -> Credential | None`."""
    parts = message.split(b"\0")
    if len(parts) != 3 or len(message) > MESSAGE_BYTES_MAX:
        raise AuthenticationFailed("malformed PLAIN message: expected authzid NUL user NUL password")
    authzid, user, password = (p.decode("utf-8", "replace") for p in parts)
    if authzid and authzid != user:
        raise AuthenticationFailed("PLAIN: authorizing as another user is not supported")
    cred = lookup(user)
    if cred is None or not _same(derive(password, cred.salt, cred.iterations), cred):
        raise AuthenticationFailed(f"authentication failed for user {user!r}: wrong user name "
                                   "or password")
    return user


class ScramServer:
    """One SCRAM-SHA-256 exchange: `first(client_first) -> server_first`, then
    `final(client_final) -> server_final`; `user` is authenticated once `final` returns."""

    def __init__(self, lookup, fake_salt_key: bytes | None = None, nonce: str | None = None):
        self.lookup = lookup                  # user -> Credential | None
        self.fake_salt_key = fake_salt_key or secrets.token_bytes(32)
        self.nonce = nonce or base64.b64encode(secrets.token_bytes(NONCE_BYTES)).decode()
        self.user: str | None = None
        self.cred: Credential | None = None
        self._first_bare = self._server_first = ""

    def first(self, message: bytes) -> bytes:
        text = _text(message)
        gs2_header, bare = _split_gs2(text)
        attrs = _attributes(bare)
        if "n" not in attrs or "r" not in attrs:
            raise AuthenticationFailed("malformed SCRAM client-first message: no n= or r=")
        self.user = attrs["n"].replace("=2C", ",").replace("=3D", "=")
        self.cred = self.lookup(self.user) or self._decoy()
        self.nonce = attrs["r"] + self.nonce
        self._gs2 = gs2_header
        self._first_bare = bare
        salt = base64.b64encode(self.cred.salt).decode()
        self._server_first = f"r={self.nonce},s={salt},i={self.cred.iterations}"
        return self._server_first.encode()

    def final(self, message: bytes) -> bytes:
        if self.cred is None:
            raise AuthenticationFailed("SCRAM client-final message before client-first")
        text = _text(message)
        without_proof, _, proof_part = text.rpartition(",p=")
        attrs = _attributes(without_proof)
        if not proof_part or attrs.get("r") != self.nonce:
            raise AuthenticationFailed("malformed SCRAM client-final message (nonce or proof)")
        if _b64(attrs.get("c", "")) != self._gs2.encode():
            raise AuthenticationFailed("SCRAM channel binding does not match the client-first")
        auth_message = f"{self._first_bare},{self._server_first},{without_proof}".encode()
        proof = _b64(proof_part)
        signature = _hmac(self.cred.stored_key, auth_message)
        if len(proof) != len(signature):
            raise AuthenticationFailed("malformed SCRAM proof")
        client_key = bytes(a ^ b for a, b in zip(proof, signature))
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), self.cred.stored_key):
            raise AuthenticationFailed(f"authentication failed for user {self.user!r}: wrong "
                                       "user name or password")
        verifier = base64.b64encode(_hmac(self.cred.server_key, auth_message)).decode()
        return f"v={verifier}".encode()

    def _decoy(self) -> Credential:
        """An unknown user gets a salt that looks real and is the same on every attempt, and
        fails at the proof: the exchange does not tell who exists."""
        salt = _hmac(self.fake_salt_key, (self.user or "").encode())[:SALT_BYTES]
        return Credential(salt, ITERATIONS, secrets.token_bytes(32), secrets.token_bytes(32))


def client_exchange(user: str, password: str, server, nonce: str | None = None) -> str:
    """A whole SCRAM-SHA-256 exchange from the client's side against `server` (a ScramServer):
    for tests and for checking a stored credential; returns the server's final message."""
    nonce = nonce or secrets.token_urlsafe(NONCE_BYTES)
    bare = f"n={user},r={nonce}"
    server_first = server.first(f"n,,{bare}".encode()).decode()
    attrs = _attributes(server_first)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), _b64(attrs["s"]), int(attrs["i"]))
    client_key = _hmac(salted, b"Client Key")
    without_proof = f"c=biws,r={attrs['r']}"
    auth_message = f"{bare},{server_first},{without_proof}".encode()
    signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature))).decode()
    return server.final(f"{without_proof},p={proof}".encode()).decode()


def _same(a: Credential, b: Credential) -> bool:
    return hmac.compare_digest(a.stored_key, b.stored_key)


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _text(message: bytes) -> str:
    if len(message) > MESSAGE_BYTES_MAX:
        raise AuthenticationFailed(f"a SCRAM message of {len(message)} bytes: at most "
                                   f"{MESSAGE_BYTES_MAX}")
    try:
        return message.decode("utf-8")
    except UnicodeDecodeError:
        raise AuthenticationFailed("a SCRAM message that is not UTF-8") from None


def _split_gs2(text: str) -> tuple[str, str]:
    """(gs2 header with its trailing comma, client-first-bare); channel binding refused."""
    flag, comma, rest = text.partition(",")
    authzid, comma2, bare = rest.partition(",")
    if not comma or not comma2 or flag not in ("n", "y"):
        raise AuthenticationFailed("malformed SCRAM client-first message: expected 'n,,n=USER,r=NONCE'")
    return f"{flag},{authzid},", bare


def _attributes(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if eq and len(key) == 1:
            out.setdefault(key, value)
    return out


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise AuthenticationFailed("malformed base64 in a SCRAM message") from None
