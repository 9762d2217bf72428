"""A connection to an etcd cluster through its JSON gateway (etcd3gw), following its members.

`EtcdClient(endpoints)` sends each request to one member and, when that member is down or has
no leader (an election, a partition), tries the next, until ETCD_CALL_DEADLINE_S passes: a
3-member etcd with one member lost keeps serving the coordinator. A request etcd refuses (too
large, too many operations) is not retried. Failures are kera.errors.StorageError, so the
coordinator fail-stops as it does when its disk fails.

With `etcds://` every request is TLS (the CA and client certificate of an EtcdAccess, from the
`--etcd-*` flags: kera.coordinator.etcd_access). With an etcd user, the client logs in through
the gateway (/v3/auth/authenticate) and sends the token it gets with every request; etcd3gw has
no login of its own. A token etcd no longer takes (expired: `--auth-token-ttl`; or older than
a change to etcd's users and roles) is replaced by a new login within the same call. What etcd refuses because of the
flags (a wrong password, a CA that did not sign etcd's certificate, a role without the prefix)
is an EtcdAccessError naming the flag to fix, raised at once: no retry can mend it.

Only what the metadata store and the leader election need: a consistent paged read of a
prefix, one key, a transaction, and leases.
A retried transaction may have been applied already; the store's transactions set values and
compare a key they never write, so applying one twice changes nothing.
"""

from __future__ import annotations

import base64
import time
from urllib.parse import urlsplit

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

from kera.coordinator.etcd_access import EtcdAccess, EtcdAccessError
from kera.errors import StorageError

# One request to one member: a write commits within a few heartbeats of etcd's raft (100 ms by
# default), so a member that has not answered in this long is treated as lost.
ETCD_REQUEST_TIMEOUT_S = 3.0
# Connecting to one member: a reachable host accepts within milliseconds, so a member that has
# not in this long is down or cut off; short, so that a client whose first member is on a lost
# host reaches the next one within a lease renewal's deadline (leadership.RENEW_DEADLINE_S).
ETCD_CONNECT_TIMEOUT_S = 0.5
# All attempts of one call: long enough for etcd to elect a new leader after losing one
# (election timeout 1 s by default) and for a request to time out on a dead member first;
# past it the coordinator stops rather than hold its replies longer.
ETCD_CALL_DEADLINE_S = 10.0
ETCD_RETRY_PAUSE_S = 0.1          # after a round in which every member failed
# The deadline ends a call; this bounds the loop should the clock not move (a simulated one):
# a round of 3 instant failures per pause fills the deadline with about 300 attempts.
ETCD_ATTEMPTS_MAX = 400
RANGE_PAGE_KEYS = 1000            # keys per read: bounds one response
DEFAULT_PORT = 2379
URL_SCHEMES = ("etcd", "etcds")   # plaintext, TLS
# What etcd's gateway answers (its "error" text) when the flags, not a failure, are at fault.
# A token to replace by a new login: expired or unknown, or (a JWT token, `--auth-token jwt`)
# issued before users or roles changed, which etcd then refuses writes with.
TOKEN_STALE = ("invalid auth token", "revision of auth store is old")
AUTH_REQUIRED = "user name is empty"
AUTH_FAILED = "authentication failed"
AUTH_NOT_ENABLED = "authentication is not enabled"
PERMISSION_DENIED = "permission denied"
CERT_NAME_REFUSED = "CommonName of client"
CERT_UNTRUSTED = "CERTIFICATE_VERIFY_FAILED"
PLAINTEXT_REFUSED = "RemoteDisconnected"   # how a TLS-only etcd answers plain HTTP

KeyValue = tuple[str, str, int]   # key, value, mod revision

_RETRIABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
              etcd_errors.InternalServerError)


def parse_url(url: str) -> list[tuple[str, int]]:
    """`etcd://host:port[,host:port...]` (or etcds:// for TLS) -> [(host, port)].
    Raises ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in URL_SCHEMES or not parts.netloc or parts.path not in ("", "/"):
        raise ValueError(f"metadata URL {url!r}: expected etcd://HOST:PORT[,HOST:PORT...] "
                         f"(etcds:// for TLS)")
    endpoints = []
    for item in parts.netloc.split(","):
        host, _, port = item.rpartition(":")
        if not host:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"metadata URL {url!r}: bad endpoint {item!r} (HOST:PORT)")
        endpoints.append((host, int(port)))
    return endpoints


def _text(exc: Exception | None) -> str:
    return getattr(exc, "detail_text", None) or str(exc)


def _tls_hint(exc: Exception | None, access: EtcdAccess) -> str:
    """A hint when etcd closed the connection: it wants TLS, or a client certificate."""
    if exc is None:
        return ""
    if not access.tls and PLAINTEXT_REFUSED in _text(exc):
        return "; if etcd serves TLS (https client URLs), use --metadata etcds://..."
    if access.cert or not isinstance(exc.__context__, requests.exceptions.SSLError):
        return ""
    return "; etcd closed the TLS connection: if it asks for client certificates " \
           "(--client-cert-auth), give --etcd-cert and --etcd-key"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def prefix_end(prefix: str) -> str:
    """The first key after every key starting with `prefix` (etcd's range_end)."""
    raw = prefix.encode()
    return raw[:-1].decode() + chr(raw[-1] + 1)


def _session(access: EtcdAccess) -> requests.Session:
    session = requests.Session()
    # Not from the environment: $REQUESTS_CA_BUNDLE would replace --etcd-ca, and a proxy
    # variable would send the metadata (and the password) through a proxy.
    session.trust_env = False
    session.verify = access.ca or True
    if access.cert:
        session.cert = (access.cert, access.key)
    return session


class EtcdClient:
    """Requests to the members at `endpoints` ([(host, port)]), one at a time, reached and
    logged in to as `access` says."""

    def __init__(self, endpoints: list[tuple[str, int]], access: EtcdAccess = EtcdAccess(), *,
                 clock=time):
        assert endpoints, "at least one etcd endpoint"
        self.clock = clock
        self.access = access
        timeout = (ETCD_CONNECT_TIMEOUT_S, ETCD_REQUEST_TIMEOUT_S)
        protocol = "https" if access.tls else "http"
        self.members = [etcd3gw.Etcd3Client(host=h, port=p, protocol=protocol, timeout=timeout,
                                            api_path="/v3/", session=_session(access))
                        for h, p in endpoints]
        self.current = 0    # the member that answered last: asked first
        self.token: str | None = None   # etcd's auth token, once logged in

    def names(self) -> str:
        return ",".join(f"{m.host}:{m.port}" for m in self.members)

    def call(self, path: str, body: dict, deadline_s: float = ETCD_CALL_DEADLINE_S) -> dict:
        """POST `body` to the v3 API `path` ("kv/range", "kv/txn") on a member that answers,
        trying members in turn for up to `deadline_s`."""
        started = self.clock.monotonic()
        deadline = started + deadline_s
        last: Exception | None = None
        for attempt in range(ETCD_ATTEMPTS_MAX):
            member = self.members[self.current]
            try:
                return member.post(member.get_url(path), json=body,
                                   headers=self._auth_header(member))
            except _RETRIABLE as exc:
                self._check_tls(member, exc)
                last = exc
            except etcd_errors.Etcd3Exception as exc:
                if not any(marker in _text(exc) for marker in TOKEN_STALE):
                    raise self._refused(member, path, exc) from None
                self.token, last = None, exc   # log in again on the next attempt
            self.current = (self.current + 1) % len(self.members)
            if self.clock.monotonic() >= deadline:
                break
            if self.current == 0:
                self.clock.sleep(ETCD_RETRY_PAUSE_S)
        raise StorageError(f"etcd at {self.names()} ({self.access.describe()}) did not "
                           f"answer {path} in "
                           f"{self.clock.monotonic() - started:.1f} s, {attempt + 1} attempts "
                           f"({type(last).__name__}: {_text(last)}): check that a "
                           f"majority of its members is up (etcdctl endpoint health)"
                           f"{_tls_hint(last, self.access)}")

    def _auth_header(self, member) -> dict:
        """{"Authorization": token} when logging in as an etcd user (logging in first)."""
        if self.access.user is None:
            return {}
        if self.token is None:
            reply = member.post(member.get_url("auth/authenticate"),
                                json={"name": self.access.user, "password": self.access.password})
            self.token = reply["token"]
        return {"Authorization": self.token}

    def _check_tls(self, member, exc: Exception) -> None:
        """Raise EtcdAccessError when `member`'s certificate is not one the CA vouches for."""
        if isinstance(exc.__context__, requests.exceptions.SSLError) and \
                CERT_UNTRUSTED in _text(exc):
            if self.access.ca:
                given = f"--etcd-ca {self.access.ca} did not sign it, or it does not name " \
                        f"{member.host}"
            else:
                given = "give --etcd-ca FILE, the CA that signed it"
            raise EtcdAccessError(f"etcd {member.host}:{member.port}'s TLS certificate is not "
                                  f"trusted ({given}): {_text(exc)}") from None

    def _refused(self, member, path: str, exc: Exception) -> StorageError:
        """The error for an answer no retry mends; an EtcdAccessError when the flags are why."""
        text, where = _text(exc), f"etcd {member.host}:{member.port}"
        user = self.access.user
        fixes = [
            (AUTH_REQUIRED, "requires authentication: give --etcd-user NAME and its password "
                            "(--etcd-password-file FILE or $KERA_ETCD_PASSWORD)"),
            (AUTH_FAILED, f"refused the login of etcd user {user!r}: a wrong password or no "
                          f"such user (etcdctl user get {user})"),
            (AUTH_NOT_ENABLED, "has authentication off, so whoever reaches it may rewrite "
                               "kera's metadata: turn it on (etcdctl auth enable; "
                               "docs/SECURITY.md) or drop --etcd-user"),
            (PERMISSION_DENIED, f"refused {path} to etcd user {user!r}: grant its role "
                                f"readwrite on kera's keys (etcdctl role grant-permission "
                                f"ROLE readwrite /kera/ --prefix)"),
            (CERT_NAME_REFUSED, "refuses a client certificate with a common name while "
                                "authentication is on: issue --etcd-cert without one")]
        for marker, fix in fixes:
            if marker in text:
                return EtcdAccessError(f"{where} {fix} ({text.strip()})")
        return StorageError(f"{where} refused {path}: {text}")

    def check_access(self, prefix: str, deadline_s: float) -> None:
        """Read one key of `prefix` as this client will: raises EtcdAccessError when etcd
        refuses the flags, StorageError when it does not answer within `deadline_s`."""
        self.call("kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix)),
                               "limit": 1, "keys_only": True}, deadline_s)

    def read_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every (key, value, mod revision) under `prefix` at one revision (`revision`, or
        the latest when 0), in pages; and that revision."""
        out: list[KeyValue] = []
        start, end = b64(prefix), b64(prefix_end(prefix))
        while True:   # ends: each page starts after the last key of the one before
            reply = self.call("kv/range", {"key": start, "range_end": end,
                                           "limit": RANGE_PAGE_KEYS, "revision": revision})
            revision = int(reply["header"]["revision"])
            kvs = reply.get("kvs", [])
            out += [(unb64(kv["key"]), unb64(kv.get("value", "")), int(kv["mod_revision"]))
                    for kv in kvs]
            if not reply.get("more") or not kvs:
                return out, revision
            start = b64(unb64(kvs[-1]["key"]) + "\x00")

    def txn(self, compare: list[dict], success: list[dict]) -> tuple[bool, int]:
        """Run a transaction: (whether its compares held, the revision after it)."""
        reply = self.call("kv/txn", {"compare": compare, "success": success})
        # The gateway leaves out fields at their zero value: an absent `succeeded` is false.
        return bool(reply.get("succeeded", False)), int(reply["header"]["revision"])

    def get(self, key: str) -> tuple[str, int] | None:
        """(value, mod revision) of one key, or None when it does not exist."""
        kvs = self.call("kv/range", {"key": b64(key)}).get("kvs", [])
        return (unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])) if kvs else None

    # ------------------------------------------------------------------ leases
    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id."""
        return int(self.call("lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def lease_keepalive(self, lease_id: int, deadline_s: float) -> int:
        """Renew a lease: its new TTL in seconds, 0 when it already expired."""
        reply = self.call("lease/keepalive", {"ID": lease_id}, deadline_s)
        return int(reply.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease_id: int) -> None:
        """End a lease now: the keys attached to it are deleted."""
        self.call("kv/lease/revoke", {"ID": lease_id})

    def close(self) -> None:
        for member in self.members:
            member.session.close()
