"""kera.services.deliver.targets.SqliteTarget: records and last-applied stored in one transaction."""

import pytest

import sqlite3

from kera.services.deliver.core import Applied
from kera.services.deliver.targets import SqliteTarget
from kera.errors import BadRequest
from kera.codec.position import Record


def rec(sl, offset, value=b"v"):
    return Record(b"k", value, 7, "s", sl, 0, offset, number=100 + offset)


def test_apply_stores_records_and_last_applied_together(tmp_path):
    target = SqliteTarget(str(tmp_path / "t.db"))
    assert target.last_applied() == {}
    target.apply([rec(0, 0), rec(1, 0), rec(0, 1, None)])
    assert target.last_applied() == {("s", 0): Applied("s", 0, 0, 1, 101),
                                     ("s", 1): Applied("s", 1, 0, 0, 100)}
    assert target.rows() == [("s", 0, 0, 0, b"k", b"v"), ("s", 0, 0, 1, b"k", None),
                             ("s", 1, 0, 0, b"k", b"v")]
    target.close()
    assert SqliteTarget(str(tmp_path / "t.db")).last_applied()[("s", 0)].offset == 1


def test_a_failed_batch_stores_nothing_of_itself(tmp_path):
    target = SqliteTarget(str(tmp_path / "t.db"))
    target.apply([rec(0, 0)])
    with pytest.raises(Exception):
        target.apply([rec(0, 1), rec(0, 0)])   # a duplicate: the whole batch is refused
    assert target.last_applied() == {("s", 0): Applied("s", 0, 0, 0, 100)}
    assert len(target.rows()) == 1


def test_table_prefix_must_be_a_plain_name(tmp_path):
    with pytest.raises(BadRequest, match="plain SQL name"):
        SqliteTarget(str(tmp_path / "t.db"), table_prefix="x; DROP TABLE y")


def test_tables_from_before_record_numbers_gain_the_column_and_keep_their_rows(tmp_path):
    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as db:   # the layout kera made before record numbers
        db.execute("CREATE TABLE kera_deliver_records (stream TEXT NOT NULL, streamlet INTEGER "
                   "NOT NULL, grp BIGINT NOT NULL, off BIGINT NOT NULL, k BLOB, v BLOB, ts_us "
                   "BIGINT NOT NULL, PRIMARY KEY (stream, streamlet, grp, off))")
        db.execute("CREATE TABLE kera_deliver_applied (stream TEXT NOT NULL, streamlet INTEGER "
                   "NOT NULL, grp BIGINT NOT NULL, off BIGINT NOT NULL, PRIMARY KEY (stream, "
                   "streamlet))")
        db.execute("INSERT INTO kera_deliver_records VALUES ('s', 0, 0, 0, x'6b', x'76', 7)")
        db.execute("INSERT INTO kera_deliver_applied VALUES ('s', 0, 0, 0)")
    target = SqliteTarget(path)
    assert target.last_applied() == {("s", 0): Applied("s", 0, 0, 0, None)}
    target.apply([rec(0, 1)])
    assert target.last_applied() == {("s", 0): Applied("s", 0, 0, 1, 101)}
    assert [r[3] for r in target.rows()] == [0, 1]
