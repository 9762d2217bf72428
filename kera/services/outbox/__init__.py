"""The PostgreSQL transactional-outbox harvester (`kera outbox`)."""
