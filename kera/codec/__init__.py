"""Bytes on the wire and in memory: the chunk, the envelope and its schema, positions, timestamps."""
