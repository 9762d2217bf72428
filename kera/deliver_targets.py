"""Delivery targets: the interface, and the SQL ones (SQLite and PostgreSQL).

A target stores records and its last-applied position per (stream, streamlet) atomically, and
reports those positions back: they are the source of truth a deliverer resumes from after any
crash (kera.deliver_core explains why a Position is the ordering index for now).

The SQL targets keep two tables, written in one transaction per batch:
    PREFIX_records (stream, streamlet, grp, off, k, v, ts_us)   key (stream, streamlet, grp, off)
    PREFIX_applied (stream, streamlet, grp, off)                key (stream, streamlet)
"""

from __future__ import annotations

import re

from kera.errors import BadRequest
from kera.position import Position, Record

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

    def last_applied(self) -> dict[tuple[str, int], Position]:
        """{(stream, streamlet): position of the last record applied}; {} when none."""
        raise NotImplementedError

    def apply(self, records: list[Record]) -> None:
        """Store `records` (in order) and their streamlets' new last-applied positions in one
        atomic step; raise on any failure (nothing of the batch may then be stored)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections (the deliverer calls it on stop and before retrying)."""


def _check_prefix(prefix: str) -> str:
    if not _IDENTIFIER.match(prefix):
        raise BadRequest(f"table prefix {prefix!r} is not a plain SQL name (letters, digits, _)")
    return prefix


class SqlTarget(Target):
    """Records and last-applied positions in two tables of a DB-API database."""

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
                    f"PRIMARY KEY (stream, streamlet, grp, off))")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {self.prefix}_applied (stream TEXT NOT NULL, "
                    f"streamlet INTEGER NOT NULL, grp BIGINT NOT NULL, off BIGINT NOT NULL, "
                    f"PRIMARY KEY (stream, streamlet))")
        conn.commit()

    def last_applied(self) -> dict[tuple[str, int], Position]:
        conn = self._connection()
        cur = conn.cursor()
        cur.execute(f"SELECT stream, streamlet, grp, off FROM {self.prefix}_applied")
        rows = cur.fetchall()
        conn.commit()
        return {(st, sl): Position(st, sl, g, o) for st, sl, g, o in rows}

    def apply(self, records: list[Record]) -> None:
        conn = self._connection()
        p = self.param
        last = {(r.stream, r.streamlet): r for r in records}
        try:
            cur = conn.cursor()
            cur.executemany(f"INSERT INTO {self.prefix}_records VALUES ({p}, {p}, {p}, {p}, {p}, "
                            f"{p}, {p})", [(r.stream, r.streamlet, r.group, r.offset, r.key,
                                            r.value, r.timestamp) for r in records])
            cur.executemany(f"INSERT INTO {self.prefix}_applied VALUES ({p}, {p}, {p}, {p}) "
                            f"ON CONFLICT (stream, streamlet) DO UPDATE SET grp = excluded.grp, "
                            f"off = excluded.off", [(r.stream, r.streamlet, r.group, r.offset)
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
