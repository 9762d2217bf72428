"""The coordinator's group-lag gauges: which parts a pass asks about, and their text."""

from kera.consumer.lag import Lag
from kera.coordinator import group_lag
from kera.coordinator.group_lag import _bounded, lag_text


def test_parts_of_deleted_streams_are_left_out_and_the_rest_is_bounded(monkeypatch):
    positions = {"g1": [["a", 0, [[0, 5, None]]], ["gone", 0, [[0, 1, None]]]],
                 "g2": [["a", 1, [[0, 2, None]]], ["a", 2, [[0, 2, None]]]]}
    wanted, skipped = _bounded(positions, {"a"})
    assert wanted == {"g1": [["a", 0, [[0, 5, None]]]],
                      "g2": [["a", 1, [[0, 2, None]]], ["a", 2, [[0, 2, None]]]]}
    assert skipped == 0
    monkeypatch.setattr(group_lag, "LAG_PARTS_MAX", 2)
    wanted, skipped = _bounded(positions, {"a"})
    assert sum(map(len, wanted.values())) == 2 and skipped == 1


def test_gauges_are_labelled_by_group_stream_streamlet_and_escaped():
    text = lag_text({'we"ird': {("s", 3): Lag(40, 4096)}, "old": {("s", 0): Lag(7, None)}},
                    skipped=0, errors=1)
    lines = text.splitlines()
    assert 'kera_group_lag_records{group="we\\"ird",stream="s",streamlet="3"} 40' in lines
    assert 'kera_group_lag_bytes{group="we\\"ird",stream="s",streamlet="3"} 4096' in lines
    assert 'kera_group_lag_records{group="old",stream="s",streamlet="0"} 7' in lines
    assert not any(line.startswith('kera_group_lag_bytes{group="old"') for line in lines)
    assert "kera_group_lag_groups_unknown 1" in lines
    assert lines.index("# TYPE kera_group_lag_records gauge") < lines.index(
        'kera_group_lag_records{group="old",stream="s",streamlet="0"} 7')
