"""Key files and the keys directory (kera.net.keys): created private, refused when not."""

import os
import stat

import pytest
import zmq

from kera.net import keys
from kera.net.security import Keyring


def test_create_writes_private_secret_and_public_key_under_its_role(tmp_path):
    secret = keys.create_key(tmp_path, "alice", "client")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert (tmp_path / "public" / "client" / "alice.key").exists()
    pair = keys.load_key_file(secret)
    assert (pair.name, pair.role) == ("alice", "client")
    server_public, _ = zmq.auth.load_certificate(tmp_path / "cluster.key")
    assert pair.server_key == server_public
    principals = keys.load_principals(tmp_path)
    assert principals[pair.public] == keys.Principal("alice", "client")
    assert len(principals) == 1   # the cluster key is not a principal


def test_a_name_is_used_once_and_names_and_roles_are_checked(tmp_path):
    keys.create_key(tmp_path, "alice", "client")
    with pytest.raises(keys.KeyFileError, match="already exists"):
        keys.create_key(tmp_path, "alice", "admin")
    with pytest.raises(keys.KeyFileError, match="role"):
        keys.create_key(tmp_path, "bob", "superuser")
    with pytest.raises(keys.KeyFileError, match="principal name"):
        keys.create_key(tmp_path, "../bob", "client")


def test_a_secret_readable_by_others_is_refused(tmp_path):
    secret = keys.create_key(tmp_path, "alice", "client")
    os.chmod(secret, 0o644)
    with pytest.raises(keys.KeyFileError, match="chmod 600"):
        keys.load_key_file(secret)


def test_client_keys_come_from_the_argument_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.KEY_FILE_ENV, raising=False)
    assert keys.client_keys() is None
    secret = keys.create_key(tmp_path, "alice", "client")
    monkeypatch.setenv(keys.KEY_FILE_ENV, str(secret))
    assert keys.client_keys().name == "alice"
    with pytest.raises(keys.KeyFileError):
        keys.client_keys(tmp_path / "public" / "client" / "alice.key")   # public half only


def test_keyring_sees_new_and_revoked_keys(tmp_path):
    keys.create_key(tmp_path, "alice", "client")
    now = [0.0]
    ring = Keyring(tmp_path, clock=lambda: now[0])
    bob = keys.load_key_file(keys.create_key(tmp_path, "bob", "client"))
    now[0] += 2.0
    assert ring.lookup(bob.public) == keys.Principal("bob", "client")
    (tmp_path / "public" / "client" / "bob.key").unlink()
    now[0] += 2.0
    assert ring.lookup(bob.public) is None


def test_metadata_values_may_hold_the_comment_character(tmp_path):
    # z85 (the keys' alphabet) includes '#' and '=': only whole lines are comments.
    path = tmp_path / "x.key_secret"
    path.write_text('#   a comment\nmetadata\n    server-key = "ab#c=d"\n    role = "client"\n'
                    'curve\n    public-key = "p"\n')
    assert keys._metadata(path) == {"server-key": "ab#c=d", "role": "client"}


def test_refusals_of_unknown_keys_are_logged_once_a_minute_not_once_each(tmp_path, caplog):
    import logging

    import zmq
    from zmq.utils import z85

    from kera.net.security import Keyring, ZapHandler
    keys.create_key(tmp_path, "alice", "client")
    ctx = zmq.Context()
    zap = ZapHandler(ctx, Keyring(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="kera.net.security"):
            for i in range(1000):
                assert zap.callback("global", z85.encode(i.to_bytes(32, "big"))) is False
        assert zap.refused == 1000
        assert len([r for r in caplog.records if "refused a connection" in r.getMessage()]) == 1
    finally:
        ctx.destroy(linger=0)


def test_a_public_key_folder_others_may_write_is_warned_of(tmp_path, caplog):
    import logging
    keys.create_key(tmp_path, "alice", "client")
    folder = tmp_path / "public" / "client"
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kera.net.security"):
        Keyring(tmp_path)
    assert any(str(folder) in r.getMessage() and "chmod go-w" in r.getMessage()
               for r in caplog.records)
    folder.chmod(0o755)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kera.net.security"):
        Keyring(tmp_path)
    assert not any("writable by other" in r.getMessage() for r in caplog.records)
