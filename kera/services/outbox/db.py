"""The outbox table in PostgreSQL: its schema and the harvester's statements (psycopg 3).

    CREATE TABLE outbox (
      id            bigserial PRIMARY KEY,       -- publication order (per key)
      key           text NOT NULL,               -- the record key; order is kept per key
      value         bytea,                       -- the record value (NULL: a tombstone)
      header_keys   text[] NOT NULL DEFAULT '{}',   -- record headers, pairwise with
      header_values bytea[] NOT NULL DEFAULT '{}',  -- header_values
      created_at    timestamptz NOT NULL DEFAULT now(),
      leader_id     uuid                         -- the harvester term that marked it, or NULL
    );
    CREATE TABLE outbox_leaders (leader_id uuid PRIMARY KEY, positions jsonb NOT NULL,
                                 saved_at timestamptz NOT NULL DEFAULT now());

A service inserts rows (key, value and optionally headers) in its own transactions; the
harvester marks (sets leader_id), purges (deletes) and resets (clears leader_id) them, and parks
a row whose record the cluster refuses (leader_id = PARKED_LEADER_ID, all zeros) for an operator.
`<table>_leaders` holds each term's checkpoint: the stream's end positions before anything it
published that is still in the table (kera.services.outbox.core).
"""

from __future__ import annotations

import json

from psycopg import sql

from kera.services.outbox.core import PARKED_LEADER_ID, Row
from kera.codec.position import Position

SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
  id            bigserial PRIMARY KEY,
  key           text NOT NULL,
  value         bytea,
  header_keys   text[] NOT NULL DEFAULT '{{}}',
  header_values bytea[] NOT NULL DEFAULT '{{}}',
  created_at    timestamptz NOT NULL DEFAULT now(),
  leader_id     uuid
);
CREATE INDEX IF NOT EXISTS {marked_index} ON {table} (leader_id) WHERE leader_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS {leaders} (
  leader_id  uuid PRIMARY KEY,
  positions  jsonb NOT NULL,
  saved_at   timestamptz NOT NULL DEFAULT now()
);
"""

# Oldest first, unmarked only: earlier terms' marks are settled at takeover (OutboxTable.suspects).
# A row is marked by one term only. Two markers at once (a frozen leader resuming beside its
# successor) must not both take a row: the subquery skips rows another marker has locked, and
# the outer condition is checked again on a row changed meanwhile (without it a marker that
# waited on a row's lock overwrote the other's mark, and the stale leader's reset on stepping
# down then unmarked rows its successor had already published, which went out again).
MARK = """
UPDATE {table} SET leader_id = %s
WHERE leader_id IS NULL AND id IN (
    SELECT id FROM {table} WHERE leader_id IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, key, value, header_keys, header_values
"""


def create_schema(conn, table: str) -> None:
    """Create the outbox table and its checkpoint table (if missing)."""
    conn.execute(_sql(SCHEMA, table))
    conn.commit()


def _sql(template: str, table: str) -> sql.Composed:
    return sql.SQL(template).format(table=sql.Identifier(table),
                                    leaders=sql.Identifier(f"{table}_leaders"),
                                    marked_index=sql.Identifier(f"{table}_marked"))


def positions_to_json(positions: list[Position]) -> str:
    return json.dumps([list(p) for p in positions])


def positions_from_json(text) -> list[Position]:
    entries = json.loads(text) if isinstance(text, str) else text
    return [Position(*entry) for entry in entries]


def _headers(keys: list[str], values: list) -> tuple:
    """A row's header arrays as (str, bytes) pairs (a NULL value: empty bytes)."""
    return tuple((k, bytes(v or b"")) for k, v in zip(keys, values))


class OutboxTable:
    """The harvester's statements on one outbox table, over one autocommit connection."""

    def __init__(self, conn, table: str):
        self.conn, self.table = conn, table

    def _run(self, template: str, params=()):
        return self.conn.execute(_sql(template, self.table), params)

    def mark(self, leader_id: str, limit: int) -> list[Row]:
        """Mark up to `limit` unmarked rows, oldest first, for this term; returns them."""
        cursor = self._run(MARK, (leader_id, limit))
        return [Row(i, key, value, _headers(hkeys, hvalues))
                for i, key, value, hkeys, hvalues in cursor.fetchall()]

    def purge(self, ids: list[int]) -> None:
        """Delete published rows (whoever marked them: their records are in the stream)."""
        if ids:
            self._run("DELETE FROM {table} WHERE id = ANY(%s)", (ids,))

    def reset(self, leader_id: str, ids: list[int]) -> None:
        """Clear this term's marks on `ids` (rows it never sent)."""
        if ids:
            self._run("UPDATE {table} SET leader_id = NULL WHERE id = ANY(%s) AND leader_id = %s",
                      (ids, leader_id))

    def park(self, leader_id: str, ids: list[int]) -> None:
        """Set aside rows whose records were refused (PARKED_LEADER_ID): never marked again
        until an operator clears the mark."""
        if ids:
            self._run("UPDATE {table} SET leader_id = %s WHERE id = ANY(%s) AND leader_id = %s",
                      (PARKED_LEADER_ID, ids, leader_id))

    def save_checkpoint(self, leader_id: str, positions: list[Position]) -> None:
        self._run("INSERT INTO {leaders} (leader_id, positions) VALUES (%s, %s) "
                  "ON CONFLICT (leader_id) DO UPDATE SET positions = EXCLUDED.positions, "
                  "saved_at = now()", (leader_id, positions_to_json(positions)))

    def suspects(self, leader_id: str) -> dict[str, set[int]]:
        """Rows marked by other terms (parked ones aside): {their leader id: row ids}."""
        out: dict[str, set[int]] = {}
        rows = self._run("SELECT leader_id::text, id FROM {table} WHERE leader_id IS NOT NULL "
                         "AND leader_id <> %s AND leader_id <> %s", (leader_id, PARKED_LEADER_ID))
        for leader, row_id in rows.fetchall():
            out.setdefault(leader, set()).add(row_id)
        return out

    def checkpoints(self, leader_ids) -> dict[str, list[Position]]:
        rows = self._run("SELECT leader_id::text, positions FROM {leaders} "
                         "WHERE leader_id = ANY(%s::uuid[])", (list(leader_ids),))
        return {leader: positions_from_json(p) for leader, p in rows.fetchall()}

    def settle(self, leader_id: str, earlier: list[str], purge: set[int],
               reset: set[int]) -> None:
        """In one transaction: purge earlier terms' published rows, reset the rest (those still
        marked by the `earlier` terms: never a later term's marks), and drop the checkpoints
        saved before this term's (no row of theirs is left)."""
        with self.conn.transaction():
            self.purge(sorted(purge))
            if reset:
                self._run("UPDATE {table} SET leader_id = NULL WHERE id = ANY(%s) "
                          "AND leader_id = ANY(%s::uuid[])", (sorted(reset), earlier))
            self._run("DELETE FROM {leaders} WHERE saved_at < "
                      "(SELECT saved_at FROM {leaders} WHERE leader_id = %s)", (leader_id,))
