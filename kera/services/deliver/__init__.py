"""Exactly-once delivery of a stream to SQL databases and HTTP endpoints (`kera deliver`)."""
