"""Services built on the log: conditional appends, exactly-once delivery to targets, the outbox."""
