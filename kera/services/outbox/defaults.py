"""The outbox harvester's defaults (kera.services.outbox.harvester), importable without psycopg (kera.cli.outbox)."""

TABLE = "outbox"
# Rows in flight (sent, unacknowledged) at once, and rows marked and held in memory at once.
IN_FLIGHT_MAX = 1_000
MARKED_MAX = 10_000
# An empty outbox is polled this often: the delay before a new row starts being published.
POLL_INTERVAL_MS = 100
# How long a harvester that stops heartbeating stays a group member: the takeover time after a
# leader dies. It steps down after 80% of it (kera.consumer.membership.SELF_FENCE_FRACTION).
SESSION_TIMEOUT_MS = 10_000
# How often a leader saves a checkpoint (pausing marking until its in-flight rows settle): a
# successor reads about this much of the stream to find what it published but did not purge.
CHECKPOINT_INTERVAL_S = 5.0
DB_CONNECT_TIMEOUT_S = 5           # libpq takes whole seconds
# A database that stops answering (a partition without a reset) ends the term after this: the
# kernel drops a connection whose sent data stays unacknowledged this long (libpq
# tcp_user_timeout), and the server cancels a statement running this long.
DB_TCP_USER_TIMEOUT_MS = 10_000
DB_STATEMENT_TIMEOUT_MS = 30_000
