"""Fence tokens (kera.net.fence): a backup of a secure cluster fences only incarnations the
coordinator failed over and signed for (backup.broker_keys); the coordinator hands the key to
backups and the tokens to the recovering brokers (kera.coordinator.core)."""

import pytest

from kera.backup.broker_keys import BrokerKeys
from kera.errors import NotAuthorized, NotReady
from kera.net.fence import fence_key_from, fence_token
from kera.net.keys import Principal

BROKER_1 = Principal("broker", "broker-1")


def keys_with(key: str) -> BrokerKeys:
    k = BrokerKeys()
    k.update_fence_key(key)
    return k


def test_a_signed_fence_passes_and_a_forged_or_unsigned_one_does_not():
    key = fence_key_from("one coordinator")
    k = keys_with(key)
    k.check_fence(BROKER_1, 0, [3, 4], [fence_token(key, 0, 3), fence_token(key, 0, 4)])
    with pytest.raises(NotAuthorized, match=r"epoch\(s\) \[4\]"):
        k.check_fence(BROKER_1, 0, [3, 4], [fence_token(key, 0, 3), fence_token(key, 1, 4)])
    with pytest.raises(NotAuthorized, match=r"\[3\]"):
        k.check_fence(BROKER_1, 0, [3], None)
    with pytest.raises(NotAuthorized):
        keys_with(fence_key_from("another")).check_fence(BROKER_1, 0, [3], [fence_token(key, 0, 3)])


def test_plaintext_and_listing_need_no_token_and_an_unkeyed_backup_asks_to_retry():
    BrokerKeys().check_fence(None, 0, [3], None)
    keys_with(fence_key_from("another")).check_fence(BROKER_1, 0, [], None)
    with pytest.raises(NotReady):
        BrokerKeys().check_fence(BROKER_1, 0, [3], ["x"])
