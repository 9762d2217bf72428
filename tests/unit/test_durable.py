"""Durable small files: checked one-line files refuse damage; removals sync their directory;
the broker's marker files (first retained group, clean shutdown) carry checksums."""

import os

from kera.daemon import durable
from kera.broker import tier_files


def test_checked_file_round_trip_and_damage(tmp_path):
    path = tmp_path / "f"
    durable.write_checked(path, "12345")
    assert durable.read_checked(path) == "12345"
    data = bytearray(path.read_bytes())
    data[2] ^= 0x01                                   # one flipped bit: "12245"-ish
    path.write_bytes(bytes(data))
    assert durable.read_checked(path) is None
    path.write_bytes(b"12345\n")                      # no checksum line (torn, or hand-made)
    assert durable.read_checked(path) is None


def test_unlink_durable_syncs_each_directory_once(tmp_path, monkeypatch):
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "b").write_bytes(b"y")
    synced = []
    monkeypatch.setattr(durable, "fsync_dir", lambda d: synced.append(d))
    assert durable.unlink_durable(tmp_path / "a", tmp_path / "b", tmp_path / "missing") == 2
    assert synced == [tmp_path] and not os.listdir(tmp_path)


def test_first_group_marker_is_checked(tmp_path):
    tier_files.write_first_group(tmp_path, 4, 1, 17)
    assert tier_files.read_first_groups(tmp_path) == {(4, 1): 17}
    path = tier_files.streamlet_dir(tmp_path, 4, 1) / tier_files.FIRST_GROUP_FILE
    path.write_bytes(path.read_bytes().replace(b"17", b"71"))
    assert tier_files.read_first_groups(tmp_path) == {}   # damaged: ignored, logged


def test_clean_shutdown_marker_is_checked(tmp_path):
    marker = tmp_path / "clean_shutdown"
    assert not tier_files.marker_ok(marker)
    tier_files.write_marker(marker)
    assert tier_files.marker_ok(marker)
    marker.write_bytes(b"")                            # torn: not a clean shutdown
    assert not tier_files.marker_ok(marker)
