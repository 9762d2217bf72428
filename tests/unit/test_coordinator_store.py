"""The coordinator's metadata file: atomic replace, round trip, refusal of garbage."""

import json
import os

import pytest

from kera.coordinator import store
from kera.coordinator.core import Coordinator


def populated() -> Coordinator:
    c = Coordinator(0.0)
    for i in range(2):
        c.handle("register", {"kind": "broker", "address": f"127.0.0.1:{7100 + i}", "node": "n"}, 0.0)
    c.handle("register", {"kind": "backup", "address": "127.0.0.1:7200", "node": "m"}, 0.0)
    c.handle("create_stream", {"name": "s", "streamlets": 3, "replication": 2}, 0.0)
    return c


def test_first_start_has_no_state(tmp_path):
    assert store.load(tmp_path) is None


def test_save_load_round_trip(tmp_path):
    c = populated()
    store.save(tmp_path, c.to_state())
    assert store.load(tmp_path) == c.to_state()
    # No temp file left behind: the snapshot and the (empty) change log after it.
    assert sorted(os.listdir(tmp_path)) == [store.log_name(1), store.STATE_FILE]
    restored = Coordinator(5.0, state=store.load(tmp_path))
    assert restored.describe_stream("s")["placement"] == c.describe_stream("s")["placement"]


def test_save_replaces_whole_file(tmp_path):
    c = populated()
    store.save(tmp_path, c.to_state())
    c.handle("delete_stream", {"name": "s"}, 0.0)
    store.save(tmp_path, c.to_state())
    assert store.load(tmp_path)["streams"] == []


def test_a_stale_temp_file_is_ignored(tmp_path):
    c = populated()
    store.save(tmp_path, c.to_state())
    (tmp_path / (store.STATE_FILE + ".tmp")).write_bytes(b"{half a wri")  # crash mid-write
    assert store.load(tmp_path) == c.to_state()
    store.save(tmp_path, c.to_state())
    assert store.load(tmp_path) == c.to_state()


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_garbage_file_is_refused(tmp_path, content):
    (tmp_path / store.STATE_FILE).write_bytes(content)
    with pytest.raises(ValueError):
        store.load(tmp_path)


def test_file_is_plain_json(tmp_path):
    store.save(tmp_path, populated().to_state())
    state = json.loads((tmp_path / store.STATE_FILE).read_text())
    assert state["streams"][0]["name"] == "s"
