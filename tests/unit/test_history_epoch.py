"""Streamlet history epochs: the broker core's check of a cursor's epoch, the epoch file, and
the consumer's position encoding (kera.broker.history_epoch, kera.codec.position, consumer.cursor)."""

import pytest

from kera.codec import chunk
from kera.broker import history_epoch, reload
from kera.broker.core import Broker, BrokerConfig
from kera.consumer.cursor import ConsumedCursor, FetchCursor, cursors_with_epochs
from kera.errors import BadRequest
from kera.codec.position import Position

from tests.unit.test_broker_core import ME, desc


def broker(epoch, **d):
    b = Broker("n1", BrokerConfig(), broker_id=ME)
    b.set_epoch(epoch)
    b.apply_metadata([desc(**d)], 1)
    return b


def read(b, cur, sl=0):
    epochs: list = []
    results, frames = b.reads.fetch([[1, sl, cur, 1 << 20]], epochs)
    return results[0], epochs[0], frames


def test_a_new_r1_history_takes_the_incarnation_epoch_and_is_recorded():
    b = broker(5)
    b.produce("p", [chunk.encode(1, 0, 1, 0, [b"v"] * 3)], 0.0)
    assert b.reads.history_epoch(1, 0) == 5
    assert b.take_new_histories() == [(1, 0, 5)] and b.take_new_histories() == []


def test_a_replicated_history_has_the_constant_epoch():
    b = broker(5, R=2)
    assert history_epoch.epoch_for_new_history(2, 5) == history_epoch.REPLICATED_EPOCH
    assert b.reads.history_epoch(1, 0) is None   # no data yet


def test_fetch_checks_the_cursor_epoch():
    b = broker(5)
    b.produce("p", [chunk.encode(1, 0, 1, 0, [b"v"] * 3)], 0.0)
    (err, n, _), epoch, frames = read(b, {"low": 0, "offsets": {}, "epoch": 5})
    assert err is None and n == 1 and epoch == 5
    (err, n, _), epoch, frames = read(b, {"low": 0, "offsets": {0: 2}, "epoch": 4})
    assert err[0] == "position_lost" and err[2] is False and n == 0 and frames == []
    assert "'s1' streamlet 0" in err[1] and "epoch 4" in err[1] and "epoch 5" in err[1]
    (err, n, _), _, _ = read(b, {"low": 0, "offsets": {0: 2}})   # no epoch: unchecked
    assert err is None and n == 1


def test_an_r1_streamlet_with_no_history_refuses_a_position_of_an_old_one():
    b = broker(5)
    (err, _, _), _, _ = read(b, {"low": 0, "offsets": {0: 2}, "epoch": 4})
    assert err[0] == "position_lost" and "none (empty)" in err[1]


def test_a_bad_cursor_epoch_is_a_bad_request():
    b = broker(5)
    (err, _, _), _, _ = read(b, {"low": 0, "offsets": {}, "epoch": -1})
    assert err[0] == "bad_request"


def test_the_epoch_file_round_trips_and_a_bad_one_is_unknown(tmp_path):
    history_epoch.write(tmp_path, 1, 0, 42)
    assert history_epoch.read(tmp_path, 1, 0) == 42
    assert history_epoch.read(tmp_path, 1, 1) == history_epoch.UNKNOWN_EPOCH
    path = \
        history_epoch.streamlet_dir(tmp_path, 1, 0) / history_epoch.EPOCH_FILE
    assert path.is_file()
    path.write_bytes(b"x" * 100)
    assert history_epoch.read(tmp_path, 1, 0) == history_epoch.UNKNOWN_EPOCH
    loaded = reload.Loaded({}, {}, 0)
    assert loaded.epochs is None   # older callers build Loaded without epochs


def test_positions_carry_the_epoch_and_older_ones_stay_valid():
    c = ConsumedCursor(0, 0, {}, epoch=None)
    c.consumed(0, 7, epoch=9)
    assert c.positions("s") == [Position("s", 0, 0, 7, 9)]
    old = Position("s", 0, 0, 7)   # saved by code that predates epochs
    assert old.epoch is None
    assert cursors_with_epochs([old], "s") == {0: (0, {0: 7}, None)}
    assert cursors_with_epochs([tuple(old)], "s") == {0: (0, {0: 7}, None)}
    assert cursors_with_epochs(c.positions("s"), "s") == {0: (0, {0: 7}, 9)}


def test_positions_of_two_histories_of_one_streamlet_are_refused():
    with pytest.raises(BadRequest, match="two histories"):
        cursors_with_epochs([Position("s", 0, 0, 7, 1), Position("s", 0, 1, 0, 2)], "s")


def test_the_fetch_cursor_sends_its_epoch_once_known():
    f = FetchCursor(0, 0, {})
    assert "epoch" not in f.wire()
    f.epoch = 3
    assert f.wire()["epoch"] == 3


def test_spark_cursors_carry_the_epoch_and_a_changed_one_is_data_loss():
    from kera.spark import offsets as ko
    groups = ko.Groups([ko.GroupInfo(0, 0, 0, 5, False)])
    groups.epoch = 9
    assert ko.advance(ko.Cursor(), groups).epoch == 9
    c = ko.Cursor(2, {1: 3}, 7)
    assert ko.Cursor.from_json(c.to_json()) == c
    assert "epoch" not in ko.Cursor(1, {}).to_json()   # offsets of older code stay the same
    assert "epoch 8 -> 9" in ko.epoch_lost(ko.Cursor(0, {0: 3}, 8), groups)
    assert ko.epoch_lost(ko.Cursor(0, {0: 3}, 9), groups) is None
    assert ko.epoch_lost(ko.Cursor(0, {0: 3}), groups) is None
