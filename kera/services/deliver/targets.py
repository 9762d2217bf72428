"""Delivery targets: the interface, and the SQL ones (SQLite and PostgreSQL).

A target stores records and its last applied record per (stream, streamlet) atomically, and
reports those back: they are the source of truth a deliverer resumes from after any crash
(kera.services.deliver.core: the record number is the ordering index, the position the exact resume).

The SQL targets keep two tables, written in one transaction per batch:
    PREFIX_records (stream, streamlet, grp, off, k, v, ts_us, num)  key (stream, streamlet, grp, off)
    PREFIX_applied (stream, streamlet, grp, off, num)               key (stream, streamlet)
`num` is the record number (NULL for records written before numbers). Tables made by an
earlier kera, without `num`, are given the column when first opened.
"""

from __future__ import annotations

import re

from kera.services.deliver.core import Applied
from kera.errors import BadRequest
from kera.codec.position import Record

DEFAULT_TABLE_PREFIX = "kera_deliver"
# SQL identifiers are spliced into statements: only plain names are accepted.
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")
# PostgreSQL connect timeout: a dead database fails an attempt instead of hanging it.
PG_CONNECT_TIMEOUT_S = 5
# A PostgreSQL statement's run at most: a hung database fails an attempt (then retried) rather
# than holding its delivery thread forever.
PG_STATEMENT_TIMEOUT_MS = 30_000
# PostgreSQL sessions of a deliverer say so in pg_stat_activity (operators and tests find them).
PG_APPLICATION_NAME = "kera-deliver"


class Target:
    """What a deliverer pushes to. Subclasses implement the two calls; `name` is for logs."""

    name = "target"

    def last_applied(self) -> dict[tuple[str, int], Applied]:
        """{(stream, streamlet): the last record applied, as an Applied (its record number
        and/or its position; a plain Position is accepted too)}; {} when none."""
        raise NotImplementedError

    def apply(self, records: list[Record]) -> None:
        """Store `records` (in order) and their streamlets' new last applied (number and/or
        position) in one atomic step; raise on any failure (nothing of the batch may then be
        stored)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections (the deliverer calls it on stop and before retrying)."""


def _check_prefix(prefix: str) -> str:
    if not _IDENTIFIER.match(prefix):
        raise BadRequest(f"table prefix {prefix!r} is not a plain SQL name (letters, digits, _)")
    return prefix


class SqlTarget(Target):
    """Records and last applied records in two tables of a DB-API database."""

    blob_type = "BLOB"
    param = "?"

    def __init__(self, name: str, table_prefix: str = DEFAULT_TABLE_PREFIX):
        self.name = name
        self.prefix = _check_prefix(table_prefix)
        self._conn = None

    def _connect(self):
        raise NotImplementedError

    def _connection(self):
        if self._conn is None:
            conn = self._connect()
            try:
                self._create_tables(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _create_tables(self, conn) -> None:
        cur = conn.cursor()
        cur.execute(f"CREATE TABLE IF NOT EXISTS {self.prefix}_records (stream TEXT NOT NULL, "
                    f"streamlet INTEGER NOT NULL, grp BIGINT NOT NULL, off BIGINT NOT NULL, "
                    f"k {self.blob_type}, v {self.blob_type}, ts_us BIGINT NOT NULL, "
                    f"num BIGINT, PRIMARY KEY (stream, streamlet, grp, off))")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {self.prefix}_applied (stream TEXT NOT NULL, "
                    f"streamlet INTEGER NOT NULL, grp BIGINT NOT NULL, off BIGINT NOT NULL, "
                    f"num BIGINT, PRIMARY KEY (stream, streamlet))")
        conn.commit()
        for table in ("records", "applied"):
            self._add_number_column(conn, f"{self.prefix}_{table}")

    @staticmethod
    def _add_number_column(conn, table: str) -> None:
        """Tables made before record numbers get their `num` column (NULL for old rows)."""
        cur = conn.cursor()
        try:
            cur.execute(f"SELECT num FROM {table} WHERE 1 = 0")
            conn.commit()
        except Exception:   # no such column (sqlite3.OperationalError, psycopg UndefinedColumn)
            conn.rollback()
            cur = conn.cursor()
            cur.execute(f"ALTER TABLE {table} ADD COLUMN num BIGINT")
            conn.commit()

    def last_applied(self) -> dict[tuple[str, int], Applied]:
        conn = self._connection()
        cur = conn.cursor()
        cur.execute(f"SELECT stream, streamlet, grp, off, num FROM {self.prefix}_applied")
        rows = cur.fetchall()
        conn.commit()
        return {(st, sl): Applied(st, sl, g, o, n) for st, sl, g, o, n in rows}

    def apply(self, records: list[Record]) -> None:
        conn = self._connection()
        p = self.param
        last = {(r.stream, r.streamlet): r for r in records}
        try:
            cur = conn.cursor()
            cur.executemany(f"INSERT INTO {self.prefix}_records (stream, streamlet, grp, off, k, "
                            f"v, ts_us, num) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})",
                            [(r.stream, r.streamlet, r.group, r.offset, r.key, r.value,
                              r.timestamp, r.number) for r in records])
            cur.executemany(f"INSERT INTO {self.prefix}_applied (stream, streamlet, grp, off, "
                            f"num) VALUES ({p}, {p}, {p}, {p}, {p}) ON CONFLICT (stream, "
                            f"streamlet) DO UPDATE SET grp = excluded.grp, off = excluded.off, "
                            f"num = excluded.num",
                            [(r.stream, r.streamlet, r.group, r.offset, r.number)
                             for r in last.values()])
            conn.commit()
        except BaseException:
            self.close()   # a failed connection is reopened (and the transaction dropped)
            raise

    def rows(self) -> list[tuple]:
        """Every stored record as (stream, streamlet, grp, off, k, v), in position order."""
        cur = self._connection().cursor()
        cur.execute(f"SELECT stream, streamlet, grp, off, k, v FROM {self.prefix}_records "
                    f"ORDER BY stream, streamlet, grp, off")
        rows = [tuple(bytes(c) if isinstance(c, memoryview) else c for c in row)
                for row in cur.fetchall()]
        self._conn.commit()
        return rows

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass   # closing a broken connection: nothing more to release


class SqliteTarget(SqlTarget):
    """A SQLite database file (stdlib sqlite3)."""

    def __init__(self, path: str, table_prefix: str = DEFAULT_TABLE_PREFIX):
        super().__init__(f"sqlite:{path}", table_prefix)
        self.path = path

    def _connect(self):
        import sqlite3
        # timeout: how long a write waits for another process's lock before failing the batch.
        return sqlite3.connect(self.path, timeout=5.0, check_same_thread=False)


class PostgresTarget(SqlTarget):
    """A PostgreSQL database (psycopg 3), `dsn` a URL or "host=... dbname=..." string."""

    blob_type = "BYTEA"
    param = "%s"

    def __init__(self, dsn: str, table_prefix: str = DEFAULT_TABLE_PREFIX, name: str = ""):
        super().__init__(name or _redacted(dsn), table_prefix)
        self.dsn = dsn

    def _connect(self):
        import psycopg
        return psycopg.connect(self.dsn, connect_timeout=PG_CONNECT_TIMEOUT_S,
                               application_name=PG_APPLICATION_NAME,
                               options=f"-c statement_timeout={PG_STATEMENT_TIMEOUT_MS}")


def _redacted(dsn: str) -> str:
    """`dsn` without a password, for logs."""
    dsn = re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", dsn)
    return re.sub(r"password=\S+", "password=***", dsn)
