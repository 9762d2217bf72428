"""Fence tokens: proof that the coordinator failed a broker incarnation over.

A recovering broker fences the dead incarnation's replicas on every backup (`list_replicas`
with `fence`), so that incarnation can write no more. A broker key alone must not be enough
for that: broker 0's key could otherwise fence broker 1's live incarnation and stop its
writes. The coordinator holds a secret key, hands it to backups over their authenticated
connection, and gives each recovering broker a token per incarnation it failed over: an HMAC
of (broker, epoch) under that key. A backup of a secure cluster fences only incarnations whose
token it can verify, so no broker can fence one the coordinator did not fail over.
"""

from __future__ import annotations

import hashlib
import hmac

# 256 bits of key, as hex; tokens are HMAC-SHA256 cut to 128 bits (forging one is 2^128 tries).
FENCE_KEY_BYTES = 32
FENCE_TOKEN_CHARS = 32


def fence_key_from(secret: str) -> str:
    """A key from another secret (the coordinator's token source: random, or seeded in a
    simulation), distinct from any token it issues."""
    return hashlib.sha256(f"kera fence key:{secret}".encode()).hexdigest()


def fence_token(key: str, broker_id: int, epoch: int) -> str:
    digest = hmac.new(bytes.fromhex(key), f"fence:{broker_id}:{epoch}".encode(), hashlib.sha256)
    return digest.hexdigest()[:FENCE_TOKEN_CHARS]


def valid_token(key: str | None, broker_id: int, epoch: int, token) -> bool:
    """Whether `token` proves (broker_id, epoch) was failed over (False without a key)."""
    if key is None or not isinstance(token, str):
        return False
    return hmac.compare_digest(fence_token(key, broker_id, epoch), token)
