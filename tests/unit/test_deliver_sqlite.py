"""kera.deliver_targets.SqliteTarget: records and last-applied stored in one transaction."""

import pytest

from kera.deliver_targets import SqliteTarget
from kera.errors import BadRequest
from kera.position import Position, Record


def rec(sl, offset, value=b"v"):
    return Record(b"k", value, 7, "s", sl, 0, offset)


def test_apply_stores_records_and_last_applied_together(tmp_path):
    target = SqliteTarget(str(tmp_path / "t.db"))
    assert target.last_applied() == {}
    target.apply([rec(0, 0), rec(1, 0), rec(0, 1, None)])
    assert target.last_applied() == {("s", 0): Position("s", 0, 0, 1),
                                     ("s", 1): Position("s", 1, 0, 0)}
    assert target.rows() == [("s", 0, 0, 0, b"k", b"v"), ("s", 0, 0, 1, b"k", None),
                             ("s", 1, 0, 0, b"k", b"v")]
    target.close()
    assert SqliteTarget(str(tmp_path / "t.db")).last_applied()[("s", 0)].offset == 1


def test_a_failed_batch_stores_nothing_of_itself(tmp_path):
    target = SqliteTarget(str(tmp_path / "t.db"))
    target.apply([rec(0, 0)])
    with pytest.raises(Exception):
        target.apply([rec(0, 1), rec(0, 0)])   # a duplicate: the whole batch is refused
    assert target.last_applied() == {("s", 0): Position("s", 0, 0, 0)}
    assert len(target.rows()) == 1


def test_table_prefix_must_be_a_plain_name(tmp_path):
    with pytest.raises(BadRequest, match="plain SQL name"):
        SqliteTarget(str(tmp_path / "t.db"), table_prefix="x; DROP TABLE y")
